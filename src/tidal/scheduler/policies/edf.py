"""EDF: earliest deadline first, ElasticFlow's elastic baseline (ElasticFlow §6.1).

Every round, jobs are ordered by deadline (jobs without one come last, by
submission time) and each in turn gets as many GPUs as still raise its
throughput, among the profiled (power-of-two) counts that fit what is left.
Preemptive and elastic; no admission control, so a burst of tight deadlines
can make every job late (ElasticFlow Fig. 3). Inelastic jobs run at their
requested count.

Option ``count_rule="largest"`` (the public ElasticFlow artifact's EDF, its
``edf_sim_allocation``): each job asks for its largest profiled count (at most
64 and at most its global batch), past the throughput peak, and takes the
largest profiled count that fits what is left when that does not fit.
"""

from __future__ import annotations

import math

from tidal.scheduler.api import JobView, Plan, Policy, Snapshot, schedulable
from tidal.scheduler.estimate import best_count, rigid_count


def largest_count(snap: Snapshot, job: JobView, free: int) -> int:
    """The artifact's EDF count: its largest profiled count (<= 64, <= the
    global batch) if it fits ``free``, else the largest profiled count that does."""
    profiled = snap.profiles.profiled_counts(job.spec.model, job.spec.batch_size)
    top = min(64, job.spec.batch_size, max(profiled), snap.cluster.num_gpus)
    fit = [c for c in profiled if c <= min(top, free)]
    return fit[-1] if fit else 0


def edf_allocation(snap: Snapshot, plan: Plan, count_rule: str = "best") -> None:
    jobs = schedulable(snap, plan)
    jobs.sort(key=lambda j: (j.spec.deadline if j.spec.deadline is not None else math.inf, j.spec.submit_time, j.job_id))
    free = snap.cluster.num_gpus
    for j in jobs:
        if j.spec.elastic:
            n = best_count(snap, j, free) if count_rule == "best" else largest_count(snap, j, free)
        else:
            n = rigid_count(j.spec, snap.cluster.num_gpus)
            n = n if n <= free else 0
        if n > 0:
            plan.allocation[j.job_id] = n
            free -= n


class EDF(Policy):
    """``count_rule``: ``"best"`` (default: the throughput-peak count) or
    ``"largest"`` (the artifact's largest profiled count)."""

    def __init__(self, count_rule: str = "best") -> None:
        if count_rule not in ("best", "largest"):
            raise ValueError(f"count_rule must be 'best' or 'largest', got {count_rule!r}")
        self.count_rule = count_rule

    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        edf_allocation(snap, plan, self.count_rule)
