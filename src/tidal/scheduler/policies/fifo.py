"""FIFO: first come, first served, rigid, non-preemptive, head-of-line blocking.

The baseline of Elan §VI-C and of every cluster scheduler: jobs start in
submission order at their requested GPU count; a job that does not fit blocks
every job behind it.
"""

from __future__ import annotations

from tidal.scheduler.api import Plan, Policy, Snapshot
from tidal.scheduler.estimate import keep_running, rigid_count


def fifo_allocation(snap: Snapshot, plan: Plan) -> None:
    free, queue = keep_running(snap, plan)
    for j in queue:
        n = rigid_count(j.spec, snap.cluster.num_gpus)
        if n > free:
            break
        plan.allocation[j.job_id] = n
        free -= n


class FIFO(Policy):
    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        fifo_allocation(snap, plan)
