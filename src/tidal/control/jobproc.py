"""The per-job process the agent starts on a job's first node (the job master
of EDL §3 / DLRover's master pod): it hosts the runtime's JobMaster with
:func:`tidal.runtime.host.host_master`, tells the server its URL and reports
the master's status every half second. The coordinator starts the job's
workers (the master is told their ids: the first ones on this command line,
later ones with each ``scale_out``); the master only kills hung ones, through
the server. It exits 0 when the job finished or was suspended.

    python -m tidal.control.jobproc --job ID --server URL --size N --first-worker K
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlparse
from typing import Any, Callable, Sequence

from tidal import settings
from tidal.httpjson import JsonHttp, Unavailable
from tidal.runtime.messages import Status
from tidal.runtime.spawner import WorkerLaunch

log = logging.getLogger("tidal.jobproc")

#: how long a suspended job's master waits for its workers to report they left
LINGER_S = 10.0
#: exit code of a master the server replaced by one on another host (its agent does not restart it)
EXIT_REPLACED = 3


class ControlPlaneSpawner:
    """The master's spawner on the control plane: it starts nothing (the
    coordinator starts this job's workers) and stops a hung worker through
    its agent (``POST /internal/jobs/{id}/kill``)."""

    def __init__(self, server: JsonHttp, job: str, lost: Sequence[str] = ()) -> None:
        self.server, self.job = server, job
        self.lost = tuple(lost)  # workers that died with the host of this job's previous master
        self.ended: dict[str, int] = {}  # workers the server saw end with an error or a signal (status answers)

    def spawn(self, launches: Sequence[WorkerLaunch]) -> None:
        ids = [x.worker_id for x in launches]
        raise RuntimeError(f"job {self.job} runs on the control plane: the coordinator starts its workers, "
                           f"not its master (asked for {ids})")

    def kill(self, worker_id: str) -> None:
        status, ans = self.server.call("POST", f"/internal/jobs/{self.job}/kill", {"name": worker_id}, patience_s=5)
        if status >= 400 or not (isinstance(ans, dict) and ans.get("ok")):
            raise RuntimeError(f"no live worker {worker_id} of {self.job}: {ans}")

    def note_ended(self, ended: Any) -> None:
        """The server's answer to a status report names the job's workers
        that ended badly (a worker that died before it registered is dropped
        by the master at once, not after the join time-out)."""
        if isinstance(ended, dict):
            self.ended.update({str(w): int(c) for w, c in ended.items() if isinstance(c, int) and c != 0})

    def exit_codes(self) -> dict[str, int | None]:
        # the server sees the processes, not this master: those lost with the previous master's host, and
        # those its status answers named
        return {**{w: -9 for w in self.lost}, **self.ended}


class Reporter:
    """Posts the master's status to the server and decides when the master's
    work is over: the job finished, or it was suspended and its workers left."""

    def __init__(self, server: JsonHttp, job: str, workers_left: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic, node: str = "",
                 on_ended: Callable[[Any], None] = lambda ended: None) -> None:
        self.server, self.job, self.node, self.on_ended = server, job, node, on_ended
        self.fenced = False  # the server runs this job's master on another host now
        self.workers_left, self.clock = workers_left, clock
        self.last: Status | None = None
        self._suspended_at: float | None = None

    def report(self, st: Status, suspended: dict[str, Any] | None = None) -> None:
        self.last = st
        body = {**({"suspended_step": int(suspended["step"])} if suspended else {}),"state": st.state, "step": st.step, "epoch": st.epoch, "world_size": st.world_size,
                "members": list(st.members), "gen": st.gen, "step_time_s": st.step_time_s,
                "changing": st.changing, "changes": list(st.changes), "node": self.node,
                **({"goodput": _finite(st.goodput)} if st.goodput else {})}  # noise scale, batch, LR factor
        try:
            code, ans = self.server.call("POST", f"/internal/jobs/{self.job}/status", body, patience_s=5)
        except Unavailable as e:  # keep training while the server is away
            log.warning("status report failed: %s", e)
            return
        if code == 409:
            log.error("this master was replaced: %s", ans)
            self.fenced = True
        elif code < 400 and isinstance(ans, dict):
            self.on_ended(ans.get("ended"))

    def done(self) -> bool:
        if self.fenced:
            return True
        st = self.last
        if st is None:
            return False
        if st.state == "finished":
            return True
        if st.state != "suspended":
            return False
        # every worker posts /left as it goes: let that through before the master stops
        if self._suspended_at is None:
            self._suspended_at = self.clock()
        return self.workers_left() or self.clock() - self._suspended_at > LINGER_S


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with non-finite numbers as None: the server keeps reports as
    plain JSON and refuses NaN (a report refused would lose the step too)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()
            if isinstance(v, (int, float, str, bool)) or v is None}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tidal.control.jobproc")
    ap.add_argument("--job", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--size", type=int, required=True, help="number of workers the job starts with")
    ap.add_argument("--first-worker", type=int, default=0, help="number of the first worker id (w<N>)")
    ap.add_argument("--state-dir", default=None)
    ap.add_argument("--resume", action="store_true",
                    help="a restart after a crash: continue from the saved state (this host's file or the "
                         "server's copy, the newer), on the same ports if this host ran the master before")
    ap.add_argument("--lost", default="",
                    help="comma-separated workers that died with the previous master's host")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tidal.runtime import JobMaster, MasterServer
    from tidal.runtime.host import host_master
    from tidal.control.masterstate import Mirrored, ServerBackend
    from tidal.runtime.persistence import FileBackend
    from tidal.net import advertise_addr, bind_addr

    server = JsonHttp(a.server, token=settings.job_token(), timeout_s=10.0, patience_s=60.0)
    node = settings.NODE.get() or ""
    # this host's copy (a restart here uses its ports again); the server keeps the other. Under an agent:
    # the job's private directory on this host (the master may run as the job's own user)
    state_dir = Path(a.state_dir or settings.JOB_DIR.get() or settings.home() / "masters" / (node or "local"))
    state_dir.mkdir(parents=True, exist_ok=True)
    backend = Mirrored(FileBackend(str(state_dir / f"{a.job}.json")),
                       ServerBackend(a.server, a.job))
    ports_file = state_dir / f"{a.job}.ports.json"
    ports = json.loads(ports_file.read_text()) if a.resume and ports_file.exists() else {"http": 0, "store": 0}
    bind = bind_addr()
    adv = advertise_addr(bind, peer=urlparse(a.server.split(",")[0]).hostname, explicit=settings.ADVERTISE_ADDR.get())
    lost = [w for w in a.lost.split(",") if w]
    spawner = ControlPlaneSpawner(server, a.job, lost)
    master = JobMaster(a.job, a.size, backend=backend, spawner=spawner,
                       first_worker=a.first_worker, store_host=adv, store_port=int(ports["store"]),
                       resume=a.resume)
    srv = MasterServer(master, host=bind, port=int(ports["http"]), advertise=adv).start()
    # a restarted master (Elan §V-D) listens where its workers look for it
    ports_file.write_text(json.dumps({"http": int(srv.httpd.server_address[1]), "store": master.store_port}))
    status, ans = server.call("POST", f"/internal/jobs/{a.job}/master",
                              {"url": srv.url, "pid": os.getpid(), "node": node})
    if status >= 400:
        log.error("the server refused this master: %s", ans)
        if status == 409:  # another host runs this job's master now
            srv.stop()
            return EXIT_REPLACED
    log.info("job %s master %s, %d workers from w%d", a.job, srv.url, a.size, a.first_worker)

    def workers_left() -> bool:
        workers: dict[str, Any] = master.snapshot()["workers"]
        return not any(w.get("state") in ("active", "leaving") for w in workers.values())

    reporter = Reporter(server, a.job, workers_left, node=node, on_ended=spawner.note_ended)
    try:
        host_master(master, stop=lambda: reporter.done() or backend.fenced.is_set(),
                    on_status=lambda st: reporter.report(st, master.suspended),
                    status_every_s=0.5, poll_s=0.1)
    finally:
        srv.stop()
        backend.close()
    return EXIT_REPLACED if reporter.fenced or backend.fenced.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
