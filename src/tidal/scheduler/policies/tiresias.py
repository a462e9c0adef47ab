"""Tiresias: discretised two-dimensional least-attained-service (2D-LAS).

Gu et al., NSDI'19, §4 (Discretized 2D-LAS); the setting EDL §5.1 used for
Elastic-Tiresias: attained service is GPU-seconds (GPUs x time run); jobs fall
into priority queues at thresholds 500 and 10,000 GPU-s; within a queue jobs
are served in submission order; the scheduler is preemptive (a running job
whose queue is served later loses its GPUs). A job that has waited longer than
``promote_knob`` x its executed time is promoted back to the first queue,
against starvation (Tiresias' STARVELIMIT). Jobs are rigid; a job that does
not fit is skipped, not blocking the ones behind it.
"""

from __future__ import annotations

import bisect
import math
from operator import itemgetter

from tidal.core.job import JobState
from tidal.scheduler.api import JobView, Plan, Policy, Snapshot
from tidal.scheduler.estimate import rigid_count


def queue_of(job: JobView, thresholds: tuple[float, ...]) -> int:
    service = job.attained - job.tags.get("tiresias_base", 0.0)
    return bisect.bisect_right(thresholds, service)


_RUNNING, _RESIZING = JobState.RUNNING, JobState.RESIZING
_ID, _COUNT, _VIEW = itemgetter(2), itemgetter(4), itemgetter(5)


def _promote(j: JobView, now: float, promote_knob: float, tags: dict) -> float | None:
    """The starvation guard for a waiting job that has run: promoted (its
    base reset, recorded in ``tags``) once it has waited ``promote_knob`` x its
    executed time. Returns ``None`` if it is promoted now, else when it will be
    (``inf`` with an infinite knob: never, as in the ElasticFlow artifact)."""
    promote_at = j.waiting_since + promote_knob * j.executed
    if now < promote_at:
        return promote_at
    tags[j.job_id] = {"tiresias_base": j.attained, "promotions": j.tags.get("promotions", 0) + 1}
    return None


def tiresias_allocation(
    snap: Snapshot,
    plan: Plan,
    thresholds: tuple[float, ...] = (500.0, 10_000.0),
    promote_knob: float = 8.0,
) -> list[JobView]:
    """Fill ``plan.allocation``; return the jobs in priority order: by queue,
    then submission time and id (ties kept in snapshot order)."""
    now = snap.now
    wake = math.inf
    total = snap.cluster.num_gpus
    bisect_right = bisect.bisect_right
    order: list[tuple[int, float, str, int, int, JobView]] = []  # priority, position, count, view
    append = order.append
    need = pos = 0
    admit, drop = plan.admit, plan.drop
    for j in snap.jobs:  # the schedulable ones (api.schedulable, inlined)
        spec = j.spec
        if not j.admitted and spec.job_id not in admit or drop and spec.job_id in drop:
            continue
        tags, state = j.tags, j.state
        q = bisect_right(thresholds, j.attained - tags.get("tiresias_base", 0.0) if tags else j.attained)  # queue_of
        if state is _RUNNING or state is _RESIZING:
            n = len(j.gpus)
        else:
            n = rigid_count(spec, total)
            if q > 0 and j.executed > 0:
                at = _promote(j, now, promote_knob, plan.tags)
                if at is None:
                    q = 0
                else:
                    wake = min(wake, at)
        need += n
        pos += 1
        append((q, spec.submit_time, spec.job_id, pos, n, j))
    order.sort()  # positions are unique: views are never compared
    if need <= total:  # everyone fits: nobody waits
        plan.allocation.update(zip(map(_ID, order), map(_COUNT, order)))
    else:
        wake = min(wake, _fill(snap, plan, order, thresholds))
    plan.wake_at = wake if wake < math.inf else None
    return list(map(_VIEW, order))


def _fill(snap: Snapshot, plan: Plan, order: list[tuple[int, float, str, int, int, JobView]],
          thresholds: tuple[float, ...]) -> float:
    """Allocate in priority order, skipping jobs that do not fit; return when
    the next demotion of a running job may change the order (if one waits)."""
    free = snap.cluster.num_gpus
    alloc = plan.allocation
    waiting = False
    for _, _, jid, _, n, _ in order:
        if n <= free:
            alloc[jid] = n
            free -= n
        else:
            waiting = True
    wake = math.inf
    if waiting:
        now = snap.now
        for q, _, jid, _, _, j in order:
            n = alloc.get(jid, 0)
            if n and q < len(thresholds):
                base = plan.tags.get(jid, {}).get("tiresias_base", j.tags.get("tiresias_base", 0.0))
                left = thresholds[q] - (j.attained - base)
                wake = min(wake, now + max(left, 0.0) / n)
    return wake


def everyone_fits(snap: Snapshot, plan: Plan, thresholds: tuple[float, ...], promote_knob: float) -> bool:
    """If every schedulable job fits at once, fill ``plan`` as
    :func:`tiresias_allocation` would (the same allocation, tags and wake; the
    allocation in another order) and return True; else change nothing and
    return False. Nobody waits, so the queue order decides nothing: only jobs
    without GPUs are looked at, through the snapshot's indexes."""
    held, idle = snap.held, snap.idle
    total = snap.cluster.num_gpus
    need = sum(snap.sizes.values())
    if need > total or len(idle) + len(held) != len(snap.jobs) or not snap.holders_running:
        return False
    drop = plan.drop
    if drop and not drop.keys().isdisjoint(held):
        return False
    admit, now = plan.admit, snap.now
    extra: dict[str, int] = {}
    tags: dict[str, dict[str, float]] = {}
    wake = math.inf
    for j in idle:
        spec, state = j.spec, j.state
        if state is _RUNNING or state is _RESIZING:
            return False
        jid = spec.job_id
        if not j.admitted and jid not in admit or jid in drop:
            continue
        extra[jid] = n = rigid_count(spec, total)
        need += n
        if need > total:
            return False
        if j.executed > 0 and queue_of(j, thresholds) > 0:
            at = _promote(j, now, promote_knob, tags)
            if at is not None:
                wake = min(wake, at)
    plan.allocation.update(snap.sizes)
    plan.allocation.update(extra)
    plan.tags.update(tags)
    plan.wake_at = wake if wake < math.inf else None
    return True


class Tiresias(Policy):
    def __init__(self, thresholds: tuple[float, ...] = (500.0, 10_000.0), promote_knob: float = 8.0) -> None:
        self.thresholds = tuple(thresholds)
        self.promote_knob = promote_knob

    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        if not everyone_fits(snap, plan, self.thresholds, self.promote_knob):
            tiresias_allocation(snap, plan, self.thresholds, self.promote_knob)

    def settled(self, snap: Snapshot, plan: Plan) -> bool:
        """Every job is allocated or dropped: nobody waits, so until a job
        arrives the running jobs keep their GPUs (rigid, all fit), the queue
        order decides nothing and no waiting job can be promoted (§4)."""
        alloc = plan.allocation
        return len(alloc) + len(plan.drop) == len(snap.jobs) and not plan.batch and all(alloc.values())
