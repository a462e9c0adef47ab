"""The plan-driven half of the reconciler: what the policy's change for a job
does (SideCar §III-B). Starts are store-only; grows, shrinks and suspensions
are one short request to the job's master per tick (EDL §3.1: a *retry*
answer means ask again next tick); only an accepted request changes the
store, so nothing is held while a master is busy."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from tidal.control.db import GPU, Job, Process
from tidal.control.effects import Context, launch_master, next_worker_ids, spawn
from tidal.runtime.messages import ScaleAnswer

log = logging.getLogger(__name__)

LIVE = ("pending", "running")

#: how long one request to a job master may take (the loop never waits longer)
REQUEST_TIMEOUT_S = 3.0


def start(cx: Context, s: Session, j: Job, early: bool, gids: list[int], now: float) -> None:
    """Take the GPUs (``early``: reserve them while a donor gives them up) and
    launch the job's master; its workers are written once it reports its URL."""
    workers = next_worker_ids(s, j.id, len(gids))
    if early:
        if not cx.store.reserve_gpus(s, j.id, gids):
            raise RuntimeError(f"GPUs {gids} are reserved for another job")
        launch_master(cx, s, j, gids, workers)
        j.change = {"since": now, "gids": gids, "workers": workers, "early": True}
        cx.store.log(s, "job.prestart", j.id, gpus=gids)
        return
    cx.store.assign_gpus(s, j.id, gids)
    launch_master(cx, s, j, gids, workers)
    j.change = {"since": now, "gids": gids, "workers": workers}
    j.target = len(gids)
    if j.start_time is None:
        j.start_time = now
        cx.latencies.append(now - j.submit_time)
    cx.store.log(s, "job.resume" if (j.tags or {}).get("_suspended") else "job.start", j.id, gpus=gids,
                 early_init=False)


@dataclass(frozen=True)
class Prepared:
    """A request to a job's master, and the change it starts if accepted."""

    intent: str  # grow | grow_early | shrink | suspend
    url: str
    workers: tuple[str, ...] = ()  # ids to expect (grow) or to remove (shrink)
    change: dict[str, Any] = field(default_factory=dict)
    token: str = field(default="", repr=False)  # the job's credential (its master's API requires it)


def prepare(s: Session, j: Job, intent: str, gids: Sequence[int], now: float) -> Prepared:
    """``gids``: the GPUs to add (grow) or give back (shrink)."""
    held = len(s.scalars(select(GPU.gid).where(GPU.job_id == j.id)).all())
    if intent in ("grow", "grow_early"):
        workers = next_worker_ids(s, j.id, len(gids))
        change = {"since": now, "gids": list(gids), "workers": workers, "size_from": held,
                  "target": held + len(gids), "early": intent == "grow_early"}
        return Prepared(intent, j.master_url, tuple(workers), change)
    if intent == "shrink":
        leaving = list(s.scalars(select(Process).where(Process.job_id == j.id, Process.kind == "worker",
                                                       Process.gpu.in_(list(gids)), Process.state.in_(LIVE))))
        change = {"since": now, "gids": list(gids), "leavers": [p.id for p in leaving], "size_from": held,
                  "target": held - len(gids)}
        return Prepared(intent, j.master_url, tuple(p.name for p in leaving), change)
    return Prepared(intent, j.master_url, (), {"since": now})


def ask(p: Prepared) -> ScaleAnswer | None:
    """One short request; None if the master did not answer (try next tick)."""
    from tidal.runtime.client import MasterClient, MasterUnavailable

    c = MasterClient(p.url, timeout_s=REQUEST_TIMEOUT_S, patience_s=0.0, token=p.token)
    try:
        if p.intent in ("grow", "grow_early"):
            return c.scale_out(workers=list(p.workers))
        if p.intent == "shrink":
            return c.scale_in(workers=list(p.workers))
        return c.suspend()
    except MasterUnavailable as e:
        log.info("master of %s unreachable (%s); asking again next tick", p.url, e)
        return None
    finally:
        c.http.close()


def apply(cx: Context, s: Session, j: Job, p: Prepared, event: str, ans: ScaleAnswer | None) -> None:
    """The store side of the master's answer (``event``: see :func:`tidal.control.phases.answer_event`)."""
    ch = p.change
    message = ans.message if ans is not None else ""
    if event == "grow_accepted":
        cx.store.assign_gpus(s, j.id, ch["gids"])
    elif event == "grow_early_accepted":
        if not cx.store.reserve_gpus(s, j.id, ch["gids"]):
            raise RuntimeError(f"GPUs {ch['gids']} are reserved for another job")
    if event in ("grow_accepted", "grow_early_accepted"):
        spawn(cx, s, j, ch["workers"], ch["gids"])  # gated while the GPUs are only reserved
        j.change, j.target = ch, ch["target"]
        cx.store.log(s, "job.scale_out", j.id, add=ch["gids"], size_from=ch["size_from"], size_to=ch["target"],
                     early=ch["early"])
    elif event in ("shrink_accepted", "released"):
        cx.store.log(s, "job.scale_in", j.id, remove=ch["gids"], size_from=ch["size_from"], size_to=ch["target"])
        if event == "released":  # no live worker on them: nothing to wait for
            cx.store.release_gpus(s, j.id, ch["gids"])
            j.rescales += 1
            j.target = ch["target"]
        else:
            j.change = ch
    elif event == "suspend_accepted":
        j.change = ch
        cx.store.log(s, "job.suspend", j.id, gpus=cx.store.job_gpus(s, j.id))
    elif event == "suspend_refused":  # e.g. no checkpoint directory: not preempted again
        j.tags = {**(j.tags or {}), "_unsuspendable": message}
        cx.store.log(s, "job.suspend_failed", j.id, answer=message)
    elif event == "grow_refused":
        cx.store.log(s, "job.scale_out_failed", j.id, answer=message)
    elif event == "shrink_refused":
        cx.store.log(s, "job.scale_in_failed", j.id, answer=message)
