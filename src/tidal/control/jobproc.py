"""The per-job process the agent starts on a job's first node (the job master
of EDL §3 / DLRover's master pod): it hosts the runtime's JobMaster, asks the
server for worker processes (``/internal/jobs/{id}/spawn``; agents launch
them on the GPUs the coordinator chose) and reports the master's status every
half second. It exits 0 when the job finished.

    python -m tidal.control.jobproc --job ID --server URL --workers N --hosts GID,GID
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import urllib.request
from pathlib import Path

log = logging.getLogger("tidal.jobproc")


class ServerClient:
    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url.rstrip("/"), token

    def post(self, path: str, body: dict, patience_s: float = 60.0) -> dict:
        """POST with retries while the server is unreachable (it may restart)."""
        data = json.dumps(body).encode()
        deadline = time.time() + patience_s
        while True:
            req = urllib.request.Request(self.url + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {self.token}"})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return json.loads(r.read() or b"{}")
            except Exception as e:  # noqa: BLE001 - retry any transport error
                if time.time() > deadline:
                    raise
                log.debug("server unreachable (%s); retrying", e)
                time.sleep(0.5)


class RemoteSpawner:
    """The master's spawner: new worker ids go to the server with the GPU ids
    (``hosts``) the coordinator passed to ``scale_out``."""

    def __init__(self, server: ServerClient, job: str) -> None:
        self.server, self.job = server, job

    def __call__(self, ids: list[str], hosts: list[str] | None = None) -> None:
        if not hosts or len(hosts) != len(ids):
            raise ValueError("the control plane spawns workers only on GPUs it names (hosts = GPU ids)")
        ans = self.server.post(f"/internal/jobs/{self.job}/spawn", {"ids": ids, "gpus": [int(h) for h in hosts]})
        if not ans.get("ok"):
            raise RuntimeError(ans.get("error", "spawn refused"))

    def kill(self, worker_id: str) -> None:
        """A hung worker: its agent stops it (the master's check_health)."""
        ans = self.server.post(f"/internal/jobs/{self.job}/kill", {"name": worker_id}, patience_s=5)
        if not ans.get("ok"):
            raise RuntimeError(f"no live worker {worker_id}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tidal.control.jobproc")
    ap.add_argument("--job", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--hosts", required=True)
    ap.add_argument("--state-dir", default=None)
    ap.add_argument("--first-id", type=int, default=0, help="number of the first worker id (w<N>)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tidal.runtime import JobMaster, MasterServer
    from tidal.runtime.persistence import open_backend

    server = ServerClient(a.server, os.environ.get("TIDAL_AGENT_TOKEN", ""))
    state_dir = Path(a.state_dir or Path(os.environ.get("TIDAL_HOME", Path.home() / ".tidal")) / "masters")
    state_dir.mkdir(parents=True, exist_ok=True)
    backend = open_backend(f"file://{state_dir / (a.job + '.json')}")
    spawner = RemoteSpawner(server, a.job)
    master = JobMaster(a.job, a.workers, backend=backend, spawner=spawner)
    srv = MasterServer(master).start()
    server.post(f"/internal/jobs/{a.job}/master", {"url": srv.url, "pid": os.getpid()})
    hosts = a.hosts.split(",")
    ids = [f"w{a.first_id + i}" for i in range(a.workers)]
    master.spawned = a.first_id + a.workers
    spawner(ids, hosts)
    log.info("job %s master %s, %d workers on GPUs %s", a.job, srv.url, a.workers, hosts)
    rc = 0
    try:
        while True:
            st = master.status()
            body = {"state": st.state, "step": st.step, "epoch": st.epoch, "world_size": st.world_size,
                    "members": list(st.members), "gen": st.gen, "step_time_s": st.step_time_s,
                    "changes": list(st.changes)}
            try:
                server.post(f"/internal/jobs/{a.job}/status", body, patience_s=5)
            except Exception as e:  # noqa: BLE001 - keep training while the server is away
                log.warning("status report failed: %s", e)
            if st.state == "finished":
                break
            if st.state == "suspended":
                # every worker posts /left as it goes: let that through before the server stops
                linger = time.time() + 10
                while time.time() < linger and any(
                        w.get("state") in ("active", "leaving") for w in master.snapshot()["workers"].values()):
                    time.sleep(0.1)
                break
            for _ in range(5):
                master.check_health()  # hung workers are killed through their agent
                time.sleep(0.1)
    finally:
        srv.stop()
    return rc


if __name__ == "__main__":
    sys.exit(main())
