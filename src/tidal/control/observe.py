"""The observed half of the reconciler: what the store says about a job (its
processes as the agents report them, the progress its master reports) and
whether GPUs can be taken."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from tidal.control.db import GPU, Job, Node, Process
from tidal.control.phases import (
    CANCELLING, DONOR, ENDING, RESTARTING, STATE_OF, SUSPENDING, TERMINAL as TERMINAL_STATES, Bounds, JobObs, judge,
)

LIVE = ("pending", "running")

#: a job's master is restarted on another host at most this often per incarnation
MAX_RELOCATIONS = 3

#: phases stepped every tick (each frees GPUs as its processes go)
_NEVER_QUIET = frozenset({ENDING, CANCELLING, RESTARTING})


def job_procs(s: Session, job_id: str) -> list[Process]:
    """The job's processes, oldest first."""
    return list(s.scalars(select(Process).where(Process.job_id == job_id).order_by(Process.id)))


def incarnation(procs: Sequence[Process]) -> tuple[Process | None, Process | None, list[Process]]:
    """``(latest master, the incarnation's first master, its other
    processes)`` of a job's processes in id order: the incarnation starts at
    the latest master launched with the job's GPUs on (after a resume the
    older ones are history); a master relocated to another host continues it."""
    masters = [p for p in procs if p.kind == "master"]
    master = masters[-1] if masters else None
    first = next((p for p in reversed(masters) if not p.relocated), master)
    return master, first, [p for p in procs if first is not None and p.id > first.id]


def observe(s: Session, j: Job, procs: Sequence[Process] | None = None) -> tuple[JobObs, list[Process]]:
    """The job's observation, and its current incarnation's processes (from
    the latest master launched with the job's GPUs on; after a resume the old
    ones are history; a master relocated to another host continues the
    incarnation). ``procs``: the job's processes by id, if read already."""
    if procs is None:
        procs = job_procs(s, j.id)
    master, first, current = incarnation(procs)
    live = [p for p in procs if p.state in LIVE]
    change = dict(j.change or {})
    leavers = set(change.get("leavers", ()))
    gids = change.get("gids")
    tags = j.tags or {}
    workers = [p for p in current if p.kind == "worker"]
    names = set(change.get("workers", ())) if j.phase == "joining" else set()
    newcomers = [p for p in workers if p.name in names]
    obs = JobObs(
        phase=j.phase,
        change=change,
        cancel_requested=j.state == "cancelling",
        master=master.state if master is not None else None,
        master_exit_code=master.exit_code if master is not None else None,
        master_url=j.master_url or "",
        progress=dict(j.progress or {}),
        live=len(live),
        live_workers=sum(1 for p in live if p.kind == "worker"),
        leavers_live=sum(1 for p in live if p.id in leavers),
        change_gpus=gpu_availability(s, j.id, gids) if gids and change.get("early") else "",
        # a master that refused a suspension, or a user's pin (tidal scale ID N): the job keeps its GPUs
        unsuspendable=bool((j.tags or {}).get("_unsuspendable") or (j.spec or {}).get("pinned")),
        relocate_to=relocation_target(s, current) if master is not None and master.state == "lost" else "",
        workers_erred=workers_erred(current),
        members_gone=members_gone(current, j.progress or {}),
        give_up=str(tags.get("_give_up") or launch_error([p for p in procs if first is not None and p.id >= first.id])),
        workers_seen=len(workers),
        workers_clean=bool(workers) and all(p.state == "exited" and p.exit_code == 0 for p in workers),
        newcomers_gone=bool(newcomers) and all(p.state in ("exited", "failed") for p in newcomers),
        started_at=float(tags.get("_started_at") or 0.0),
        restarts=int(tags.get("_restarts") or 0),
        script_ended=bool(tags.get("_script_ended")),
    )
    return obs, current


def launch_error(current: Sequence[Process]) -> str:
    """The first of the incarnation's processes that could not be launched
    (the OS error its agent reported), as the job's failure reason; ""."""
    for p in current:
        if p.error:
            return f"{p.name} could not start: {p.error}"
    return ""


def quiet_jobs(s: Session, deltas: Mapping[str, Any], now: float, timeout_s: float,
               bounds: Bounds | None = None) -> set[str]:
    """Live jobs whose step this tick would change nothing: no change from
    the plan, no observed event, the state in line with the phase, and no
    dead worker whose GPU the job still holds. Read in three queries for
    every job, so a round costs a transaction only for the jobs that move."""
    jobs = list(s.scalars(select(Job).where(Job.state.notin_(TERMINAL_STATES))))
    ids = [j.id for j in jobs]
    procs: dict[str, list[Process]] = {}
    for p in s.scalars(select(Process).where(Process.job_id.in_(ids)).order_by(Process.id)):
        procs.setdefault(p.job_id, []).append(p)
    held: dict[str, set[int]] = {}
    for gid, holder in s.execute(select(GPU.gid, GPU.job_id).where(GPU.job_id.in_(ids))):
        held.setdefault(holder, set()).add(gid)
    out = set()
    for j in jobs:
        if j.id in deltas or j.phase in TERMINAL_STATES or j.state != STATE_OF.get(j.phase):
            continue
        obs, current = observe(s, j, procs.get(j.id, []))
        if j.phase in _NEVER_QUIET or judge(obs, now, timeout_s, bounds) is not None:
            continue
        if any(p.kind == "worker" and p.state in ("failed", "exited") and p.gpu in held.get(j.id, ())
               for p in current):
            continue
        out.add(j.id)
    return out


def workers_erred(current: Sequence[Process]) -> bool:
    """Every worker of the incarnation ended and at least one exited with an
    error code (a Python exception). Workers that were only killed (a
    signal) are not an error: the job is grown back and recovers from its
    checkpoint."""
    workers = [p for p in current if p.kind == "worker"]
    if not workers or any(p.state in ("pending", "running", "lost") for p in workers):
        return False
    return any(p.state == "failed" and (p.exit_code or 0) > 0 for p in workers)


def members_gone(current: Sequence[Process], progress: Mapping[str, Any]) -> str:
    """How the last generation the master reported ended, when none of its
    members runs any more (newcomers may still wait: nobody is left to give
    them the state): "erred" if one exited with an error, "killed" if all
    were killed or lost; "" while a member runs, before any generation, or
    after the job finished."""
    members = set(progress.get("members") or ())
    if not members or progress.get("state") in ("finished", "suspended", "restarting"):
        return ""
    mine = [p for p in current if p.kind == "worker" and p.name in members]
    if not mine or any(p.state in ("pending", "running") for p in mine):
        return ""
    if any(p.state == "failed" and (p.exit_code or 0) > 0 for p in mine):
        return "erred"
    return "killed" if any(p.state in ("failed", "lost") for p in mine) else ""  # else all exited 0


def relocation_target(s: Session, current: Sequence[Process]) -> str:
    """Where a master lost with its host restarts: the up node running most
    of the incarnation's workers (ties: by name); "" if none is left or the
    master moved :data:`MAX_RELOCATIONS` times already."""
    if sum(p.kind == "master" and p.relocated for p in current) >= MAX_RELOCATIONS:
        return ""
    up = set(s.scalars(select(Node.name).where(Node.state == "up")))
    counts: dict[str, int] = {}
    for p in current:
        if p.kind == "worker" and p.state == "running" and p.node in up:
            counts[p.node] = counts.get(p.node, 0) + 1
    return min(counts, key=lambda n: (-counts[n], n), default="")


def _giving_up(s: Session, holder: str, cache: dict[str, set[int]]) -> set[int]:
    """GPUs a job is giving back (shrinking: the change's GPUs; suspending, restarting: all)."""
    if holder not in cache:
        j = s.get(Job, holder)
        out: set[int] = set()
        if j is not None and j.phase in DONOR:
            if j.phase in (SUSPENDING, RESTARTING):
                out = set(s.scalars(select(GPU.gid).where(GPU.job_id == holder)))
            else:
                out = set((j.change or {}).get("gids", ()))
        cache[holder] = out
    return cache[holder]


def gpu_availability(s: Session, job_id: str, gids: Sequence[int]) -> str:
    """``free`` if every GPU is free (or already the job's) and not reserved
    for another job; ``donated`` if the others are held by jobs giving them
    back (early initialisation may reserve them, SideCar §III-C); else
    ``blocked``."""
    rows = list(s.scalars(select(GPU).where(GPU.gid.in_(list(gids)))))
    if len(rows) != len(set(gids)):
        return "blocked"
    out, cache = "free", {}
    for g in rows:
        if g.reserved_for not in (None, job_id):
            return "blocked"
        if g.job_id in (None, job_id):
            continue
        if g.gid not in _giving_up(s, g.job_id, cache):
            return "blocked"
        out = "donated"
    return out
