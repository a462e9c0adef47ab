"""k8s-default: the Kubernetes default scheduler, the SideCar paper's first baseline.

Wang et al., SC'20, §IV (evaluation baselines): each job runs at a fixed GPU
count drawn at random among its optional counts (``JobSpec.allowed_gpus``;
a job without them runs at its requested count), never resized or
preempted. Jobs are bound in submission order; a job that does not fit
stays pending while later ones that fit are bound (the default scheduler
retries unschedulable pods without blocking the queue). The draw is seeded by
the job id (CRC-32), so runs are deterministic without a global RNG.
"""

from __future__ import annotations

import zlib

from tidal.core.job import JobSpec
from tidal.scheduler.api import Plan, Policy, Snapshot
from tidal.scheduler.estimate import keep_running, rigid_count


def fixed_count(snap: Snapshot, spec: JobSpec) -> int:
    """The job's count: one of its optional counts that fit the cluster and
    run, picked by CRC-32 of the job id; else its requested count."""
    cap = snap.cluster.num_gpus
    allowed = (
        [c for c in spec.counts(cap) if snap.throughput(spec, c) > 0]
        if spec.elastic and spec.allowed_gpus is not None
        else []
    )
    if not allowed:
        return rigid_count(spec, cap)
    return allowed[zlib.crc32(spec.job_id.encode()) % len(allowed)]


class K8sDefault(Policy):
    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        free, queue = keep_running(snap, plan)
        for j in queue:
            n = fixed_count(snap, j.spec)
            if n <= free:
                plan.allocation[j.job_id] = n
                free -= n
