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

import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from tidal import settings
from tidal.control.credentials import Credentials
from tidal.control.db import GPU, Event, Job, Process, Store
from tidal.control.phases import CANCELLING, STATE_OF, TERMINAL, JobObs
from tidal.control.spawner import AgentSpawner, launches_on

LIVE = ("pending", "running")


@dataclass
class Context:
    """What the effects need besides the store rows."""

    store: Store
    server_url: str = ""
    credentials: Credentials = field(default_factory=Credentials)
    home: Path = field(default_factory=settings.home)
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=1024))  # submit -> start, seconds


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
    procs = list(s.scalars(select(Process).where(Process.job_id == j.id).order_by(Process.id)))
    masters = [p for p in procs if p.kind == "master"]
    old, first = masters[-1], next(p for p in reversed(masters) if not p.relocated)
    lost = [p.name for p in procs if p.kind == "worker" and p.id > first.id and p.state in ("lost", "failed")]
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


def release_dead_workers(cx: Context, s: Session, j: Job, procs: list[Process]) -> None:
    """A worker of a running job died: the runtime's survivors re-form without
    it (a forced scale-in); its GPU goes back to the pool, so the policy can
    give it to this job again or to another one, unless a live process of the
    job already uses it. ``procs``: this incarnation's processes."""
    busy = {p.gpu for p in procs if p.state in ("pending", "running", "lost")}
    # a lost worker's GPU waits until its node reports the process gone (then it is "failed")
    dead = [p for p in procs if p.kind == "worker" and p.state == "failed" and p.gpu is not None]
    if not dead:
        return
    done = {(e.detail or {}).get("worker") for e in s.scalars(
        select(Event).where(Event.job_id == j.id, Event.kind == "job.worker_lost"))}
    held = set(cx.store.job_gpus(s, j.id))
    for p in dead:
        if p.name in done or p.gpu in busy or p.gpu not in held:
            continue  # handled once; or the GPU already runs another process of the job
        cx.store.release_gpus(s, j.id, [p.gpu])
        cx.store.log(s, "job.worker_lost", j.id, gpu=p.gpu, worker=p.name, state=p.state, exit_code=p.exit_code)


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


def _workers_failed(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    """Every worker exited with an error: the job fails with the first
    worker's last log line as the reason, and its master stops."""
    failed = list(s.scalars(select(Process).where(Process.job_id == j.id, Process.kind == "worker",
                                                  Process.state == "failed").order_by(Process.id.desc())))
    why = last_error(cx.home / "logs" / j.id, [p.name for p in failed])
    j.exit_info = f"every worker failed; {why}"
    stop(live_procs(s, j.id))
    unreserve_all(s, j.id)
    j.change = {}
    cx.store.log(s, "job.workers_failed", j.id, workers=[p.name for p in failed], reason=why)


def last_error(logs: Path, names: Sequence[str]) -> str:
    """``name: last line`` of the first of these workers' logs that has one."""
    for name in names:
        try:
            lines = [ln.strip() for ln in (logs / f"{name}.log").read_text(errors="replace").splitlines()]
        except OSError:
            continue
        lines = [ln for ln in lines if ln]
        if lines:
            return f"{name}: {lines[-1][:400]}"
    return "see the workers' logs (tidal logs JOB --worker w0)"


def _master_exit(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    unreserve_all(s, j.id)
    if not obs.finished_ok:
        stop(live_procs(s, j.id, "worker"))
    j.change = {}


def _ended(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    release_all(cx, s, j)
    j.end_time, j.change = now, {}
    ok = obs.finished_ok
    if not ok:
        master = s.scalar(select(Process).where(Process.job_id == j.id, Process.kind == "master")
                          .order_by(Process.id.desc()).limit(1))
        j.exit_info = j.exit_info or (f"master lost with node {master.node}"
                                      if master is not None and obs.master == "lost"
                                      else f"master exit code {obs.master_exit_code}")
    cx.store.log(s, "job.completed" if ok else "job.failed", j.id, exit_code=obs.master_exit_code)


def _master_up_starting(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    spawn(cx, s, j, obs.change["workers"], obs.change["gids"])
    j.change = {}


def _master_up_prestarting(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    spawn(cx, s, j, obs.change["workers"], obs.change["gids"])  # gated: the GPUs are reserved
    j.change = {**obs.change, "spawned": True}


def _taken(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    _started(cx, s, j, list(obs.change["gids"]), now, early_init=True)
    j.change = {**obs.change, "since": now}


def _gate_open_start(cx: Context, s: Session, j: Job, obs: JobObs, now: float) -> None:
    _started(cx, s, j, list(obs.change["gids"]), now, early_init=True)
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
    "workers_failed": _workers_failed,
    ("ending", "finished"): _ended, ("ending", "failed"): _ended, ("suspending", "finished"): _ended,
    ("starting", "master_up"): _master_up_starting, ("prestarting", "master_up"): _master_up_prestarting,
    "taken": _taken, ("prestarting", "gate_open"): _gate_open_start, ("warming", "gate_open"): _gate_open_grow,
    "lapsed": _lapsed, "joined": _joined, ("joining", "timeout"): _join_timeout, "left": _left,
    ("shrinking", "overdue"): _shrink_overdue, ("shrinking", "timeout"): _shrink_timeout,
    ("suspending", "overdue"): _suspend_overdue, "suspended": _suspended,
}


def observed_effect(phase: str, event: str) -> Effect:
    return OBSERVED.get((phase, event)) or OBSERVED[event]
