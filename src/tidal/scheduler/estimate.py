"""Small estimates shared by policies: GPU counts and remaining run time."""

from __future__ import annotations

import math

from tidal.core.job import JobSpec
from tidal.scheduler.api import JobView, Plan, Snapshot, schedulable


def rigid_count(spec: JobSpec, cap: int) -> int:
    """The count a non-elastic policy runs a job at: its request, kept within
    the job's allowed counts; an elastic job asking for more than the cluster's
    ``cap`` GPUs gets the largest count it may run at within the cluster."""
    if not spec.elastic:
        return max(1, spec.requested_gpus)
    n = min(spec.requested_gpus or spec.lo, spec.hi(cap))
    if spec.allowed_gpus is not None and n not in spec.allowed_gpus:
        n = min(spec.allowed_gpus, key=lambda a: (abs(a - n), a))
    return max(n, spec.lo)


def remaining_time(snap: Snapshot, job: JobView, n: int) -> float:
    """Seconds to finish at ``n`` GPUs from now (consolidated placement)."""
    rate = snap.throughput(job, n)
    return job.remaining / rate if rate > 0 else math.inf


def useful_counts(snap: Snapshot, job: JobView | JobSpec, cap: int) -> list[int]:
    """Counts a job may take that were profiled (powers of two for the A100
    profiles, the buddy sizes of ElasticFlow §4.3), ascending, at most ``cap``;
    a job with its own ``allowed_gpus`` may take any of those."""
    spec = job.spec if isinstance(job, JobView) else job
    if spec.allowed_gpus is not None:
        return spec.counts(cap)  # the user's own list of counts wins
    profiled = snap.profiles.profiled_counts(spec.model, spec.batch_size)
    if spec.elastic:  # spec.counts(cap) is the range [lo, hi(cap)]: no need to list it
        lo, hi = spec.lo, spec.hi(cap)
        return sorted({c for c in profiled if lo <= c <= hi})
    return [c for c in spec.counts(cap) if c in set(profiled)]


def best_count(snap: Snapshot, job: JobView | JobSpec, cap: int) -> int:
    """The smallest useful count <= ``cap`` with the highest throughput (0 if
    none fits): more GPUs only while they still raise throughput."""
    best_n, best_v = 0, 0.0
    for c in useful_counts(snap, job, cap):
        v = snap.throughput(job, c)
        if v > best_v * (1 + 1e-9):
            best_n, best_v = c, v
    return best_n


def keep_running(snap: Snapshot, plan: Plan) -> tuple[int, list[JobView]]:
    """Non-preemptive policies: every running job keeps its GPU count (entered
    in ``plan.allocation``). Returns the GPUs left and the waiting jobs in
    submission order."""
    free = snap.cluster.num_gpus
    queue = []
    for j in schedulable(snap, plan):
        if j.running:
            plan.allocation[j.job_id] = j.size
            free -= j.size
        else:
            queue.append(j)
    queue.sort(key=lambda j: (j.spec.submit_time, j.job_id))
    return free, queue
