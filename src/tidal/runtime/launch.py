"""``tidal run``: a torchrun-like launcher for one elastic job without the
control plane. It hosts the job master (HTTP API + TCPStore) in-process,
starts local worker processes, starts more on ``scale_out`` (the master's
spawner), prints progress and a summary, and exits 0 when the job ended and no worker
exited with an error of its own (else the first failed worker's code).

The master's address is written to ``$TIDAL_HOME/jobs/<job>.json`` (default
``~/.tidal``) so ``tidal scale JOB --workers N`` can find it. Also runnable as
``python -m tidal.runtime.launch run|scale ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from tidal import settings
from tidal.net import advertise_addr, bind_addr
from tidal.runtime.client import MasterClient, retry_while_busy
from tidal.runtime.host import host_master
from tidal.runtime.messages import Status
from tidal.runtime.persistence import open_backend
from tidal.runtime.replication import MODES
from tidal.runtime.spawner import LOCAL_HOSTS, LocalSpawner, WorkerLaunch

log = logging.getLogger(__name__)


def jobs_dir() -> Path:
    return settings.home() / "jobs"


def resolve_master(job: str) -> str:
    """``job`` may be a master URL or a job name written by ``tidal run``."""
    if job.startswith("http://"):
        return job
    f = jobs_dir() / f"{job}.json"
    if not f.exists():
        raise FileNotFoundError(f"no running job {job!r} (looked for {f})")
    return json.loads(f.read_text())["url"]


def master_client(job: str) -> MasterClient:
    """A client of ``job``'s master (a URL, or a job name written by ``tidal
    run``, whose file holds the job's credential too)."""
    url = resolve_master(job)
    f = jobs_dir() / f"{job}.json"
    token = None if job.startswith("http://") else json.loads(f.read_text()).get("token")
    return MasterClient(url, token=token or None)


def _job_token(adv: str, out: Callable[[str], None]) -> str:
    """The credential of a ``tidal run`` job: ``$TIDAL_JOB_TOKEN`` (the same
    secret on every host of the job), else none: on loopback that is one
    user's job on their own machine; on a network address a warning says
    that the master and its store then accept any process that reaches them
    (docs/security.md)."""
    token = settings.job_token()
    if token or adv in LOCAL_HOSTS or adv.startswith("127."):
        return token
    out(f"tidal run: warning: ${settings.JOB_TOKEN.name} is not set: the job's master and rendezvous store at "
        f"{adv} accept any process that reaches them; set the same secret on every host of the job")
    return ""


def _write_job_file(path: Path, doc: dict[str, Any]) -> None:
    """The job's file (its master's URL and credential), readable by its user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(doc))
    os.replace(tmp, path)


NO_INIT = "the script never called tidal.runtime.init()"


class _Starts:
    """The first workers of ``tidal run`` until each registered with the
    master: while the job forms, one that exited without registering (0: it
    never called ``tidal.runtime.init()``; an error: its last line) or has not
    registered within ``join_timeout_s`` (a warning at half of it) fails the
    run instead of leaving the master waiting for it."""

    def __init__(self, master: Any, spawner: LocalSpawner, out: Callable[[str], None], join_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.master, self.spawner, self.out, self.clock = master, spawner, out, clock
        self.timeout_s = join_timeout_s
        self.registered: set[str] = set()
        self.warned = False

    def failure(self, codes: dict[str, int | None], state: str) -> str | None:
        """Why the run fails now; None: it goes on."""
        waiting = [w for w in codes if w not in self.registered]
        if state != "forming" or not waiting:
            return None
        self.registered |= {w for w, r in self.master.snapshot()["workers"].items() if "registered_at" in r}
        waiting = [w for w in waiting if w not in self.registered]
        for w in waiting:
            if codes[w] is not None and codes[w] > 0:  # killed by a signal (< 0): dropped, the job goes on
                why = self.spawner.last_error(w) or "no error message"
                return f"worker {w} failed before it registered with the job master (exit code {codes[w]}): {why}"
        quit_ = [w for w in waiting if codes[w] == 0]
        if quit_:
            return (f"worker(s) {', '.join(quit_)} exited without registering with the job master: {NO_INIT} "
                    "(or never started training: job.epochs(), its loader)")
        now, name = self.clock(), settings.JOIN_TIMEOUT_S.name
        late = [w for w in waiting if codes[w] is None and now - self.spawner.started.get(w, now) >= self.timeout_s]
        if late:
            return (f"worker(s) {', '.join(late)} did not register with the job master within {self.timeout_s:g} s "
                    f"(${name}); the script must call tidal.runtime.init() and start training")
        slow = [w for w in waiting if codes[w] is None and now - self.spawner.started.get(w, now) >= self.timeout_s / 2]
        if slow and not self.warned:
            self.warned = True
            self.out(f"tidal run: warning: worker(s) {', '.join(slow)} have not registered with the job master "
                     f"{self.timeout_s / 2:g} s after they started; the run fails at {self.timeout_s:g} s (${name})")
        return None


class _RunWatch:
    """What ``tidal run`` prints while it hosts the master: progress lines,
    failed, hung and dropped workers; and when it stops (every worker
    process exited, and no other host's worker is still a member, or
    :class:`_Starts` found a reason to fail: then :attr:`failure` says it)."""

    def __init__(self, master: Any, spawner: LocalSpawner, out: Callable[[str], None], t0: float,
                 join_timeout_s: float) -> None:
        self.master, self.spawner, self.out, self.t0 = master, spawner, out, t0
        self.starts = _Starts(master, spawner, out, join_timeout_s)
        self.failure: str | None = None
        self.reported: set[str] = set()
        self.seen_failed: set[str] = set()  # failed, reported once the master had a periodic step to classify it
        self.errors: list[tuple[str, int]] = []  # workers that exited with an error of their own, first first
        self.dropped = 0  # dropped-worker records printed
        self.finished_printed = False
        self.warm_said = 0  # warm spares last announced

    def on_hung(self, worker_id: str) -> None:
        self.out(f"tidal run: worker {worker_id} is hung; killed it so the others re-form without it")

    def on_status(self, st: Status) -> None:
        if st.state == "forming" or self.finished_printed:
            return
        self.finished_printed = st.state == "finished"
        self.out(f"[{time.time() - self.t0:6.1f}s] step {st.step:5d} epoch {st.epoch} workers {st.world_size} "
                 f"gen {st.gen} step_time {1e3 * st.step_time_s:6.1f} ms {st.state}"
                 + (f" ({st.pending})" if st.pending else ""))

    def stop(self) -> bool:
        codes = self.spawner.exit_codes()
        st = self.master.status()
        self.failure = self.starts.failure(codes, st.state)
        if self.failure is not None:
            return True
        for d in st.dropped[self.dropped:]:  # lost before their first step: no survivor reports them
            w, c = d["worker_id"], codes.get(d["worker_id"])
            self.reported.add(w)
            self.out(f"tidal run: worker {w} was lost before its first step and dropped: {d['reason']}"
                     + (f", exit code {c}" if c is not None else "") + "; the job goes on without it")
        self.dropped = len(st.dropped)
        if st.state == "running" and not st.pending:  # a steady job: the next scale-out's newcomers wait warm
            warm = self.spawner.fill_spares()
            if warm == self.spawner.spares.size and warm != self.warm_said:
                self.out(f"tidal run: {warm} warm spare worker(s) ready: a scale-out starts without start-up")
            self.warm_said = warm
        # every local worker exited, and no worker of another host (tidal run --join) still trains
        remote = [w for w in st.members if w not in codes] if st.state not in ("finished", "suspended") else []
        done = bool(codes) and all(c is not None for c in codes.values()) and not remote
        hung = {h["worker_id"] for h in st.hung}
        for w, c in codes.items():
            if c is not None and c > 0 and w not in {e[0] for e in self.errors}:
                self.errors.append((w, c))
            if c in (None, 0) or w in self.reported or w in hung:
                continue
            if w in self.seen_failed or done:
                self.reported.add(w)
                self.out(f"tidal run: worker {w} failed with exit code {c}; the survivors re-form without it")
            self.seen_failed.add(w)
        return done


def _summary(job: str, st: Status, master: Any, elapsed: float, out: Callable[[str], None]) -> None:
    if st.state == "suspended" and master.suspended:
        out(f"tidal run: job {job} suspended at step {master.suspended['step']} (checkpoint "
            f"{master.suspended['path']}); run it again with the same checkpoint directory to resume")
    out(f"tidal run: summary: job {job} {st.state} after {elapsed:.1f}s, {st.step} steps, "
        f"epoch {st.epoch}, final workers {st.world_size}, {len(st.changes)} rescale(s)")
    for c in st.changes:
        out(f"  gen {c['gen']}: {c['kind']} {c['from_size']}->{c['to_size']} at step {c['switch_step']}, "
            f"pause {1e3 * c['pause_s']:.1f} ms, {c['switched_at'] - c['requested_at']:.2f}s after request")
    for h in st.hung:
        out(f"  hung worker {h['worker_id']} in gen {h['gen']}: {h['reason']}; {h['action']}")
    for d in st.dropped:
        out(f"  dropped worker {d['worker_id']}: {d['reason']}")
    for s in st.stragglers:
        out(f"  straggler {s['worker_id']} in gen {s['gen']} at step {s['step']} ({s['ratio']:.2f}x median): {s['action']}")


def _bad_run(script: str, size: int, max_size: int | None) -> str | None:
    """Why ``tidal run`` cannot start, before any process is: None if it can."""
    if size < 1:
        return f"--workers must be at least 1, not {size}"
    if max_size is not None and size > max_size:
        return f"--workers {size} is more than --max-workers {max_size}"
    if not Path(script).is_file():
        return f"no such script: {script} (relative to {os.getcwd()})"
    return None


def _worker_env(max_steps: int | None, token: str = "") -> dict[str, str]:
    """The workers' environment: this process's, with the job's credential
    and step limit if given."""
    env = dict(os.environ)
    if token:
        env[settings.JOB_TOKEN.name] = token
    if max_steps:
        env[settings.MAX_STEPS.name] = str(int(max_steps))
    return env


def run_job(
    script: str,
    args: Sequence[str] = (),
    size: int = 2,
    *,
    max_size: int | None = None,
    job: str | None = None,
    state_url: str | None = None,
    switch_lead_s: float = 0.0,
    progress_every_s: float = 1.0,
    timeout_s: float | None = None,
    out: Callable[[str], None] = print,
    straggler_policy: str = "report",
    replication: str = "topology",
    hang_timeout_s: float = 30.0,
    bind: str | None = None,
    advertise: str | None = None,
    port: int = 0,
    max_steps: int | None = None,
) -> int:
    """Run one elastic job of ``size`` workers to completion; returns the
    exit code. ``bind``/``advertise``/``port``: where the master listens and
    the address it gives workers (:mod:`tidal.net`; other hosts join with
    ``tidal run --join ADVERTISE:PORT``). ``max_steps``: the job ends at this
    global step whatever the script's loop says (``$TIDAL_MAX_STEPS``)."""
    from tidal.runtime.master import JobMaster
    from tidal.runtime.server import MasterServer

    if why := _bad_run(script, size, max_size):
        out(f"tidal run: {why}")
        return 2
    job = job or Path(script).stem
    try:
        backend = open_backend(state_url) if state_url else None
    except (ValueError, OSError) as e:
        out(f"tidal run: --state {state_url}: {e}")
        return 2
    bind, join_s = bind_addr(bind), settings.JOIN_TIMEOUT_S.get()
    adv = advertise_addr(bind, explicit=advertise or settings.ADVERTISE_ADDR.get())
    token = _job_token(adv, out)
    spares = max(0, min(settings.WARM_SPARES.get(), (max_size - size) if max_size else 1 << 16))
    spawner = LocalSpawner(script, args, env=_worker_env(max_steps, token), spares=spares)
    master = JobMaster(job, size, backend=backend, spawner=spawner, switch_lead_s=switch_lead_s, max_size=max_size,
                       straggler_policy=straggler_policy, replication=replication, hang_timeout_s=hang_timeout_s,
                       first_worker=size, store_host=adv, join_timeout_s=join_s, token=token)
    server = MasterServer(master, host=bind, port=port, advertise=adv, token=token).start()
    spawner.master_url = server.url
    jf = jobs_dir() / f"{job}.json"
    _write_job_file(jf, {"url": server.url, "pid": os.getpid(), "script": script, "token": token})
    out(f"tidal run: job {job} master {server.url} workers {size}")
    spawner.spawn([WorkerLaunch(f"w{i}") for i in range(size)])
    t0 = time.time()
    watch = _RunWatch(master, spawner, out, t0, join_s)
    rc = 0
    try:
        with _terminated_as_interrupt():
            if not host_master(master, stop=watch.stop, on_status=watch.on_status, on_hung=watch.on_hung,
                               status_every_s=progress_every_s, timeout_s=timeout_s) or watch.failure:
                out(f"tidal run: {watch.failure or 'timeout'}; stopping the job")
                spawner.terminate()
                rc = 1
    except KeyboardInterrupt as e:
        rc = 143 if isinstance(e, _Terminated) else 130
        out(f"tidal run: {'SIGTERM' if rc == 143 else 'interrupted (Ctrl-C)'}; stopping the workers")
        spawner.terminate()
    finally:
        spawner.spares.close()
        st = master.status()
        server.stop()
        jf.unlink(missing_ok=True)
    if rc == 0 and st.state not in ("finished", "suspended"):
        rc = 1  # every worker exited but the job did not finish (e.g. all of them failed)
        codes = ", ".join(f"{w}: {c}" for w, c in sorted(spawner.exit_codes().items()))
        out(f"tidal run: job {job} did not finish ({st.state}): every worker exited (exit codes {codes})")
    _summary(job, st, master, time.time() - t0, out)
    return _run_code(rc, watch, spawner, out)


class _Terminated(KeyboardInterrupt):
    """SIGTERM reached the launcher (a batch system stopping it)."""


@contextlib.contextmanager
def _terminated_as_interrupt() -> Iterator[None]:
    """SIGTERM stops the job as Ctrl-C does (the workers, in sessions of their
    own, get neither signal from a terminal: the launcher stops them). Only
    in the main thread, where Python handles signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:  # noqa: ARG001
        raise _Terminated

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _run_code(rc: int, watch: _RunWatch, spawner: LocalSpawner, out: Callable[[str], None]) -> int:
    """``tidal run``'s exit code: 0 only when the job ended and no worker
    exited with an error of its own (a worker removed by a scale-in exits 0;
    one killed by a signal, e.g. a lost host or the hung-worker check, is a
    fault the job recovered from, shown in the log). Otherwise the first
    failed worker's code, after one line with its last error line."""
    seen = {w for w, _ in watch.errors}
    watch.errors += [(w, c) for w, c in sorted(spawner.exit_codes().items()) if c is not None and c > 0 and w not in seen]
    if rc not in (0, 1) or not watch.errors:
        return rc
    w, code = watch.errors[0]
    line = spawner.last_error(w)
    out(f"tidal run: exit code {code}: worker {w} failed with exit code {code}" + (f": {line}" if line else ""))
    return code


def serve_master(
    job: str,
    size: int,
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
    from tidal.runtime.master import JobMaster
    from tidal.runtime.server import MasterServer

    master = JobMaster(job, size, backend=open_backend(state_url), store_port=store_port, resume=resume)
    server = MasterServer(master, port=port).start()
    st = master.status()
    out(f"tidal master: job {job} at {server.url} store {master.store_port} "
        f"{'resumed at gen %d step %d' % (st.gen, st.step) if resume else 'started'}")
    try:
        if not host_master(master, stop=lambda: master.status().state == "finished", timeout_s=timeout_s):
            out("tidal master: timeout")
            return 1
        time.sleep(linger_s)  # let the workers' last messages (close, left) through
    finally:
        server.stop()
    st = master.status()
    out(f"tidal master: job {job} {st.state} at step {st.step}, {st.world_size} workers")
    return 0


def scale_job(job: str, size: int, timeout_s: float = 120.0, wait: bool = True, out: Callable[[str], None] = print) -> int:
    """Ask ``job``'s master for ``size`` workers (retrying while another
    change is in progress) and optionally wait until they run."""
    try:
        c = master_client(job)
    except FileNotFoundError as e:
        out(f"tidal scale: {e}")
        return 2
    ans = c.scale_to(size, timeout_s=timeout_s)
    out(f"tidal scale: {ans.status}: {ans.message}")
    if ans.status != "accepted":
        return 1
    if wait:
        st = c.wait_for(size, timeout_s=timeout_s)
        out(f"tidal scale: job {st.job} at {st.world_size} workers, step {st.step} ({st.state})")
        if st.world_size != size:
            return 1
    return 0


def remove_host_workers(job: str, host: str, timeout_s: float = 120.0, wait: bool = True,
                        out: Callable[[str], None] = print) -> int:
    """Scale ``job`` in by every worker registered on ``host`` (one change)."""
    try:
        c = master_client(job)
    except FileNotFoundError as e:
        out(f"tidal scale: {e}")
        return 2
    st = c.status()
    leavers = [w for w in st.members if st.hosts.get(w) == host]
    if not leavers:
        known = ", ".join(sorted(set(st.hosts.values()))) or "none"
        out(f"tidal scale: job {st.job} has no worker on host {host!r} (its hosts: {known})")
        return 1
    ans = retry_while_busy(lambda: c.scale_in(workers=leavers), timeout_s)
    out(f"tidal scale: {ans.status}: {ans.message}")
    if ans.status != "accepted":
        return 1
    if wait:
        st = c.wait_for(len(st.members) - len(leavers), timeout_s=timeout_s)
        out(f"tidal scale: job {st.job} at {st.world_size} workers, step {st.step} ({st.state})")
    return 0


def migrate_job(job: str, ranks: list[int], timeout_s: float = 120.0, out: Callable[[str], None] = print) -> int:
    """Move the workers at ``ranks`` of ``job`` in one change (retrying while
    another change is in progress) and wait until the switch happened."""
    try:
        c = master_client(job)
    except FileNotFoundError as e:
        out(f"tidal migrate: {e}")
        return 2
    deadline = time.monotonic() + timeout_s
    before = c.status()
    ans = retry_while_busy(lambda: c.migrate(ranks), timeout_s)
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


def _parser() -> argparse.ArgumentParser:
    from tidal.runtime.stragglers import STRAGGLER_POLICIES

    ap = argparse.ArgumentParser(prog="python -m tidal.runtime.launch")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--workers", "-n", type=int, default=2, help="initial size (number of workers)")
    r.add_argument("--max-workers", type=int, default=None, help="largest size")
    r.add_argument("--job", default=None)
    r.add_argument("--state", default=None, help="master state backend URL (file://..., sqlite://...)")
    r.add_argument("--switch-lead", type=float, default=0.0,
                   help="T_a in seconds (EDL §4.2); 0: switch right after the step every rank agreed at")
    r.add_argument("--timeout", type=float, default=None)
    r.add_argument("--straggler-policy", choices=list(STRAGGLER_POLICIES), default="report",
                   help="a worker >1.2x the median compute time for 10 steps is reported, removed, replaced "
                        "(migrated), or given a smaller batch share (EDL §5.2)")
    r.add_argument("--replication", choices=list(MODES), default="topology",
                   help="how newcomers get the state: from their nearest live worker, concurrently (Elan §IV), "
                        "from rank 0 only, or by one broadcast")
    r.add_argument("--hang-timeout", type=float, default=30.0,
                   help="kill a worker that stops beating (or computes) this long while its peers wait; 0: never")
    r.add_argument("--bind", default=None, help="address the master listens on (0.0.0.0: every interface; "
                                               "default $TIDAL_BIND_ADDR, else 127.0.0.1)")
    r.add_argument("--advertise-addr", default=None, help="address given to workers and joining hosts")
    r.add_argument("--port", type=int, default=0, help="the master's HTTP port (0: any free one)")
    r.add_argument("--join", default=None, metavar="HOST:PORT",
                   help="add --workers workers on this host to the running job whose master is at HOST:PORT")
    r.add_argument("--replace-host", default=None, metavar="HOST",
                   help="with --join: the new workers replace HOST's workers in one switch (a migration)")
    r.add_argument("--max-steps", type=int, default=None,
                   help="end the job at this global step whatever the script's loop says ($TIDAL_MAX_STEPS)")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    m = sub.add_parser("master", help="host only the job master (workers are started elsewhere)")
    m.add_argument("--job", required=True)
    m.add_argument("--workers", "-n", type=int, default=2, help="initial size (number of workers)")
    m.add_argument("--state", required=True, help="state backend URL (file://..., sqlite://...)")
    m.add_argument("--port", type=int, default=0)
    m.add_argument("--store-port", type=int, default=0)
    m.add_argument("--resume", action="store_true", help="continue from the saved state")
    m.add_argument("--timeout", type=float, default=None)
    s = sub.add_parser("scale")
    s.add_argument("job")
    s.add_argument("--workers", "-n", type=int, default=None, help="the new size")
    s.add_argument("--remove-host", default=None, help="remove every worker on this host")
    s.add_argument("--timeout", type=float, default=120.0)
    s.add_argument("--no-wait", action="store_true")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.cmd == "run" and a.max_steps:
        os.environ[settings.MAX_STEPS.name] = str(a.max_steps)  # every worker started here (--join too)
    if a.cmd == "run" and a.join:
        from tidal.runtime.join import join_job

        return join_job(a.join, a.script, a.args, a.workers, timeout_s=a.timeout or 120.0,
                        replace_host=a.replace_host)
    if a.cmd == "run":
        return run_job(a.script, a.args, a.workers, max_size=a.max_workers, job=a.job, state_url=a.state,
                       switch_lead_s=a.switch_lead, timeout_s=a.timeout, straggler_policy=a.straggler_policy,
                       replication=a.replication, hang_timeout_s=a.hang_timeout, bind=a.bind,
                       advertise=a.advertise_addr, port=a.port)
    if a.cmd == "master":
        return serve_master(a.job, a.workers, state_url=a.state, port=a.port, store_port=a.store_port,
                            resume=a.resume, timeout_s=a.timeout)
    if a.remove_host is not None:
        return remove_host_workers(a.job, a.remove_host, timeout_s=a.timeout, wait=not a.no_wait)
    if a.workers is None:
        print("tidal scale: give --workers N or --remove-host H", file=sys.stderr)
        return 2
    return scale_job(a.job, a.workers, timeout_s=a.timeout, wait=not a.no_wait)


if __name__ == "__main__":
    sys.exit(main())
