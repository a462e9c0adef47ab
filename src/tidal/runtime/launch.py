"""``tidal run``: a torchrun-like launcher for one elastic job without the
control plane. It hosts the job master (HTTP API + TCPStore) in-process,
starts local worker processes, starts more on ``scale_out`` (the master's
spawner), prints progress and a summary, and exits 0 when every worker did.

The master's address is written to ``$TIDAL_HOME/jobs/<job>.json`` (default
``~/.tidal``) so ``tidal scale JOB --workers N`` can find it. Also runnable as
``python -m tidal.runtime.launch run|scale ...``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from tidal.runtime.client import MasterClient
from tidal.runtime.master import STRAGGLER_POLICIES, JobMaster
from tidal.runtime.replication import MODES
from tidal.runtime.server import MasterServer
from tidal.runtime.persistence import open_backend
from tidal.runtime.worker import ENV_MASTER, ENV_WORKER

log = logging.getLogger(__name__)


def jobs_dir() -> Path:
    return Path(os.environ.get("TIDAL_HOME", Path.home() / ".tidal")) / "jobs"


def resolve_master(job: str) -> str:
    """``job`` may be a master URL or a job name written by ``tidal run``."""
    if job.startswith("http://"):
        return job
    f = jobs_dir() / f"{job}.json"
    if not f.exists():
        raise FileNotFoundError(f"no running job {job!r} (looked for {f})")
    return json.loads(f.read_text())["url"]


class LocalSpawner:
    """Starts worker processes of ``script`` on this host (the master calls
    it on ``scale_out``). Only ``localhost`` hosts are supported."""

    def __init__(self, script: str, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.script, self.args = script, list(args)
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()
        self.master_url = ""

    def __call__(self, ids: list[str], hosts: list[str] | None = None) -> None:
        if hosts and any(h not in ("localhost", "127.0.0.1") for h in hosts):
            raise ValueError("the local launcher can only start workers on localhost")
        for wid in ids:
            env = dict(self.env, **{ENV_MASTER: self.master_url, ENV_WORKER: wid})
            p = subprocess.Popen([sys.executable, "-u", self.script, *self.args], env=env)
            with self._lock:
                self.procs[wid] = p
            log.info("started worker %s (pid %d)", wid, p.pid)

    def kill(self, worker_id: str) -> None:
        """SIGKILL a worker (the master found it hung)."""
        with self._lock:
            p = self.procs.get(worker_id)
        if p is not None and p.poll() is None:
            p.kill()

    def dead(self) -> list[str]:
        """Workers whose process exited with an error."""
        return [w for w, c in self.poll().items() if c not in (None, 0)]

    def poll(self) -> dict[str, int | None]:
        with self._lock:
            return {w: p.poll() for w, p in self.procs.items()}

    def terminate(self) -> None:
        with self._lock:
            for p in self.procs.values():
                if p.poll() is None:
                    p.terminate()
            for p in self.procs.values():
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()


def run_job(
    script: str,
    args: Sequence[str] = (),
    workers: int = 2,
    *,
    max_workers: int | None = None,
    job: str | None = None,
    state_url: str | None = None,
    switch_lead_s: float = 0.5,
    progress_every_s: float = 1.0,
    timeout_s: float | None = None,
    out: Callable[[str], None] = print,
    straggler_policy: str = "report",
    replication: str = "topology",
    hang_timeout_s: float = 30.0,
) -> int:
    """Run one elastic job to completion; returns the exit code."""
    job = job or Path(script).stem
    backend = open_backend(state_url) if state_url else None
    spawner = LocalSpawner(script, args)
    master = JobMaster(job, workers, backend=backend, spawner=spawner, switch_lead_s=switch_lead_s, max_workers=max_workers,
                       straggler_policy=straggler_policy, replication=replication, hang_timeout_s=hang_timeout_s)
    server = MasterServer(master).start()
    spawner.master_url = server.url
    jf = jobs_dir() / f"{job}.json"
    jf.parent.mkdir(parents=True, exist_ok=True)
    jf.write_text(json.dumps({"url": server.url, "pid": os.getpid(), "script": script}))
    out(f"tidal run: job {job} master {server.url} workers {workers}")
    master.spawned = workers
    spawner([f"w{i}" for i in range(workers)])
    t0 = time.time()
    rc, last_print, printed_finish = 0, 0.0, False
    reported: set[str] = set()
    try:
        while True:
            time.sleep(0.1)
            for w in master.check_health():
                out(f"tidal run: worker {w} is hung; killed it so the others re-form without it")
            codes = spawner.poll()
            for w, c in codes.items():
                if c not in (None, 0) and w not in reported and not any(h["worker_id"] == w for h in master.hung):
                    reported.add(w)
                    out(f"tidal run: worker {w} failed with exit code {c}; the survivors re-form without it")
            if codes and all(c is not None for c in codes.values()):
                break
            if timeout_s is not None and time.time() - t0 > timeout_s:
                out("tidal run: timeout; stopping the job")
                spawner.terminate()
                rc = 1
                break
            if time.time() - last_print >= progress_every_s:
                last_print = time.time()
                st = master.status()
                if st.state != "forming" and not printed_finish:
                    printed_finish = st.state == "finished"
                    out(
                        f"[{time.time() - t0:6.1f}s] step {st.step:5d} epoch {st.epoch} workers {st.world_size} "
                        f"gen {st.gen} step_time {1e3 * st.step_time_s:6.1f} ms {st.state}"
                        + (f" ({st.pending})" if st.pending else "")
                    )
    except KeyboardInterrupt:
        spawner.terminate()
        rc = 130
    finally:
        st = master.status()
        server.stop()
        jf.unlink(missing_ok=True)
    if rc == 0 and st.state not in ("finished", "suspended"):
        rc = 1  # every worker exited but the job did not finish (e.g. all of them failed)
    if st.state == "suspended" and master.suspended:
        out(f"tidal run: job {job} suspended at step {master.suspended['step']} (checkpoint "
            f"{master.suspended['path']}); run it again with the same checkpoint directory to resume")
    out(f"tidal run: summary: job {job} {st.state} after {time.time() - t0:.1f}s, {st.step} steps, "
        f"epoch {st.epoch}, final workers {st.world_size}, {len(st.changes)} rescale(s)")
    for c in st.changes:
        out(f"  gen {c['gen']}: {c['kind']} {c['from_size']}->{c['to_size']} at step {c['switch_step']}, "
            f"pause {1e3 * c['pause_s']:.1f} ms, {c['switched_at'] - c['requested_at']:.2f}s after request")
    for h in st.hung:
        out(f"  hung worker {h['worker_id']} in gen {h['gen']}: {h['reason']}; {h['action']}")
    for s in st.stragglers:
        out(f"  straggler {s['worker_id']} in gen {s['gen']} at step {s['step']} ({s['ratio']:.2f}x median): {s['action']}")
    return rc


def serve_master(
    job: str,
    workers: int,
    *,
    state_url: str,
    port: int = 0,
    store_port: int = 0,
    resume: bool = False,
    linger_s: float = 2.0,
    timeout_s: float | None = None,
    out: Callable[[str], None] = print,
) -> int:
    """Host only the job master (HTTP + TCPStore) until the job finishes; the
    workers are started elsewhere with ``$TIDAL_MASTER_URL``. With fixed
    ports and ``resume=True`` a restarted master (e.g. after ``kill -9``)
    continues from its saved state (Elan §V-D) and the workers reconnect to
    the same addresses. Returns 0 when the job finished."""
    backend = open_backend(state_url)
    master = JobMaster(job, workers, backend=backend, store_port=store_port, resume=resume)
    server = MasterServer(master, port=port).start()
    st = master.status()
    out(f"tidal master: job {job} at {server.url} store {master.store_port} "
        f"{'resumed at gen %d step %d' % (st.gen, st.step) if resume else 'started'}")
    t0 = time.time()
    try:
        while not master.finished:
            time.sleep(0.1)
            master.check_health()
            if timeout_s is not None and time.time() - t0 > timeout_s:
                out("tidal master: timeout")
                return 1
        time.sleep(linger_s)  # let the workers' last messages (close, left) through
    finally:
        server.stop()
    st = master.status()
    out(f"tidal master: job {job} {st.state} at step {st.step}, {st.world_size} workers")
    return 0


def scale_job(job: str, workers: int, timeout_s: float = 120.0, wait: bool = True, out: Callable[[str], None] = print) -> int:
    """Ask ``job``'s master for ``workers`` workers (retrying while another
    change is in progress) and optionally wait until they run."""
    try:
        c = MasterClient(resolve_master(job))
    except FileNotFoundError as e:
        out(f"tidal scale: {e}")
        return 2
    ans = c.scale_to(workers, timeout_s=timeout_s)
    out(f"tidal scale: {ans.status}: {ans.message}")
    if ans.status != "accepted":
        return 1
    if wait:
        st = c.wait_for(workers, timeout_s=timeout_s)
        out(f"tidal scale: job {st.job} at {st.world_size} workers, step {st.step} ({st.state})")
        if st.world_size != workers:
            return 1
    return 0


def migrate_job(job: str, ranks: list[int], timeout_s: float = 120.0, out: Callable[[str], None] = print) -> int:
    """Move the workers at ``ranks`` of ``job`` in one change (retrying while
    another change is in progress) and wait until the switch happened."""
    try:
        c = MasterClient(resolve_master(job))
    except FileNotFoundError as e:
        out(f"tidal migrate: {e}")
        return 2
    deadline = time.monotonic() + timeout_s
    before = c.status()
    while True:
        ans = c.migrate(ranks)
        if ans.status != "retry" or time.monotonic() > deadline:
            break
        time.sleep(max(0.05, ans.retry_after_s))
    out(f"tidal migrate: {ans.status}: {ans.message}")
    if ans.status != "accepted":
        return 1
    while time.monotonic() < deadline:
        st = c.status()
        if st.state == "finished" or (not st.changing and any(ch["kind"] == "migrate" for ch in st.changes[len(before.changes):])):
            out(f"tidal migrate: job {st.job} members {', '.join(st.members)} at step {st.step} ({st.state})")
            return 0
        time.sleep(0.1)
    out("tidal migrate: timeout waiting for the switch")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tidal.runtime.launch")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--workers", "-n", type=int, default=2)
    r.add_argument("--max-workers", type=int, default=None)
    r.add_argument("--job", default=None)
    r.add_argument("--state", default=None, help="master state backend URL (file://..., sqlite://...)")
    r.add_argument("--switch-lead", type=float, default=0.5, help="T_a in seconds (EDL §4.2)")
    r.add_argument("--timeout", type=float, default=None)
    r.add_argument("--straggler-policy", choices=list(STRAGGLER_POLICIES), default="report",
                   help="a worker >1.2x the median compute time for 10 steps is reported, removed, replaced "
                        "(migrated), or given a smaller batch share (EDL §5.2)")
    r.add_argument("--replication", choices=list(MODES), default="topology",
                   help="how newcomers get the state: from their nearest live worker, concurrently (Elan §IV), "
                        "from rank 0 only, or by one broadcast")
    r.add_argument("--hang-timeout", type=float, default=30.0,
                   help="kill a worker that stops beating (or computes) this long while its peers wait; 0: never")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    m = sub.add_parser("master", help="host only the job master (workers are started elsewhere)")
    m.add_argument("--job", required=True)
    m.add_argument("--workers", "-n", type=int, default=2)
    m.add_argument("--state", required=True, help="state backend URL (file://..., sqlite://...)")
    m.add_argument("--port", type=int, default=0)
    m.add_argument("--store-port", type=int, default=0)
    m.add_argument("--resume", action="store_true", help="continue from the saved state")
    m.add_argument("--timeout", type=float, default=None)
    s = sub.add_parser("scale")
    s.add_argument("job")
    s.add_argument("--workers", "-n", type=int, required=True)
    s.add_argument("--timeout", type=float, default=120.0)
    s.add_argument("--no-wait", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.cmd == "run":
        return run_job(a.script, a.args, a.workers, max_workers=a.max_workers, job=a.job, state_url=a.state,
                       switch_lead_s=a.switch_lead, timeout_s=a.timeout, straggler_policy=a.straggler_policy,
                       replication=a.replication, hang_timeout_s=a.hang_timeout)
    if a.cmd == "master":
        return serve_master(a.job, a.workers, state_url=a.state, port=a.port, store_port=a.store_port,
                            resume=a.resume, timeout_s=a.timeout)
    return scale_job(a.job, a.workers, timeout_s=a.timeout, wait=not a.no_wait)


if __name__ == "__main__":
    sys.exit(main())
