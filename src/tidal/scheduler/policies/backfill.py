"""EASY backfill (as in Slurm's sched/backfill with one reservation).

Jobs start in submission order. When the head job does not fit, it gets a
reservation at the *shadow time* — the earliest time enough running jobs will
have finished — and later jobs may start now ("backfill") only if they end
before the shadow time or use only the *extra* GPUs the head job will not
need then. Run times are predicted from the throughput profile (Slurm uses the
user's time limit instead). Rigid and non-preemptive.
"""

from __future__ import annotations

import math

from tidal.scheduler.api import Plan, Policy, Snapshot, schedulable
from tidal.scheduler.estimate import remaining_time, rigid_count


def easy_backfill(snap: Snapshot, plan: Plan) -> None:
    now = snap.now
    launch = snap.overheads.launch_s
    free = snap.cluster.num_gpus
    ends: list[tuple[float, int]] = []  # (predicted end, GPUs released)
    queue = []
    for j in schedulable(snap, plan):
        if j.running:
            plan.allocation[j.job_id] = j.size
            free -= j.size
            ends.append((now + remaining_time(snap, j, j.size), j.size))
        else:
            queue.append(j)
    queue.sort(key=lambda j: (j.spec.submit_time, j.job_id))
    shadow, extra = None, 0
    for j in queue:
        n = rigid_count(j.spec, snap.cluster.num_gpus)
        if shadow is None:
            if n <= free:
                plan.allocation[j.job_id] = n
                free -= n
                ends.append((now + launch + remaining_time(snap, j, n), n))
                continue
            # reserve for the head job: when will n GPUs be free?
            avail = free
            shadow = math.inf
            for end, k in sorted(ends):
                avail += k
                if avail >= n:
                    shadow, extra = end, avail - n
                    break
            continue
        if n > free:
            continue
        if now + launch + remaining_time(snap, j, n) <= shadow:
            plan.allocation[j.job_id] = n
            free -= n
        elif n <= extra:
            plan.allocation[j.job_id] = n
            free -= n
            extra -= n


class Backfill(Policy):
    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        easy_backfill(snap, plan)
