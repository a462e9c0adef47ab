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

from tidal.scheduler.api import JobView, Plan, Policy, Snapshot, schedulable
from tidal.scheduler.estimate import rigid_count


def queue_of(job: JobView, thresholds: tuple[float, ...]) -> int:
    service = job.attained - job.tags.get("tiresias_base", 0.0)
    return bisect.bisect_right(thresholds, service)


def tiresias_allocation(
    snap: Snapshot,
    plan: Plan,
    thresholds: tuple[float, ...] = (500.0, 10_000.0),
    promote_knob: float = 8.0,
) -> list[JobView]:
    """Fill ``plan.allocation``; return the jobs in priority order."""
    now = snap.now
    jobs = schedulable(snap, plan)
    wake = math.inf
    order: list[tuple[int, float, str, JobView]] = []
    bisect_right = bisect.bisect_right
    for j in jobs:
        q = bisect_right(thresholds, j.attained - j.tags.get("tiresias_base", 0.0))  # queue_of
        if q > 0 and j.executed > 0 and not j.running:
            promote_at = j.waiting_since + promote_knob * j.executed
            if now >= promote_at:
                plan.tags[j.job_id] = {"tiresias_base": j.attained, "promotions": j.tags.get("promotions", 0) + 1}
                q = 0
            else:
                wake = min(wake, promote_at)
        order.append((q, j.spec.submit_time, j.job_id, j))
    order.sort(key=lambda x: x[:3])
    free = total = snap.cluster.num_gpus
    waiting = False
    for q, _, jid, j in order:
        n = len(j.gpus) if j.running else rigid_count(j.spec, total)
        if n <= free:
            plan.allocation[jid] = n
            free -= n
        else:
            waiting = True
    if waiting:
        # the next demotion of a running job may change the order
        for q, _, jid, j in order:
            n = plan.allocation.get(jid, 0)
            if n and q < len(thresholds):
                base = plan.tags.get(jid, {}).get("tiresias_base", j.tags.get("tiresias_base", 0.0))
                left = thresholds[q] - (j.attained - base)
                wake = min(wake, now + max(left, 0.0) / n)
    plan.wake_at = wake if wake < math.inf else None
    return [x[3] for x in order]


class Tiresias(Policy):
    def __init__(self, thresholds: tuple[float, ...] = (500.0, 10_000.0), promote_knob: float = 8.0) -> None:
        self.thresholds = tuple(thresholds)
        self.promote_knob = promote_knob

    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        tiresias_allocation(snap, plan, self.thresholds, self.promote_knob)
