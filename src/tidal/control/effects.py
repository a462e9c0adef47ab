"""What each transition of the phase machine (:mod:`tidal.control.phases`)
does to the store: GPUs taken with the conditional UPDATE, process rows
written through the spawner, processes stopped, audit events. Every function
runs inside the caller's transaction and never waits for anything remote.

A job's change in flight (``Job.change``) holds ``since`` (when it began; its
time-out is judged from it), ``gids`` (the GPUs it takes or gives back),
``workers`` (the new worker ids), ``early`` (the GPUs are only reserved),
``spawned`` (the rows are written), ``leavers`` (process ids of leaving
workers), ``size_from`` and ``target``.
"""

from __future__ import annotations

import re
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from tidal import settings
from tidal.control.credentials import Credentials
from tidal.control.db import GPU, Event, Job, Node, Process, Store
from tidal.control.observe import incarnation, job_procs
from tidal.control.phases import CANCELLING, STATE_OF, TERMINAL, Bounds, JobObs, ended_reason, restart_reason
from tidal.control.spawner import AgentSpawner, launches_on, worker_resources

LIVE = ("pending", "running")
MAX_OOMS = 3  # out-of-memory kills, at growing limits, before the job fails
OOM_GROWTH = 1.5  # a worker killed for memory comes back with this much more
MAX_BACKOFF_S = 300.0  # the longest wait before a worker that exited with an error is replaced


@dataclass
class Context:
    """What the effects need besides the store rows."""

    store: Store
    server_url: str = ""
    credentials: Credentials = field(default_factory=Credentials)
    home: Path = field(default_factory=settings.home)
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=1024))  # submit -> start, seconds
    bounds: Bounds = field(default_factory=Bounds)  # the liveness contract's bounds
    crash_limit: int = 3  # the same error this many times ends the job
    backoff_s: float = 5.0  # the first back-off after a worker's error (doubled at each repeat)


# -- helpers -----------------------------------------------------------------------
def set_phase(j: Job, phase: str) -> None:
    """Record the phase and the state users and policies see; a cancellation
    the API asked for stays visible until the next tick acts on it."""
    j.phase = phase
    if j.state != "cancelling" or phase in (CANCELLING, *TERMINAL):
        j.state = STATE_OF[phase]


def live_procs(s: Session, job_id: str, kind: str | None = None) -> list[Process]:
    q = select(Process).where(Process.job_id == job_id, Process.state.in_(LIVE))
    if kind is not None:
        q = q.where(Process.kind == kind)
    return list(s.scalars(q))


def stop(procs: Sequence[Process]) -> None:
    for p in procs:
        p.desired = "stop"


def stop_all(s: Session, j: Job, now: float) -> None:
    """Every live process of the job is to stop and its reservations go; the
    ending or restart that follows is timed from ``now``."""
    stop(live_procs(s, j.id))
    unreserve_all(s, j.id)
    j.change = {"since": now}


def next_worker_ids(s: Session, job_id: str, count: int) -> list[str]:
    """Worker ids never repeat within a job, also after a suspension (w0.. then wN..)."""
    names = s.scalars(select(Process.name).where(Process.job_id == job_id, Process.kind == "worker")).all()
    first = max((int(n[1:]) + 1 for n in names if n[1:].isdigit()), default=0)
    return [f"w{first + i}" for i in range(count)]


def unreserve_all(s: Session, job_id: str) -> None:
    s.execute(update(GPU).where(GPU.reserved_for == job_id).values(reserved_for=None))


def release_all(cx: Context, s: Session, j: Job) -> None:
    cx.store.release_gpus(s, j.id, cx.store.job_gpus(s, j.id))
    unreserve_all(s, j.id)


def release_idle(cx: Context, s: Session, j: Job, unreserve: bool = True) -> None:
    """Give back the job's GPUs that none of its processes may still use: a
    pending or running process holds its GPU, and so does a lost one until
    its node reports it gone (a GPU is never handed out while an old process
    may run on it)."""
    busy = set(s.scalars(select(Process.gpu).where(Process.job_id == j.id, Process.gpu.is_not(None),
                                                   Process.state.in_(("pending", "running", "lost")))))
    cx.store.release_gpus(s, j.id, [g for g in cx.store.job_gpus(s, j.id) if g not in busy])
    if unreserve:
        unreserve_all(s, j.id)


def spawn(cx: Context, s: Session, j: Job, workers: Sequence[str], gids: Sequence[int]) -> None:
    AgentSpawner(s, j, home=cx.home).spawn(launches_on(s, workers, gids))


def launch_master(cx: Context, s: Session, j: Job, gids: list[int], workers: list[str]) -> None:
    """The job's master process on the node of its first GPU; it expects the
    workers ``workers`` (consecutive ids), which the coordinator starts."""
    first = s.get(GPU, gids[0])
    sub = j.spec.get("submission", {})
    argv = [sys.executable, "-m", "tidal.control.jobproc", "--job", j.id, "--server", cx.server_url,
            "--size", str(len(workers)), "--first-worker", workers[0][1:]]
    s.add(Process(job_id=j.id, name="master", kind="master", node=first.node, gpu=None, argv=argv,
                  env=dict(sub.get("env", {})),
                  cwd=sub.get("workdir", "")))
    j.master_url = ""  # the new master reports its own


def relocate_master(s: Session, j: Job, node: str) -> None:
    """The job's master died with its host: a new master process on
    ``node`` (one of the job's hosts) continues from the store's copy of the
    state (``--resume``), told which workers were lost with the host."""
    old, _, current = incarnation(job_procs(s, j.id))
    assert old is not None
    # lost with the host, ended, or on a host that went silent with the old master (it is lost too, most likely)
    up = set(s.scalars(select(Node.name).where(Node.state == "up")))
    lost = [p.name for p in current if p.kind == "worker"
            and (p.state in ("lost", "failed") or p.state in LIVE and p.node not in up)]
    argv = list(old.argv)
    if "--lost" in argv:
        i = argv.index("--lost")
        del argv[i:i + 2]
    argv += [*(["--resume"] if "--resume" not in argv else []), "--lost", ",".join(sorted(set(lost)))]
    s.add(Process(job_id=j.id, name="master", kind="master", node=node, gpu=None, argv=argv, env=dict(old.env or {}),
                  cwd=old.cwd, relocated=True))
    j.master_url = ""  # the new master reports its own


def _started(cx: Context, s: Session, j: Job, gids: list[int], now: float, early_init: bool) -> None:
    cx.store.assign_gpus(s, j.id, gids)  # opens the gate of warmed-up workers
    j.target = len(gids)
    if j.start_time is None:
        j.start_time = now
        cx.latencies.append(now - j.submit_time)
    kind = "job.resume" if (j.tags or {}).get("_suspended") else "job.start"
    cx.store.log(s, kind, j.id, gpus=gids, early_init=early_init)


def release_dead_workers(cx: Context, s: Session, j: Job, procs: list[Process], now: float) -> bool:
    """A worker of a running job died: the runtime's survivors re-form without
    it (a forced scale-in); its GPU goes back to the pool, so the policy can
    give it to this job again or to another one, unless a live process of the
    job already uses it. ``procs``: this incarnation's processes. True
    when it changed something (a GPU freed, a crash counted)."""
    busy = {p.gpu for p in procs if p.state in ("pending", "running", "lost")}
    # a lost worker's GPU waits until its node reports the process gone (then it is "failed");
    # a worker that exited 0 on its own (not a shrink's leaver) gives its GPU back too
    leavers = set((j.change or {}).get("leavers", ()))  # a shrink's leavers: released when it completes
    dead = [p for p in procs if p.kind == "worker" and p.state in ("failed", "exited") and p.gpu is not None
            and p.id not in leavers]
    if not dead:
        return False
    held = set(cx.store.job_gpus(s, j.id))
    dead = [p for p in dead if p.gpu in held and p.gpu not in busy]
    if not dead:
        return False
    done = {(e.detail or {}).get("worker") for e in s.scalars(
        select(Event).where(Event.job_id == j.id, Event.kind == "job.worker_lost"))}
    for p in dead:
        if p.name in done:
            continue  # handled once
        oom = (p.resources or {}).get("oom")
        if oom:
            raise_memory(cx, s, j, p.name, oom)
        elif p.state == "failed" and (p.exit_code or 0) > 0:
            count_crash(cx, s, j, p, now)
        cx.store.release_gpus(s, j.id, [p.gpu])
        cx.store.log(s, "job.worker_lost", j.id, gpu=p.gpu, worker=p.name, state=p.state, exit_code=p.exit_code,
                     **({"reason": "out of memory"} if oom else {}))
    return True


def _same_error(line: str) -> str:
    """An error line with its numbers blanked, so that the same error at
    another step or address counts as the same (CrashLoopBackOff's "same
    container exits again")."""
    return re.sub(r"0x[0-9a-fA-F]+|\d+", "#", line.split(": ", 1)[-1])


def count_crash(cx: Context, s: Session, j: Job, p: Process, now: float) -> None:
    """Worker ``p`` exited with an error (a Python exception): the policy
    may replace it after a back-off that doubles with each repeat of the same
    error (``tags["_backoff_until"]``); the same error :attr:`Context.crash_limit`
    times in a row ends the job with it (``tags["_give_up"]``)."""
    tags = dict(j.tags or {})
    line = last_error(cx.home / "logs" / j.id, [p.name])
    key = _same_error(line)
    prev = tags.get("_crash") or {}
    count = int(prev.get("count", 0)) + 1 if prev.get("key") == key else 1
    tags["_crash"] = {"key": key, "count": count, "line": line}
    wait = min(MAX_BACKOFF_S, cx.backoff_s * 2 ** (count - 1))
    tags["_backoff_until"] = now + wait
    if count >= cx.crash_limit:
        tags["_give_up"] = f"a worker exited with the same error {count} times ({settings.CRASH_LIMIT.name}); the last: {line}"
    cx.store.log(s, "job.worker_crashed", j.id, worker=p.name, exit_code=p.exit_code, count=count, error=line,
                 backoff_s=wait)
    j.tags = tags


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def raise_memory(cx: Context, s: Session, j: Job, worker: str, oom: dict[str, Any]) -> None:
    """Worker ``worker`` ran out of its memory limit (``oom``: its agent's
    report). The job's workers from now on get :data:`OOM_GROWTH` times that
    limit (the worker comes back when the policy grows the job onto the freed
    GPU, like after any worker loss); after :data:`MAX_OOMS` such kills, or
    when the raised limit exceeds the largest node, the job is to fail
    (``tags["_oom_failed"]``, the reason). Kills at a limit already raised
    (several workers at once) count once."""
    tags = dict(j.tags or {})
    limit, peak = int(oom.get("limit") or 0), int(oom.get("peak") or 0)
    if not limit or limit < int(worker_resources(j).get("memory") or 0) or tags.get("_oom_failed"):
        return
    ooms, new = int(tags.get("_ooms", 0)) + 1, int(limit * OOM_GROWTH)
    largest = int(s.scalar(select(func.max(Node.memory)).where(Node.state == "up")) or 0)
    why = ""
    if ooms >= MAX_OOMS:
        why = (f"out of memory {ooms} times at growing limits; the last: worker {worker} at {_mib(limit)} "
               f"(peak {_mib(peak)})")
    elif largest and new > largest:
        why = (f"worker {worker} ran out of {_mib(limit)} (peak {_mib(peak)}); {_mib(new)} would exceed the "
               f"largest node's {_mib(largest)}")
    tags["_ooms"] = ooms
    if why:
        tags["_oom_failed"] = why
        cx.store.log(s, "job.oom_failed", j.id, worker=worker, limit=limit, peak=peak, ooms=ooms, reason=why)
    else:
        tags["_memory"] = new
        cx.store.log(s, "job.memory_raised", j.id, worker=worker, memory_from=limit, memory_to=new, ooms=ooms,
                     reason=f"worker {worker} ran out of {_mib(limit)} (peak {_mib(peak)}): x{OOM_GROWTH} "
                            f"= {_mib(new)} per worker")
    j.tags = tags


# -- effects of observed events -------------------------------------------------------
Effect = Callable[[Context, Session, Job, JobObs, float], None]


def _cancel(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    stop(live_procs(s, j.id))
    unreserve_all(s, j.id)
    j.change = {}


def _gone(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    release_all(cx, s, j)
    j.end_time = now
    cx.store.log(s, "job.cancelled", j.id)


def _master_lost(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    old = s.scalar(select(Process.node).where(Process.job_id == j.id, Process.kind == "master")
                   .order_by(Process.id.desc()).limit(1))
    relocate_master(s, j, obs.relocate_to)
    cx.store.log(s, "job.master_relocated", j.id, node=obs.relocate_to, lost_node=old)


def _give_up(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    """The liveness contract ends the job (docs/control.md, "Liveness"):
    every process stops and the job fails with the reason."""
    why = ended_reason(obs, now, cx.bounds) or "the job made no progress"
    j.exit_info = why
    stop_all(s, j, now)
    cx.store.log(s, "job.gave_up", j.id, reason=why)


def _restart(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    """No live worker is left, the master's hosts are gone, or the job
    stalled: every process stops and the job starts again from its
    checkpoint (a new incarnation, as after a suspension)."""
    why = restart_reason(obs, now, cx.bounds)
    stop_all(s, j, now)
    n = int((j.tags or {}).get("_restarts", 0)) + 1
    j.tags = {**(j.tags or {}), "_restarts": n, "_reason": f"restarting ({n} of {cx.bounds.restarts}): {why}"}
    cx.store.log(s, "job.restart", j.id, reason=why, restarts=n)


def _restarted(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    """Every process of a restarting job is gone: it waits (pending) to
    start again; its workers load the newest checkpoint."""
    release_idle(cx, s, j)
    j.master_url, j.waiting_since, j.change = "", now, {}
    j.progress = {**(j.progress or {}), "state": "restarting"}
    tags = {k: v for k, v in (j.tags or {}).items() if k not in ("_resume_step", "_backoff_until", "_started_at")}
    tags["_suspended"] = int(tags.get("_suspended", 0)) + 1  # its next start is a resume, with new worker ids
    j.tags = tags
    cx.store.log(s, "job.restarted", j.id, step=(j.progress or {}).get("step"))


def _workers_done(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    """Every worker exited 0 after training without the runtime's finish (the
    script's own loop ended first): the job completes where it ended."""
    stop(live_procs(s, j.id))
    j.tags = {**(j.tags or {}), "_script_ended": True}
    j.change = {"since": now}
    cx.store.log(s, "job.script_ended", j.id, step=(j.progress or {}).get("step"))


def _newcomers_gone(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    j.change = {}
    cx.store.log(s, "job.change_failed", j.id, change="scale_out", reason="every newcomer ended before joining")


def _ending_overdue(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    stop(live_procs(s, j.id))  # its master too: it ends the job at the next tick either way


def _gone_late(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    """Cancelled past the bound with processes not yet reported gone (their
    agent is away): the job ends; the GPUs those processes may still use stay
    held until their agent reports them gone (the sweep frees them)."""
    release_idle(cx, s, j)
    j.end_time = now
    cx.store.log(s, "job.cancelled", j.id, processes_left=obs.live)


def _workers_failed(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    """Every worker exited with an error: the job fails with the first
    worker's last log line as the reason, and its master stops."""
    failed = list(s.scalars(select(Process).where(Process.job_id == j.id, Process.kind == "worker",
                                                  Process.state == "failed").order_by(Process.id.desc())))
    why = last_error(cx.home / "logs" / j.id, [p.name for p in failed])
    j.exit_info = f"every worker failed; {why}"
    stop_all(s, j, now)
    cx.store.log(s, "job.workers_failed", j.id, workers=[p.name for p in failed], reason=why)


def _out_of_memory(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    """Workers kept running out of memory (see :func:`raise_memory`): the
    job fails with that reason; its processes stop."""
    j.exit_info = obs.oom_failed
    stop_all(s, j, now)


def last_line(logs: Path, names: Sequence[str]) -> str | None:
    """``name: last line`` of the first of these processes' logs that has
    one; None if none has."""
    for name in names:
        try:
            lines = [ln.strip() for ln in (logs / f"{name}.log").read_text(errors="replace").splitlines()]
        except OSError:
            continue
        lines = [ln for ln in lines if ln]
        if lines:
            return f"{name}: {lines[-1][:400]}"
    return None


def last_error(logs: Path, names: Sequence[str]) -> str:
    """:func:`last_line` of these workers' logs, or where to look."""
    return last_line(logs, names) or "see the workers' logs (tidal logs JOB --worker w0)"


def _master_exit(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    """The master ended: a failed job's workers stop; a finished job's
    workers outside its last generation (newcomers of a scale-out that raced
    the end) stop too, so its GPUs are free at once."""
    unreserve_all(s, j.id)
    workers = live_procs(s, j.id, "worker")
    if obs.finished_ok:
        members = set(obs.progress.get("members") or ())
        workers = [p for p in workers if members and p.name not in members]
    stop(workers)
    j.change = {"since": now}


def _ended(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    release_all(cx, s, j)
    j.end_time, j.change = now, {}
    ok = obs.finished_ok
    if not ok:
        master = s.scalar(select(Process).where(Process.job_id == j.id, Process.kind == "master")
                          .order_by(Process.id.desc()).limit(1))
        j.exit_info = j.exit_info or (f"master lost with node {master.node}"
                                      if master is not None and obs.master == "lost"
                                      else _master_exit_reason(cx, j, master, obs.master_exit_code))
    cx.store.log(s, "job.completed" if ok else "job.failed", j.id, exit_code=obs.master_exit_code)


def _master_exit_reason(cx: Context, j: Job, master: Process | None, code: int | None) -> str:
    """``master exit code N``, and the last line of its log when there is
    one (a Python error's message, e.g. a credential file it cannot read)."""
    why = f"master exit code {code}"
    if master is None or code in (0, None):
        return why
    line = last_line(cx.home / "logs" / j.id, [master.name])
    return f"{why}; {line}" if line else why


def _incarnation_started(j: Job, now: float) -> None:
    """Its workers are written: the start time-out counts from now."""
    j.tags = {**(j.tags or {}), "_started_at": now}


def _master_up_starting(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    spawn(cx, s, j, obs.change["workers"], obs.change["gids"])
    _incarnation_started(j, now)
    j.change = {}


def _master_up_prestarting(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    spawn(cx, s, j, obs.change["workers"], obs.change["gids"])  # gated: the GPUs are reserved
    j.change = {**obs.change, "spawned": True}


def _taken(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    _started(cx, s, j, list(obs.change["gids"]), now, early_init=True)
    j.change = {**obs.change, "since": now}


def _gate_open_start(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    _started(cx, s, j, list(obs.change["gids"]), now, early_init=True)
    _incarnation_started(j, now)
    j.change = {}


def _gate_open_grow(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    gids = list(obs.change["gids"])
    cx.store.assign_gpus(s, j.id, gids)  # opens the warmed-up newcomers' gate
    cx.store.log(s, "job.gate_open", j.id, gpus=gids)
    j.change = {**obs.change, "since": now}


def _lapsed(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    """The donor did not give the reserved GPUs up in time: the reservation
    lapses and the early starters stop (all of a starting job's processes)."""
    gids = list(obs.change.get("gids", ()))
    cx.store.unreserve_gpus(s, j.id, gids)
    procs = live_procs(s, j.id)
    if j.phase == "warming":
        procs = [p for p in procs if p.name in set(obs.change.get("workers", ()))]
    stop(procs)
    j.change = {}
    cx.store.log(s, "job.early_init_lapsed", j.id, gpus=gids)


def _joined(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    j.rescales += 1
    j.change = {}


def _join_timeout(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    """Newcomers that did not join in time are given up: they stop and their
    GPUs go back once they are gone."""
    members = set(obs.progress.get("members") or ())
    late = set(obs.change.get("workers", ())) - members
    stop([p for p in live_procs(s, j.id, "worker") if p.name in late])
    j.rescales += 1
    j.change = {}
    cx.store.log(s, "job.change_timeout", j.id, change="scale_out", size=obs.change.get("target"))


def _left(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    cx.store.release_gpus(s, j.id, list(obs.change["gids"]))
    j.rescales += 1
    j.target = int(obs.change["target"])
    j.change = {}


def _shrink_overdue(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    stop(list(s.scalars(select(Process).where(Process.id.in_(list(obs.change["leavers"])),
                                              Process.state.in_(LIVE)))))  # their agents terminate them


def _shrink_timeout(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    # their node does not answer: the GPUs stay with the job (never handed out
    # while a process may still use them)
    _shrink_overdue(cx, s, j, obs, now)
    j.change = {}
    cx.store.log(s, "job.change_timeout", j.id, change="scale_in", gpus=list(obs.change["gids"]))


def _suspend_overdue(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    stop(live_procs(s, j.id))


def _suspended(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    """Every process of a suspending job is gone: its GPUs are free; it waits
    (pending, with its attained service) to be resumed from its checkpoint."""
    release_all(cx, s, j)
    j.master_url, j.waiting_since, j.change = "", now, {}
    j.progress = {**(j.progress or {}), "state": "suspended"}
    j.rescales += 1
    step = (j.progress or {}).get("suspended_step", (j.progress or {}).get("step"))
    # its workers check that they resume from this step's checkpoint ($TIDAL_RESUME_STEP)
    j.tags = {**(j.tags or {}), "_suspended": int((j.tags or {}).get("_suspended", 0)) + 1, "_resume_step": step}
    cx.store.log(s, "job.suspended", j.id, step=step)


#: (phase, event) first, then event
OBSERVED: dict[Any, Effect] = {
    "cancel": _cancel, "gone": _gone, "master_exit": _master_exit, "master_lost": _master_lost,
    "give_up": _give_up, "restart": _restart, "restarted": _restarted, "workers_done": _workers_done,
    "newcomers_gone": _newcomers_gone, ("ending", "overdue"): _ending_overdue, "gone_late": _gone_late,
    ("restarting", "overdue"): _suspend_overdue, ("restarting", "finished"): _ended,
    "workers_failed": _workers_failed, "out_of_memory": _out_of_memory,
    ("ending", "finished"): _ended, ("ending", "failed"): _ended, ("suspending", "finished"): _ended,
    ("starting", "master_up"): _master_up_starting, ("prestarting", "master_up"): _master_up_prestarting,
    "taken": _taken, ("prestarting", "gate_open"): _gate_open_start, ("warming", "gate_open"): _gate_open_grow,
    "lapsed": _lapsed, "joined": _joined, ("joining", "timeout"): _join_timeout, "left": _left,
    ("shrinking", "overdue"): _shrink_overdue, ("shrinking", "timeout"): _shrink_timeout,
    ("suspending", "overdue"): _suspend_overdue, "suspended": _suspended,
}


def observed_effect(phase: str, event: str) -> Effect:
    return OBSERVED.get((phase, event)) or OBSERVED[event]
