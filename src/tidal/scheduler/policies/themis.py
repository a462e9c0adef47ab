"""Themis: finish-time fair GPU allocation with leases.

Mahajan et al., "Themis: Fair and Efficient GPU Cluster Scheduling", NSDI'20.
§3.2 defines finish-time fairness ρ = T_sh / T_id; §3.3 the partial allocation
auction, in which the arbiter offers GPUs to the 1 − f fraction of jobs with
the worst ρ (f is the fairness knob) and hands the leftover to the others;
§4 (system design) runs it in rounds of leases: GPUs are granted for one
lease and may be taken back (preemption) when the lease ends.

As run here (ElasticFlow §6.1 uses Themis as a rigid baseline):

    every lease boundary:                     # all leases end together
        for each job j:  ρ_j = T_sh(j) / T_id(j)
            T_id = I_j / r_j(n_j)              # alone on its requested n_j GPUs
            T_sh = (now − submit_j) + remaining_j / r_j(n_j)
                                               # finish time if offered n_j now
        offer: the ⌈(1 − f)·N⌉ jobs with the largest ρ, worst first, get n_j
               GPUs if n_j still fit                     (auction, simplified)
        leftover: running jobs renew their lease, then waiting jobs, by ρ
    between boundaries: running jobs keep their GPUs; GPUs freed by
        completions go to waiting jobs in ρ order (work conserving).

Simplifications (docs/policies/baselines.md): the auction's bids and its
Pareto-efficient partial allocation are replaced by greedy-by-ρ; T_id is the
job alone on its requested GPUs (the paper uses a 1/N share of the cluster;
the two agree while the cluster is not over-subscribed); one job per app.
"""

from __future__ import annotations

import math

from tidal.scheduler.api import JobView, Plan, Policy, Snapshot, schedulable
from tidal.scheduler.estimate import rigid_count

LEASE_TAG = "lease_end"
_EPS = 1e-6


def lease_end(now: float, lease: float) -> float:
    """End of the lease window that contains ``now`` (windows are aligned to
    multiples of ``lease``, so every lease granted in a window ends together)."""
    return (math.floor(now / lease + _EPS) + 1) * lease


def lease_round(snap: Snapshot, jobs: list[JobView]) -> bool:
    """True when the running jobs' leases have ended (or nothing runs)."""
    running = [j for j in jobs if j.running]
    return not running or any(j.tags.get(LEASE_TAG, 0.0) <= snap.now + _EPS for j in running)


def finish_time_fairness(snap: Snapshot, job: JobView, n: int) -> float:
    """ρ = T_sh / T_id of ``job`` if it runs on ``n`` GPUs from now (Themis §3.2)."""
    rate = snap.throughput(job, n)
    if rate <= 0:
        return math.inf
    t_id = job.spec.iterations / rate
    t_sh = (snap.now - job.spec.submit_time) + job.remaining / rate
    return t_sh / t_id


def runnable_count(snap: Snapshot, job: JobView) -> int:
    """The rigid count of ``job``, or 0 if the profile says it cannot run there."""
    n = job.size if job.running else rigid_count(job.spec, snap.cluster.num_gpus)
    return n if snap.throughput(job, n) > 0 else 0


def themis_allocation(snap: Snapshot, plan: Plan, lease: float = 600.0, fairness_knob: float = 0.8) -> None:
    jobs = schedulable(snap, plan)
    if not jobs:
        return
    end = lease_end(snap.now, lease)
    counts = {j.job_id: runnable_count(snap, j) for j in jobs}
    rho = {j.job_id: finish_time_fairness(snap, j, counts[j.job_id]) for j in jobs}
    worst_first = sorted(jobs, key=lambda j: (-rho[j.job_id], j.spec.submit_time, j.job_id))
    free = snap.cluster.num_gpus
    renew = lease_round(snap, jobs)

    def grant(j: JobView) -> bool:
        nonlocal free
        n = counts[j.job_id]
        if n <= 0 or n > free or j.job_id in plan.allocation:
            return False
        plan.allocation[j.job_id] = n
        free -= n
        if not j.running or renew:
            plan.tags[j.job_id] = {LEASE_TAG: end, "rho": rho[j.job_id]}
        return True

    if renew:
        k = math.ceil((1.0 - fairness_knob) * len(jobs))
        for j in worst_first[:k]:  # the partial auction: worst ρ offered first
            grant(j)
        for j in worst_first[k:]:  # leftover: renew running leases first
            if j.running:
                grant(j)
        for j in worst_first[k:]:
            grant(j)
    else:
        for j in jobs:  # leases still valid: nobody is preempted
            if j.running:
                plan.allocation[j.job_id] = j.size
                free -= j.size
        for j in worst_first:
            if not j.running:
                grant(j)
    if any(j.job_id not in plan.allocation for j in jobs):
        plan.wake_at = end


class Themis(Policy):
    """Finish-time fairness with leases (Themis, NSDI'20 §3-4), rigid jobs."""

    def __init__(self, lease: float = 600.0, fairness_knob: float = 0.8) -> None:
        if lease <= 0:
            raise ValueError(f"lease must be > 0 s, got {lease}")
        if not 0.0 <= fairness_knob < 1.0:
            raise ValueError(f"fairness_knob f must be in [0, 1), got {fairness_knob}")
        self.lease = lease
        self.fairness_knob = fairness_knob

    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        themis_allocation(snap, plan, self.lease, self.fairness_knob)
