"""The observed half of the reconciler: what the store says about a job (its
processes as the agents report them, the progress its master reports) and
whether GPUs can be taken."""

from __future__ import annotations

from typing import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from tidal.control.db import GPU, Job, Process
from tidal.control.phases import DONOR, SUSPENDING, JobObs

LIVE = ("pending", "running")


def observe(s: Session, j: Job) -> tuple[JobObs, list[Process]]:
    """The job's observation, and its current incarnation's processes (the
    latest master and everything after it; after a resume the old ones are
    history)."""
    procs = list(s.scalars(select(Process).where(Process.job_id == j.id).order_by(Process.id)))
    master = max((p for p in procs if p.kind == "master"), key=lambda p: p.id, default=None)
    live = [p for p in procs if p.state in LIVE]
    change = dict(j.change or {})
    leavers = set(change.get("leavers", ()))
    gids = change.get("gids")
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
        unsuspendable=bool((j.tags or {}).get("_unsuspendable")),
    )
    current = [p for p in procs if master is not None and p.id > master.id]
    return obs, current


def _giving_up(s: Session, holder: str, cache: dict[str, set[int]]) -> set[int]:
    """GPUs a job is giving back (shrinking: the change's GPUs; suspending: all)."""
    if holder not in cache:
        j = s.get(Job, holder)
        out: set[int] = set()
        if j is not None and j.phase in DONOR:
            if j.phase == SUSPENDING:
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
