"""The control plane without a single point of failure, measured: two
``tidal server`` replicas over one PostgreSQL (started here with initdb/
pg_ctl, on loopback), an agent and a training job; a burst of submissions
through a client that knows both replicas; the leader is killed with -9
in the middle of it.

    python benchmarks/failover.py --json [--jobs 200] [--clients 4]

Prints one JSON line:

* ``failover_s``: from the kill until the other replica reports it leads;
* ``acknowledged_lost``: submissions answered 2xx whose job is not listed
  afterwards (must be 0); ``duplicated``: jobs beyond one per submission;
* ``api_p95_ms`` / ``api_p95_ms_failover``: submission latency over the burst
  and within 5 s after the kill (a client moves on to the other replica);
* ``trained_on``: steps the running job made after the kill (it keeps training);
* ``gpu_twice``: assignments of a GPU already held, in the audit trail (must be 0);
* ``new_leader_ready``: the new leader's ``GET /readyz`` answered 200 (store
  reachable, its scheduling loop going round); ``lease_s``: the lease bound.

A kill closes the leader's connections at once. A leader whose host goes
silent instead (powered off, link cut: no reset) is the scenario of
tests/multihost/test_leader_silent.py (network namespaces; docs/control.md,
"Several server replicas"): a follower leads within ``TIDAL_LEADER_LEASE_S``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tidal.control.client import Api, ApiError
from tidal.control.leader import lease_bound

DEMO_JOB = Path(__file__).resolve().parents[1] / "src" / "tidal" / "control" / "demo_job.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pg_bin(name: str) -> str:
    found = shutil.which(name) or next((str(d / name) for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"),
                                                                       reverse=True) if (d / name).exists()), None)
    if not found:
        raise SystemExit(f"PostgreSQL's {name} is not installed (apt-get install postgresql)")
    return found


class Postgres:
    """A throw-away PostgreSQL server on a loopback port."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tidal-failover-pg-"))
        self.port = free_port()
        root = os.geteuid() == 0
        if root:
            shutil.chown(self.dir, "postgres", "postgres")
        self.run = (lambda cmd: ["runuser", "-u", "postgres", "--", *cmd]) if root else (lambda cmd: cmd)
        subprocess.run(self.run([pg_bin("initdb"), "-D", str(self.dir / "data"), "-A", "trust", "-U", "postgres"]),
                       check=True, capture_output=True, timeout=120)
        subprocess.run(self.run([pg_bin("pg_ctl"), "-D", str(self.dir / "data"), "-w", "-l", str(self.dir / "log"),
                                 "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1", "start"]),
                       check=True, capture_output=True, timeout=60)
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        subprocess.run(self.run([pg_bin("pg_ctl"), "-D", str(self.dir / "data"), "-m", "fast", "stop"]),
                       capture_output=True, timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


class Cluster:
    """Two replicas, one agent with 2 virtual GPUs, all on loopback."""

    def __init__(self, db_url: str, work: Path) -> None:
        self.work, self.procs = work, []
        self.ports = [free_port(), free_port()]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.both = ",".join(self.urls)
        self.admin = secrets.token_urlsafe(24)
        secret = work / "server.secret"
        secret.write_text(secrets.token_hex(32))
        secret.chmod(0o600)
        self.env = {**os.environ, "TIDAL_ADMIN_TOKEN": self.admin, "TIDAL_SECRET_FILE": str(secret),
                    "TIDAL_PUBLIC_URL": self.both, "OMP_NUM_THREADS": "1", "TIDAL_CHECKPOINT_SHARED": "1"}
        try:  # a start that fails leaves nothing running
            self.replicas = [self._spawn(["server", "--port", str(p), "--db", db_url, "--policy", "fifo", "--tick",
                                          "0.5"], f"server-{i}") for i, p in enumerate(self.ports)]
            for url in self.urls:
                self.wait(lambda url=url: Api(url, self.admin).healthy(), 60, f"replica {url}")
            join = subprocess.run([sys.executable, "-m", "tidal", "agent-token"], env={**self.env,
                                  "TIDAL_HOME": str(work / "server-0")}, capture_output=True, text=True).stdout.strip()
            self.agent = self._spawn(["agent", "--server", self.both, "--name", "n0", "--virtual-gpus", "2",
                                      "--interval", "0.3"], "agent", TIDAL_TOKEN=join)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, args: list[str], name: str, **env: str) -> subprocess.Popen:
        home = self.work / name
        home.mkdir(exist_ok=True)
        with open(self.work / f"{name}.log", "ab") as log:
            p = subprocess.Popen([sys.executable, "-m", "tidal", *args], env={**self.env, "TIDAL_HOME": str(home), **env},
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    @staticmethod
    def wait(pred: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def ready(self, i: int) -> bool:
        """Replica ``i``'s ``GET /readyz`` answers 200."""
        try:
            return Api(self.urls[i], self.admin).http.call("GET", "/readyz", None, patience_s=0.5)[0] == 200
        except Exception:  # noqa: BLE001 - not ready (a 503 raises too)
            return False

    def leader(self) -> int | None:
        for i, url in enumerate(self.urls):
            if self.replicas[i].poll() is None:
                try:
                    if Api(url, self.admin).http.call("GET", "/healthz", None, patience_s=0.5)[1].get("leader"):
                        return i
                except Exception:  # noqa: BLE001 - that replica is down
                    continue
        return None

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)


def submit_burst(api_url: str, token: str, jobs: int, clients: int, kill_at: float,
                 kill: Any) -> tuple[dict[str, str], list[tuple[float, float]], int]:
    """``jobs`` submissions from ``clients`` threads; ``kill()`` once ``kill_at``
    of them were sent. Returns job id by name, (time, latency) per answer, failures."""
    acked: dict[str, str] = {}
    lat: list[tuple[float, float]] = []
    failed = [0]
    lock = threading.Lock()
    counter = iter(range(jobs))
    killed = threading.Event()

    def client() -> None:
        api = Api(api_url, token)
        api.http.patience_s = 20.0
        for n in counter:
            if n >= kill_at * jobs and not killed.is_set():
                killed.set()
                kill()
            name = f"burst{n}"
            t = time.monotonic()
            try:
                ans = api.submit({"name": name, "script": "train.py", "gpus": 1, "elastic": False,
                                  "iterations": 10})
            except (ApiError, OSError, RuntimeError):
                with lock:
                    failed[0] += 1
                continue
            with lock:
                acked[name] = ans["id"]
                lat.append((time.monotonic(), 1e3 * (time.monotonic() - t)))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return acked, lat, failed[0]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))], 1) if xs else 0.0


def gpu_twice(events: list[dict[str, Any]]) -> int:
    holder, bad = {}, 0
    for e in events:
        if e["kind"] == "gpu.assign":
            bad += e["gpu"] in holder
            holder[e["gpu"]] = e["job"]
        elif e["kind"] == "gpu.release":
            holder.pop(e["gpu"], None)
    return bad


def measure(jobs: int, clients: int, work: Path) -> dict[str, Any]:
    pg = Postgres()
    c = None
    try:
        c = Cluster(pg.url, work)
        c.wait(lambda: c.leader() is not None, 60, "a leader")
        api = Api(c.both, c.admin)
        c.wait(lambda: any(n["state"] == "up" for n in api.cluster()["nodes"]), 60, "the agent")
        user = Api(c.both, api.add_user("bench"))
        job = user.submit({"name": "train", "script": str(DEMO_JOB), "gpus": "2", "iterations": 100000,
                           "args": ["--samples", "1000000", "--epochs", "1", "--sample-time", "0.002"]})["id"]
        c.wait(lambda: user.job(job)["step"] > 5, 120, "the job to train")
        lead = c.leader()
        assert lead is not None
        t_kill = [0.0]
        step_at_kill = [0]

        def kill() -> None:
            step_at_kill[0] = user.job(job)["step"]
            t_kill[0] = time.monotonic()
            os.killpg(c.replicas[lead].pid, 9)

        acked, lat, failed = submit_burst(c.both, user.http.token, jobs, clients, 0.4, kill)
        c.wait(lambda: c.leader() == 1 - lead, 30, "the other replica to lead")
        failover_s = time.monotonic() - t_kill[0]
        ready = c.ready(1 - lead)
        listed = {j["id"] for j in user.jobs() if j["name"].startswith("burst")}
        c.wait(lambda: user.job(job)["step"] > step_at_kill[0] + 5, 60, "the job to train on")
        trained = user.job(job)["step"] - step_at_kill[0]
        events = api.events()
        after = [ms for t, ms in lat if 0 <= t - t_kill[0] <= 5]
        return {"benchmark": "failover", "replicas": 2, "store": "postgresql", "jobs": jobs, "clients": clients,
                "failover_s": round(failover_s, 2), "acknowledged": len(acked),
                "acknowledged_lost": len(set(acked.values()) - listed),
                "duplicated": len(listed) - len(set(acked.values()) & listed), "failed": failed,
                "api_p95_ms": pct([ms for _, ms in lat], 95), "api_p95_ms_failover": pct(after, 95),
                "trained_on": trained, "gpu_twice": gpu_twice(events), "new_leader_ready": ready,
                "lease_s": lease_bound()}
    finally:
        if c is not None:
            c.stop()
        pg.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--json", action="store_true", help="print the one JSON line only")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tidal-failover-") as d:
        res = measure(a.jobs, a.clients, Path(d))
    print(json.dumps(res) if a.json else json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
