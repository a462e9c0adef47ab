"""Chronus: deadline-aware lease-based scheduling of rigid jobs, solved as a MILP.

Gao et al., "Chronus: A Novel Deadline-aware Scheduler for Deep Learning
Training Jobs", SoCC'21 (system design: SLO jobs with a deadline and
best-effort jobs; GPUs are granted in leases and jobs are re-selected when the
leases expire; an SLO job is admitted only if a schedule exists in which it
and every admitted SLO job still meet their deadlines; the lease-level job
selection is a MILP, solved with Gurobi in the original). Section numbers are
not cited: we could not check them against the paper's text.

As run here (the original solved the MILP with Gurobi; we use
``scipy.optimize.milp`` / HiGHS):

    time ahead is cut into slots: slot 0 = the rest of the current lease, then
    slots of L, L, 2L, 2L, 4L, ... (at most ``max_slots``; the last one ends at
    the latest deadline), so the problem stays small however far deadlines are
    variables, per accepted SLO job j (rigid, g_j GPUs, needs T_j seconds):
        x_j0 ∈ {0,1}  runs in slot 0 (this lease: a gang decision)
        y_jt ∈ [0,1]  share of slot t >= 1 it runs in (the future is re-planned)
        s_j  ∈ {0,1}  meets its deadline
    maximise   Σ s_j + Σ g_j·x_j0 / 2G (+ a small bonus for not preempting)
    subject to Σ_t c_jt·y_jt >= T_j·s_j     c_jt: seconds of slot t before j's deadline
               Σ_j g_j·y_jt <= free GPUs in slot t
    admission: the same problem with s_j = 1 for the accepted jobs and the new
               one; infeasible -> rejected (runs as best-effort, or is dropped)
    lease end: jobs with x_j0 = 1 get a lease; leftover GPUs go to the other SLO
               jobs by least slack, then to best-effort jobs oldest first
    mid-lease: nobody is preempted; freed GPUs go by the same order

``T_j`` is the remaining iterations at the profiled speed on g_j GPUs plus the
restart cost of a job that is not running. With more than ``max_milp_jobs``
(64) SLO jobs the problem is solved as its LP relaxation. No solve is needed when a new job
cannot finish by its deadline even if started now (rejected), or when every
job fits at once and finishes in time (accepted / all run). If HiGHS stops at ``time_limit``
without a solution, allocation falls back to greedy least-slack-first (and the
admission check to "reject"); with the default sizes it solves in milliseconds,
so results do not depend on machine speed in practice (see
docs/policies/baselines.md).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from tidal.scheduler.api import JobView, Plan, Policy, Snapshot, schedulable
from tidal.scheduler.policies.themis import LEASE_TAG, lease_end, lease_round, runnable_count

log = logging.getLogger(__name__)

CLASS_TAG = "chronus"
SLO, UNACCEPTED, BEST_EFFORT = "slo", "unaccepted", "best-effort"


@dataclass(frozen=True)
class SloJob:
    """What the MILP needs to know about one accepted SLO job."""

    job_id: str
    gpus: int
    need_s: float  # seconds of running still needed
    deadline: float
    running: bool


def need_seconds(snap: Snapshot, job: JobView, n: int) -> float:
    """Seconds of running ``job`` still needs on ``n`` GPUs, restart included."""
    rate = snap.throughput(job, n)
    if rate <= 0:
        return math.inf
    t = job.remaining / rate
    if not job.running:
        t += snap.overheads.stop_resume_s if job.executed > 0 else snap.overheads.launch_s
    return t


def slot_bounds(now: float, first_end: float, lease: float, horizon: float, max_slots: int) -> list[float]:
    """Slot boundaries: [now, first_end), then L, L, 2L, 2L, 4L, ...; the last
    slot is stretched to ``horizon`` (the latest deadline)."""
    bounds = [now, first_end]
    k = 0
    while bounds[-1] < horizon and len(bounds) < max_slots + 1:
        bounds.append(bounds[-1] + lease * 2 ** (k // 2))
        k += 1
    bounds[-1] = max(bounds[-1], horizon)
    return bounds


def lease_plan(
    jobs: list[SloJob],
    bounds: list[float],
    capacity0: int,
    capacity: int,
    require_all: bool = False,
    time_limit: float = 5.0,
    locked: set[str] | frozenset[str] = frozenset(),
    max_binary_jobs: int = 64,
) -> tuple[set[str], set[str]] | None:
    """Solve the lease MILP. Returns (jobs to run in slot 0, jobs planned to
    meet their deadline), or None if infeasible (``require_all``) or unsolved.
    ``locked`` jobs hold their GPUs for all of slot 0 (their lease runs on).
    With more than ``max_binary_jobs`` jobs the problem is solved as its LP
    relaxation (x_j0, s_j in [0, 1]; x_j0 > 0.5 means "run now"), which bounds
    the solver's work on crowded clusters: 400 jobs x 16 slots solve in
    ~0.1 s as an LP but ~0.7 s as a MILP."""
    if not jobs:
        return set(), set()
    nj, ns = len(jobs), len(bounds) - 1
    nv = nj * ns + nj  # y[j, t] then s[j]
    lb, ub = np.zeros(nv), np.ones(nv)
    integrality = np.zeros(nv)
    c = np.zeros(nv)
    rows, cols, vals = [], [], []
    for j, job in enumerate(jobs):
        if nj <= max_binary_jobs:
            integrality[j * ns] = 1  # x_j0: a gang decision for this lease
            integrality[nj * ns + j] = 1
        if require_all:
            lb[nj * ns + j] = 1
        if job.job_id in locked:
            lb[j * ns] = 1
        c[nj * ns + j] = -1.0
        c[j * ns] = -job.gpus / (2.0 * max(capacity, 1)) - (0.25 / nj if job.running else 0.0)
        for t in range(ns):
            usable = min(bounds[t + 1], job.deadline) - bounds[t]
            if usable <= 0 or job.gpus > (capacity0 if t == 0 else capacity):
                ub[j * ns + t] = 0
                continue
            rows.append(j)
            cols.append(j * ns + t)
            vals.append(usable)
        rows.append(j)
        cols.append(nj * ns + j)
        vals.append(-job.need_s)
    meet = coo_matrix((vals, (rows, cols)), shape=(nj, nv))
    rows, cols, vals = [], [], []
    for j, job in enumerate(jobs):
        for t in range(ns):
            rows.append(t)
            cols.append(j * ns + t)
            vals.append(job.gpus)
    cap = coo_matrix((vals, (rows, cols)), shape=(ns, nv))
    caps = np.full(ns, float(capacity))
    caps[0] = capacity0
    res = milp(
        c,
        constraints=[LinearConstraint(meet, lb=0.0), LinearConstraint(cap, ub=caps)],
        integrality=integrality,
        bounds=Bounds(lb, ub),
        options={"time_limit": time_limit},
    )
    if res.x is None:
        if res.status != 2:  # 2 = infeasible; anything else: ran out of time or failed
            log.warning("chronus MILP unsolved (%s); %d jobs, %d slots", res.message, nj, ns)
        return None
    x = res.x
    run = {job.job_id for j, job in enumerate(jobs) if x[j * ns] > 0.5}
    met = {job.job_id for j, job in enumerate(jobs) if x[nj * ns + j] > 0.5}
    return run, met


def _trivially_feasible(jobs: list[SloJob], now: float, capacity: int) -> bool:
    """Everything fits at once and each job finishes by its deadline running from now."""
    return sum(j.gpus for j in jobs) <= capacity and all(now + j.need_s <= j.deadline for j in jobs)


class Chronus(Policy):
    """Lease-based deadline-aware rigid scheduling with MILP admission and allocation (SoCC'21)."""

    def __init__(
        self,
        lease: float = 600.0,
        max_slots: int = 16,
        max_milp_jobs: int = 64,
        time_limit: float = 5.0,
        rejected: str = BEST_EFFORT,
    ) -> None:
        if lease <= 0:
            raise ValueError(f"lease must be > 0 s, got {lease}")
        if rejected not in (BEST_EFFORT, "drop"):
            raise ValueError(f"rejected must be 'best-effort' or 'drop', got {rejected!r}")
        self.lease = lease
        self.max_slots = max(2, max_slots)
        self.max_milp_jobs = max_milp_jobs
        self.time_limit = time_limit
        self.rejected = rejected

    # -- helpers ----------------------------------------------------------------
    def _slo_job(self, snap: Snapshot, j: JobView) -> SloJob:
        n = runnable_count(snap, j)
        assert j.spec.deadline is not None
        return SloJob(j.job_id, n, need_seconds(snap, j, n), j.spec.deadline, j.running)

    def _bounds(self, snap: Snapshot, jobs: list[SloJob]) -> list[float]:
        horizon = max((j.deadline for j in jobs), default=snap.now)
        return slot_bounds(snap.now, lease_end(snap.now, self.lease), self.lease, horizon, self.max_slots)

    # -- admission (Chronus: SLO admission control) -------------------------------
    def admission(self, snap: Snapshot, plan: Plan) -> None:
        super().admission(snap, plan)
        G = snap.cluster.num_gpus
        new = sorted(
            (j for j in snap.jobs if j.job_id in plan.admit), key=lambda j: (j.spec.submit_time, j.job_id)
        )
        accepted = [j for j in snap.jobs if j.admitted and j.tags.get(CLASS_TAG) == SLO]
        mid_lease = not lease_round(snap, [j for j in snap.jobs if j.admitted])
        held_be = sum(j.size for j in snap.jobs if j.running and j.tags.get(CLASS_TAG) != SLO) if mid_lease else 0
        slo = [self._slo_job(snap, j) for j in accepted]
        for j in new:
            if runnable_count(snap, j) <= 0:
                plan.admit.discard(j.job_id)
                plan.drop[j.job_id] = f"model {j.spec.model} does not run at its requested count"
                continue
            if j.spec.deadline is None:
                plan.tags[j.job_id] = {CLASS_TAG: BEST_EFFORT}
                continue
            cand = self._slo_job(snap, j)
            ok = snap.now + cand.need_s <= cand.deadline
            if ok and not _trivially_feasible(slo + [cand], snap.now, G - held_be):
                # mid-lease, running jobs keep their GPUs until the lease ends
                ok = self._feasible(snap, slo + [cand], G - held_be, mid_lease)
            if ok:
                slo.append(cand)
                plan.tags[j.job_id] = {CLASS_TAG: SLO}
            elif self.rejected == "drop":
                plan.admit.discard(j.job_id)
                plan.drop[j.job_id] = "deadline cannot be guaranteed (Chronus admission)"
            else:
                plan.tags[j.job_id] = {CLASS_TAG: UNACCEPTED}

    def _feasible(self, snap: Snapshot, jobs: list[SloJob], capacity0: int, lock_running: bool) -> bool:
        locked = {j.job_id for j in jobs if j.running} if lock_running else set()
        bounds = self._bounds(snap, jobs)
        res = lease_plan(
            jobs, bounds, capacity0, snap.cluster.num_gpus, True, self.time_limit, locked, self.max_milp_jobs
        )
        return res is not None

    # -- allocation (Chronus: lease-based job selection) ---------------------------
    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        jobs = schedulable(snap, plan)
        if not jobs:
            return
        G = snap.cluster.num_gpus
        end = lease_end(snap.now, self.lease)
        klass = {
            j.job_id: plan.tags.get(j.job_id, {}).get(CLASS_TAG, j.tags.get(CLASS_TAG, BEST_EFFORT)) for j in jobs
        }
        slo = [j for j in jobs if klass[j.job_id] == SLO]
        slo_info = {j.job_id: self._slo_job(snap, j) for j in slo}
        slack = {jid: s.deadline - snap.now - s.need_s for jid, s in slo_info.items()}
        by_slack = sorted(slo, key=lambda j: (slack[j.job_id], j.spec.submit_time, j.job_id))
        others = sorted(
            (j for j in jobs if klass[j.job_id] != SLO), key=lambda j: (j.spec.submit_time, j.job_id)
        )
        free = G
        renew = lease_round(snap, jobs)

        def grant(j: JobView) -> None:
            nonlocal free
            n = runnable_count(snap, j)
            if j.job_id in plan.allocation or n <= 0 or n > free:
                return
            plan.allocation[j.job_id] = n
            free -= n
            if renew or not j.running:
                plan.tags.setdefault(j.job_id, {})[LEASE_TAG] = end

        if renew:
            infos = [slo_info[j.job_id] for j in by_slack]
            if _trivially_feasible(infos, snap.now, G):
                first = by_slack
            else:
                bounds = self._bounds(snap, infos)
                res = lease_plan(infos, bounds, G, G, False, self.time_limit, max_binary_jobs=self.max_milp_jobs)
                if res is None:  # fallback: greedy least slack first
                    first = by_slack
                else:
                    run, _met = res
                    first = [j for j in by_slack if j.job_id in run]
            for j in first:
                grant(j)
            for j in by_slack:
                grant(j)
            for j in others:  # running best-effort jobs renew before waiting ones
                if j.running:
                    grant(j)
            for j in others:
                grant(j)
        else:
            for j in jobs:
                if j.running:
                    plan.allocation[j.job_id] = j.size
                    free -= j.size
            for j in by_slack + others:
                if not j.running:
                    grant(j)
        if any(j.job_id not in plan.allocation for j in jobs):
            plan.wake_at = end

