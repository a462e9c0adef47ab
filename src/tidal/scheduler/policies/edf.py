"""EDF: earliest deadline first, ElasticFlow's elastic baseline (ElasticFlow §6.1).

Every round, jobs are ordered by deadline (jobs without one come last, by
submission time) and each in turn gets as many GPUs as still raise its
throughput, among the profiled (power-of-two) counts that fit what is left.
Preemptive and elastic; no admission control, so a burst of tight deadlines
can make every job late (ElasticFlow Fig. 3). Inelastic jobs run at their
requested count.
"""

from __future__ import annotations

import math

from tidal.scheduler.api import Plan, Policy, Snapshot, schedulable
from tidal.scheduler.estimate import best_count, rigid_count


def edf_allocation(snap: Snapshot, plan: Plan) -> None:
    jobs = schedulable(snap, plan)
    jobs.sort(key=lambda j: (j.spec.deadline if j.spec.deadline is not None else math.inf, j.spec.submit_time, j.job_id))
    free = snap.cluster.num_gpus
    for j in jobs:
        if j.spec.elastic:
            n = best_count(snap, j, free)
        else:
            n = rigid_count(j.spec, snap.cluster.num_gpus)
            n = n if n <= free else 0
        if n > 0:
            plan.allocation[j.job_id] = n
            free -= n


class EDF(Policy):
    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        edf_allocation(snap, plan)
