"""Tidal's own policy: ElasticFlow's deadline guarantees plus Elastic-Tiresias'
responsiveness for best-effort jobs, aware of the measured rescale cost.

1. **Admission** — ElasticFlow's Minimum Satisfactory Share (ASPLOS'23 §4.2,
   Algorithm 1): a job with a deadline is admitted only if it and every
   admitted job still meet their deadlines; best-effort jobs are admitted.
2. **Allocation**, per scheduling event, in two passes of Algorithm 2:
   a. *the split* — every guaranteed job gets its share for this slot, and
      the remaining GPUs go one buddy step at a time to the largest marginal
      return net of rescale cost (Algorithm 2 with the overheads the
      snapshot carries — in the live cluster, the runtime's measured
      pauses), best-effort jobs weighing as in ElasticFlow. A *squeezed*
      guaranteed job — one whose plan admission made in this call ends in
      the last ``tight_slack`` of the time to its deadline — weighs
      ``tight_weight``. This pass fixes how many GPUs each guaranteed job
      gets; the best-effort jobs' part (and what nobody gained from) is
      divided again:
   b. *floors* — best-effort jobs, in least-attained-service order
      (Tiresias' discretised 2D-LAS queues, thresholds 500 and 10,000 GPU·s as
      in EDL §5.1; running jobs first within a queue), each get their smallest
      runnable count from that part while GPUs remain, so a short job starts
      at once instead of waiting behind long ones;
   c. what is left goes through Algorithm 2 again, a best-effort job's return
      weighted by ``2 ** -queue`` so young (likely short) jobs grow first —
      Elastic-Tiresias' expansion, turned towards least attained service.
3. **Placement** — buddy allocation with Best-Fit and defragmenting
   migration (ElasticFlow §4.3).

Why the split comes first: admission (Algorithm 1) re-plans on the admitted
jobs' *remaining* work, so a spare GPU given to a guaranteed job now is slack
that admits a later deadline job; one given to a best-effort job buys none.
With floors taken before Algorithm 2, best-effort jobs took GPUs ElasticFlow
would have spent on deadline jobs, and on the contended study (docs/results.md
§6) admission then declined more deadline jobs than ElasticFlow ("admitting
it would make admitted job X miss", X a job whose plan had become tight). So
a guaranteed job now gets at least what Algorithm 2 gives it, and a squeezed
one — the job a next admission would fail on — gets the spare first, in the
slot its plan was made (weighting every tight plan at every event starved
best-effort jobs: their JCT fell behind ElasticFlow's). Tiresias' LAS
(NSDI'19 §3) then only reorders the best-effort jobs' part, where it
shortens their average JCT without touching any deadline job's GPUs.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_, itemgetter

from tidal.scheduler import kernels
from tidal.scheduler.api import JobView, Plan, Snapshot
from tidal.scheduler.policies.elasticflow import ElasticFlow, _Context
from tidal.scheduler.policies.tiresias import queue_of
from tidal.scheduler.timeline import Levels


_ID = itemgetter(3)
_DEADLINE = attrgetter("spec.deadline")
_BEST_EFFORT = ("best-effort", "late")
_POW = tuple(2.0 ** -q for q in range(8))  # a LAS queue's weight


@dataclass
class _Pass:
    """One scheduling call's state: the squeezed guaranteed jobs, and after
    the split pass its allocation (None during it)."""

    squeezed: frozenset[str]
    split: dict[str, int] | None = None
    queues: dict[str, int] | None = None  # best-effort jobs' LAS queue, found by the floors
    weights: tuple[list[JobView], list[float]] | None = None  # (jobs, their weights), if the floors found them


class Tidal(ElasticFlow):
    """``thresholds``: the LAS queues (GPU·s). ``tight_slack``: a plan made in
    this call that ends within this fraction of the time left to the deadline
    is squeezed; ``tight_weight``: its marginal return's weight in the split."""

    def __init__(self, slot: float = 60.0, thresholds: tuple[float, ...] = (500.0, 10_000.0),
                 tight_slack: float = 0.5, tight_weight: float = 16.0, **kw) -> None:
        super().__init__(slot=slot, **kw)
        self.thresholds = tuple(thresholds)
        self.tight_slack = float(tight_slack)
        self.tight_weight = float(tight_weight)
        self._pass: _Pass | None = None

    def _best_effort(self, job: JobView) -> bool:
        return job.spec.deadline is None or job.tags.get("ef_class") in _BEST_EFFORT

    def _squeezed(self, snap: Snapshot, plan: Plan) -> frozenset[str]:
        """Guaranteed jobs whose plan, made in this call, ends in the last
        ``tight_slack`` of the time to their deadline."""
        out = set()
        pos = None  # built only if a plan is there to check
        for jid, tags in plan.tags.items():
            segs = tags.get("ef_plan")
            if not segs or tags.get("ef_class") != "guaranteed":
                continue
            if pos is None:
                pos = snap.positions
            if jid not in pos:
                continue
            j = snap.view_of[jid]
            if j.spec.deadline is None:
                continue
            ddl = float(j.spec.deadline)
            if ddl - segs[-1][0] < self.tight_slack * max(ddl - snap.now, 1e-9):
                out.add(jid)
        return frozenset(out)

    def allocate(self, snap: Snapshot, plan: Plan, ctx: _Context) -> None:
        """The split (Algorithm 2, squeezed jobs weighted), then floors and
        Algorithm 2 again with the guaranteed jobs' split counts as a base."""
        self._pass = _Pass(self._squeezed(snap, plan))
        try:
            if not all(map(is_, map(_DEADLINE, snap.jobs), repeat(None))):  # a job has a deadline
                split = Plan(admit=plan.admit, drop=plan.drop)
                super().allocate(snap, split, ctx)
                self._pass.split = split.allocation
            else:  # every job is best-effort: the split would give nothing to keep
                self._pass.split = {}
            super().allocate(snap, plan, ctx)
        finally:
            self._pass = None

    def _floors(self, snap: Snapshot, jobs: list[JobView], base: dict[str, int], levels: dict[str, Levels],
                free: int) -> int:
        p = self._pass
        if p is None or p.split is None:
            return free  # the split: ElasticFlow's Algorithm 2
        th, bget, split = self.thresholds, base.get, p.split
        p.queues = queues = {}
        fast = kernels.fast
        if fast is not None and (type(jobs), type(base), type(split), type(levels), type(th)) == (
                list, dict, dict, dict, tuple):
            weights: list[float] = []
            got = fast.las_floors(jobs, base, split, levels, th, queues, free, _BEST_EFFORT, weights)
            if got is not NotImplemented:
                p.weights = (jobs, weights)  # what _weights would find for these jobs
                return got  # the loops below, compiled
        keyed = []
        for j in jobs:  # guaranteed jobs keep their split; best-effort ones in LAS order
            spec = j.spec
            jid = spec.job_id
            tags = j.tags
            if spec.deadline is None or tags.get("ef_class") in _BEST_EFFORT:  # self._best_effort(j), inlined
                q = queues[jid] = bisect_right(th, j.attained - tags.get("tiresias_base", 0.0))  # queue_of
                keyed.append((q, not j.state.holds_gpus, spec.submit_time, jid))
            else:
                n = split.get(jid, 0)
                if n > bget(jid, 0):
                    free -= n - bget(jid, 0)
                    base[jid] = n
        keyed.sort()  # ids are unique: the first four fields decide
        for jid in map(_ID, keyed):
            if bget(jid, 0):
                continue
            counts = levels[jid].count_list  # 0, then ascending positive counts
            smallest = counts[1] if len(counts) > 1 and counts[1] > 0 else next((c for c in counts if c > 0), 0)
            if 0 < smallest <= free:
                base[jid] = smallest
                free -= smallest
        return free

    def _weights(self, snap: Snapshot, jobs: list[JobView]) -> list[float]:
        """:meth:`_weight` of each of ``jobs``, the same numbers, worked out
        together."""
        p = self._pass
        if p is not None and p.split is None:  # the split
            squeezed, tight = p.squeezed, self.tight_weight
            return [tight if j.spec.job_id in squeezed else 1.0 for j in jobs]
        if p is None or p.queues is None:
            return [self._weight(snap, j) for j in jobs]
        if p.weights is not None and p.weights[0] is jobs:
            return list(p.weights[1])
        qget, th, out = p.queues.get, self.thresholds, []
        for j in jobs:
            q = qget(j.spec.job_id)
            if q is None:
                if not self._best_effort(j):
                    out.append(1.0)
                    continue
                q = queue_of(j, th)
            out.append(_POW[q] if q < len(_POW) else 2.0 ** -q)
        return out

    def _weight(self, snap: Snapshot, job: JobView) -> float:
        p = self._pass
        if p is not None and p.split is None:  # the split
            return self.tight_weight if job.job_id in p.squeezed else 1.0
        q = p.queues.get(job.spec.job_id) if p is not None and p.queues is not None else None
        if q is not None:  # a best-effort job the floors saw
            return 2.0 ** -q
        if not self._best_effort(job):
            return 1.0
        return 2.0 ** -(queue_of(job, self.thresholds) if q is None else q)
