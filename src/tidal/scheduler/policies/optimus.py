"""Optimus-style allocation (Peng et al., EuroSys'18, §4-5), at a fixed batch.

Optimus predicts each job's remaining time from a fitted convergence curve
(remaining work) and a fitted throughput model (speed at a given number of
workers), and allocates resources greedily: every job first gets the least
it can run on, then one unit at a time goes to the job whose predicted
completion time drops the most per unit (the marginal gain, §5.1), until
nothing is left or nobody gains. As in the Pollux study's "Optimus+Oracle"
baseline, the predictions here are exact instead of fitted: the remaining
work is the job's remaining progress and the speed its progress rate at the
workload's batch on ``n`` GPUs (:meth:`~tidal.scheduler.api.Snapshot.progress_rate`;
in goodput units for a goodput job). The batch is never changed.

Units are GPUs (data-parallel workers, no parameter servers). Candidate
counts are those of :func:`~tidal.scheduler.policies.pollux.candidate_counts`
(1 .. one node, then whole nodes). Not in the paper: a running job's time at
any count other than its current one includes the executor's restart delay
(``restart_s``), so the greedy does not move a job for less than a restart
costs. Jobs get their first GPU in submission order while GPUs last.
"""

from __future__ import annotations

import math

from tidal.scheduler.api import JobView, Plan, Policy, Snapshot, schedulable
from tidal.scheduler.goodput import phi_bucket
from tidal.scheduler.policies.pollux import candidate_counts, grow

_FAR = 1e15  # seconds standing for "never" (a finite number, so the greedy can compare gains)


class Optimus(Policy):
    """``restart_s``: the restart delay added to a moved job's remaining time."""

    name = "optimus"

    def __init__(self, restart_s: float = 30.0) -> None:
        self.restart_s = float(restart_s)
        self._memo: dict[str, tuple] = {}  # job id -> (spec, key, (counts, rates))

    def _rates(self, snap: Snapshot, j: JobView, gpn: int) -> tuple[list[int], list[float]]:
        """Candidate counts and the progress rate at each at the workload's
        batch; memoised per job while its noise-scale bucket and size stay."""
        spec = j.spec
        total = snap.cluster.num_gpus
        prof = snap.profiles
        owns = getattr(prof, "owns", None)
        gp = prof.goodput if owns is not None and owns(spec) else None  # type: ignore[attr-defined]
        phi = gp.phi(spec.model, j.done, spec.batch_size) if gp is not None else 0.0
        key = (j.size, gpn, total, id(prof), phi_bucket(phi))
        hit = self._memo.get(spec.job_id)
        if hit is not None and hit[0] is spec and hit[1] == key:
            return hit[2]
        if spec.elastic:
            counts = [k for k in candidate_counts(spec.hi(total), gpn, spec.lo) if spec.can_run_at(k)]
            if j.size and j.size not in counts and spec.can_run_at(j.size):
                counts = sorted(set(counts) | {j.size})
        else:
            counts = spec.counts(total)
        if gp is not None:  # a goodput job at its fixed batch, the noise scale looked up once
            rates = [gp.progress_rate(spec.model, gp.nodes_for(k), k, spec.batch_size, phi) for k in counts]
        else:
            rates = [snap.progress_rate(j, k) for k in counts]
        if len(self._memo) > 100_000:
            self._memo.clear()
        self._memo[spec.job_id] = (spec, key, (counts, rates))
        return counts, rates

    def _table(self, snap: Snapshot, j: JobView, gpn: int) -> tuple[list[int], list[float]]:
        """Counts (0 first) and minus the predicted remaining time at each."""
        counts, rates = self._rates(snap, j, gpn)
        left, size, restart = j.remaining, j.size, self.restart_s
        out_c, out_v = [0], [-_FAR]
        best = math.inf
        for k, rate in zip(counts, rates):
            if rate <= 0:
                continue
            t = left / rate + (0.0 if k == size else restart)
            if t < best or k == size:
                out_c.append(k)
                out_v.append(-t)
                best = min(best, t)
        return out_c, out_v

    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        gpn = snap.cluster.max_gpus_per_node
        jobs = schedulable(snap, plan)
        jobs.sort(key=lambda j: (j.spec.submit_time, j.job_id))
        free = snap.cluster.num_gpus
        tables, base = {}, {}
        for j in jobs:
            counts, values = self._table(snap, j, gpn)
            if len(counts) < 2:
                continue
            tables[j.job_id] = (counts, values)
            base[j.job_id] = 0
            if counts[1] <= free:
                base[j.job_id] = counts[1]
                free -= counts[1]
        alloc = grow(tables, base, free, [j.job_id for j in jobs if j.job_id in tables])
        plan.allocation.update({jid: n for jid, n in alloc.items() if n > 0})
