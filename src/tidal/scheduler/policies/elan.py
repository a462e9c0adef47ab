"""E-FIFO and E-Backfill, Elan's elastic scheduling policies, with hybrid scaling.

Xie et al., "Elan: Towards Generic and Efficient Elastic Training for Deep
Learning", ICDCS 2020: §VI-C (elastic scheduling) and Algorithm 1 (hybrid
scaling, ``GetTotalBatchSize``). Every job has a range [min_res, max_res].

* **Admission rule.** Jobs are considered in submission order. A job starts if
  its min_res fits in the idle GPUs (GPUs no running job holds), or if adding
  it does not raise the average JCT (:func:`adds_no_jct`): the running jobs
  would be squeezed towards their min_res to make room. E-FIFO stops at the
  first job that may not start (head-of-line blocking). E-Backfill gives that
  head job an EASY reservation (the rule of
  :mod:`tidal.scheduler.policies.backfill`, restated in min_res units because
  ``easy_backfill`` works on rigid counts and idle GPUs only): later jobs that
  pass the admission rule start only if they end before the head's shadow
  time or fit in the GPUs the head will not need then.
* **Allocation rule** (:func:`elan_allocation`). Every started job gets its
  min_res; then, one GPU at a time, the job with the largest marginal gain
  gets one more, until it reaches max_res, a GPU brings no gain, or no GPU is
  left. Started jobs are never preempted.
* **Hybrid scaling** (:func:`total_batch`). When strong scaling at global
  batch B saturates (doubling the GPUs raises throughput by less than
  ``saturation`` = 20 %), the global batch doubles, if the profile measured
  2B and it trains faster; the gain of a GPU is then counted at the batch the
  job would use. Progress is counted in the spec's iterations
  (:meth:`Snapshot.progress_rate`). Per job with ``meta`` ``hybrid=1``, or
  for every elastic job with the policy option ``hybrid=True``.

Ranges: a job's own ``min_gpus`` / ``max_gpus`` / ``allowed_gpus`` when set;
otherwise (trace jobs carry only a requested count P) min_res = ⌈P/2⌉ and
max_res = 2P — our choice, see docs/policies/elan.md. Inelastic jobs run at
their requested count.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass

import numpy as np

from tidal.scheduler.api import JobView, Plan, Policy, Snapshot, schedulable
from tidal.scheduler.elan_cache import ElanCache, JobTable
from tidal.scheduler.elan_order import OrderJob, StepOrder, job_steps, step_arrays
from tidal.scheduler.elan_event import decided, event_pair
from tidal.scheduler.elan_pair import fluid_pair
from tidal.scheduler.estimate import rigid_count

_JOB_ID = operator.attrgetter("spec.job_id")
_SPEC = operator.attrgetter("spec")
_RUNNING = operator.attrgetter("state.holds_gpus")  # JobView.running
_GPUS = operator.attrgetter("gpus")


def hybrid_enabled(job: JobView) -> bool:
    """Per-job opt-in to hybrid scaling: ``meta`` entry ``hybrid`` = 1/true/yes."""
    meta = job.spec.meta
    return bool(meta) and any(k == "hybrid" and v.strip().lower() in ("1", "true", "yes") for k, v in meta)


@dataclass
class Rates:
    """Each job's range, batch and progress rate by count, read from the
    policy's cross-decision tables (:mod:`tidal.scheduler.elan_cache`; a
    private one when none is given)."""

    snap: Snapshot
    hybrid_all: bool = False
    saturation: float = 0.2
    min_factor: float = 0.5
    max_factor: float = 2.0
    cache: ElanCache | None = None
    # the round's jobs: an order asked for some of them is built for all, so that one serves the round
    cover: list[JobView] | None = None
    _order: StepOrder | None = None

    def __post_init__(self) -> None:
        if self.cache is None:
            self.cache = ElanCache()
        self.cache.bind(self.snap.profiles, self.snap.cluster.num_gpus, self.hybrid_all, self.saturation,
                        self.min_factor, self.max_factor)
        self._tables = self.cache.table

    def order(self, jobs: list[JobView], lookahead: int = 8) -> StepOrder:
        """The round's step order (:mod:`tidal.scheduler.elan_order`) over
        ``jobs``; reused while it covers the jobs asked for (it depends only
        on each job's table, fixed for the round)."""
        o = self._order
        if o is None or o.lookahead != lookahead or any(j.job_id not in o.index for j in jobs):
            o = self._build(jobs if self.cover is None else self.cover, lookahead)
            if any(j.job_id not in o.index for j in jobs):
                o = self._build(jobs, lookahead)
        return o

    def _build(self, jobs: list[JobView], lookahead: int) -> StepOrder:
        """:meth:`order`'s step order over ``jobs``, built (or the last
        decision's, when it was over the same tables, with the jobs' progress)."""
        ojs, parts, tables = [], [], []
        for j in jobs:
            t = self._table(j)
            tables.append(t)
            ojs.append(OrderJob(j.job_id, j.spec.submit_time, t.ctup, t.rates, t.one, j.remaining,
                                j.running, j.size))
            src = t.shape  # jobs of one shape have the same steps
            part = src.steps.get(lookahead)
            parts.append(self._steps(ojs[-1], src, lookahead) if part is None else part)
        last = self.cache.last_order  # type: ignore[union-attr]
        if last is not None and last[0] == lookahead and len(last[1]) == len(tables) and all(
                map(operator.is_, last[1], tables)):
            o = self._order = last[2].with_jobs(ojs)  # the same jobs as the last order: its static part
        else:
            o = self._order = StepOrder(ojs, lookahead, parts=parts)
            self.cache.last_order = (lookahead, tables, o)  # type: ignore[union-attr]
        return o

    @staticmethod
    def _steps(oj: OrderJob, src: JobTable, lookahead: int) -> np.ndarray:
        """The uncapped steps of ``src``'s shape (:func:`step_arrays`), and
        the count after the last of them, computed and kept in ``src``."""
        part = src.steps[lookahead] = step_arrays(job_steps(oj, lookahead))
        src.tops[lookahead] = src.ctup[int(part[-1, 1])] if len(part) else src.ctup[0]
        return part

    def tops(self, jobs: list[JobView], lookahead: int = 8, tables: list[JobTable] | None = None,
             limit: float = math.inf) -> list[int] | None:
        """Each job's count after its last uncapped step: what the allocation
        rule gives it when GPUs are plenty (:func:`plenty_allocation`);
        ``None`` as soon as their sum exceeds ``limit``. ``tables``: the
        jobs' (:meth:`tables_of`), when the caller has them."""
        out, acc = [], 0
        for j, t in zip(jobs, self.tables_of(jobs) if tables is None else tables):
            src = t.shape
            top = src.tops.get(lookahead)
            if top is None:
                self._steps(OrderJob(j.job_id, j.spec.submit_time, t.ctup, t.rates, t.one, 0.0, False, 0), src,
                            lookahead)
                top = src.tops[lookahead]
            acc += top
            if acc > limit:
                return None
            out.append(top)
        return out

    def tables_of(self, jobs: list[JobView]) -> list[JobTable]:
        """The jobs' tables, filled."""
        out = self.cache.tables(map(_SPEC, jobs))  # type: ignore[union-attr]
        for i, t in enumerate(out):
            if t.rates is None:
                out[i] = self._table(jobs[i])
        return out

    def _table(self, job: JobView) -> JobTable:
        t = self._tables(job.spec)
        if t.rates is None:
            spec = job.spec
            key = (spec.model, spec.batch_size, spec.requested_gpus, spec.elastic, spec.min_gpus, spec.max_gpus,
                   spec.allowed_gpus, self.hybrid(job))
            src = self.cache.shapes.get(key)  # type: ignore[union-attr]
            if src is not None and src.rates is not None:
                t.counts, t.ctup, t.one, t.rates, t.rate_at, t.shape = (src.counts, src.ctup, src.one, src.rates,
                                                                        src.rate_at, src)
                t.hybrid = src.hybrid
                return t
            t.hybrid = key[-1]
            t.counts = self._counts(job, t)
            t.ctup = tuple(t.counts)
            t.one = self.snap.throughput(job, 1) or 1.0
            t.rates = tuple(self._lookup(job, c, t)[0] for c in t.counts)
            self.cache.shapes[key] = t  # type: ignore[union-attr]
        return t

    def _counts(self, job: JobView, t: JobTable) -> list[int]:
        spec, cap = job.spec, self.snap.cluster.num_gpus
        if not spec.elastic:
            return [rigid_count(spec, cap)]
        explicit = spec.min_gpus is not None or spec.max_gpus is not None or spec.allowed_gpus is not None
        p = max(1, spec.requested_gpus)
        top = spec.hi(cap)
        lo = spec.lo if explicit else min(top, max(spec.lo, math.ceil(p * self.min_factor)))
        hi = top if explicit else min(top, max(lo, int(p * self.max_factor)))
        hit = [c for c in self._fill(job, t, [c for c in spec.counts(hi) if c >= lo]) if t.rate_at[c][0] > 0]
        if not hit:  # the range holds no count that runs: the smallest one that does
            hit = [c for c in spec.counts(cap) if self._lookup(job, c, t)[0] > 0][:1] or [spec.lo]
        return hit

    def _fill(self, job: JobView, t: JobTable, counts: list[int]) -> list[int]:
        """:meth:`_lookup` for each of ``counts`` (the job's hybrid choice
        read once); returns ``counts``."""
        if self.hybrid(job):
            for c in counts:
                self._lookup(job, c, t)
            return counts
        rate_at, b, rate = t.rate_at, job.spec.batch_size, self.snap.progress_rate
        for c in counts:
            if c not in rate_at:
                rate_at[c] = (rate(job, c, b), b)
        return counts

    def counts(self, job: JobView) -> list[int]:
        """The counts a job may run at within [min_res, max_res], ascending."""
        return self._table(job).counts  # type: ignore[return-value]

    def hybrid(self, job: JobView) -> bool:
        return job.spec.elastic and (self.hybrid_all or hybrid_enabled(job))

    def batch(self, job: JobView, n: int) -> int:
        return self._lookup(job, n, self._tables(job.spec))[1]

    def rate(self, job: JobView, n: int) -> float:
        """Progress in spec iterations/s on ``n`` GPUs at the batch the job would use."""
        return self._lookup(job, n, self._tables(job.spec))[0]

    def one(self, job: JobView) -> float:
        return self._table(job).one  # type: ignore[return-value]

    def table(self, job: JobView) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """The job's counts and the progress rate at each (kept across
        decisions: the allocation rule runs many times per round inside the
        fluid estimate)."""
        t = self._table(job)
        return t.ctup, t.rates  # type: ignore[return-value]

    def _lookup(self, job: JobView, n: int, t: JobTable) -> tuple[float, int]:
        hit = t.rate_at.get(n)
        if hit is None:
            b = total_batch(self.snap, job, n, self.saturation) if self.hybrid(job) else job.spec.batch_size
            hit = t.rate_at[n] = (self.snap.progress_rate(job, n, b), b)
        return hit


def total_batch(snap: Snapshot, job: JobView, n: int, saturation: float = 0.2) -> int:
    """Elan Algorithm 1, ``GetTotalBatchSize``: start from the submitted global
    batch B; while strong scaling at B has saturated at ``n`` GPUs
    (S_B(n) < (1 + saturation) · S_B(n/2)) and the profile measured 2B and 2B
    progresses faster, double B."""
    spec = job.spec
    measured = set(snap.profiles.batch_sizes(spec.model))
    b = spec.batch_size
    while n >= 2 and 2 * b in measured:
        tp = snap.profiles.throughput
        if tp(spec.model, b, n) >= (1 + saturation) * tp(spec.model, b, n / 2):
            break  # strong scaling still pays
        if snap.progress_rate(job, n, 2 * b) <= snap.progress_rate(job, n, b):
            break
        b *= 2
    return b


def elan_allocation(rates: Rates, jobs: list[JobView], total: int, lookahead: int = 8) -> dict[str, int]:
    """Allocation rule: min_res to each job, then one GPU at a time to the job
    with the largest marginal gain (progress rate gained, over the job's
    one-GPU rate) until max_res, no gain, or no GPU. Where a job's curve is
    flat before hybrid scaling pays, the step spans to the next count that
    gains (at most ``lookahead`` GPUs): on concave curves it is one GPU. Ties
    go to the earlier submission, then the smaller job id. Evaluated on the
    round's step order (:class:`~tidal.scheduler.elan_order.StepOrder`)
    unless GPUs are plenty (:func:`plenty_allocation`)."""
    alloc = plenty_allocation(rates, jobs, total, lookahead)
    return rule_allocation(rates, jobs, total, lookahead) if alloc is None else alloc


def rule_allocation(rates: Rates, jobs: list[JobView], total: int, lookahead: int = 8) -> dict[str, int]:
    """:func:`elan_allocation` on the round's step order."""
    order = rates.order(jobs, lookahead)
    xs = [order.index[j.job_id] for j in jobs]
    pos = order.allocation(xs, total)
    return {j.job_id: order.counts[x][pos[x]] for j, x in zip(jobs, xs)}


def plenty_allocation(rates: Rates, jobs: list[JobView], total: int, lookahead: int = 8,
                      tables: list[JobTable] | None = None) -> dict[str, int] | None:
    """The allocation rule's result when GPUs are plenty, without the step
    order: if every job's count after its last uncapped step (:meth:`Rates.tops`)
    fits together in ``total``, each job gets that count. Every step of the
    order then fits: the prefix takes them while ``lookahead`` GPUs are free,
    the tail the rest in order (:meth:`~tidal.scheduler.elan_order.StepOrder.tail`),
    and no job has a step beyond. ``None`` otherwise. ``tables``: the jobs'
    (:meth:`Rates.tables_of`), when the caller has them."""
    tops = rates.tops(jobs, lookahead, tables, limit=total)
    return None if tops is None else dict(zip(map(_JOB_ID, jobs), tops))


def _finish_times(rates: Rates, jobs: list[JobView], alloc: dict[str, int], shrink_cost: float) -> dict[str, float]:
    """Seconds until each job ends at a fixed allocation; a running job whose
    count changes pays ``shrink_cost``."""
    out = {}
    for j in jobs:
        n = alloc[j.job_id]
        r = rates.rate(j, n)
        t = j.remaining / r if r > 0 else math.inf
        if j.running and n != j.size:
            t += shrink_cost
        out[j.job_id] = t
    return out


def adds_no_jct(rates: Rates, active: list[JobView], w: JobView, total: int,
                known: tuple[StepOrder, list[int], int] | None = None) -> bool:
    """Elan's admission test: does starting ``w`` now (squeezing the others
    towards their min_res) keep the average JCT of ``active`` + ``w`` at or
    below letting ``w`` wait? Both are estimated by a fluid run of the
    allocation rule (re-applied at each completion); waiting, ``w`` joins at
    the first completion that leaves room for its min_res. ``known``: the
    round's step order covering them, ``active``'s indexes in it and the sum
    of their min_res (the caller keeps them).

    The two estimates are first made event-driven
    (:func:`~tidal.scheduler.elan_event.event_pair`, several times faster;
    its sums differ from the exact loop's only by rounding); where they are
    within :data:`~tidal.scheduler.elan_event.MARGIN` of the bound, or the
    rule needs steps that event-driven run does not follow, the exact paired
    estimate (:func:`~tidal.scheduler.elan_pair.fluid_pair`) decides."""
    lo = rates.counts(w)[0]
    if known is None:
        order = rates.order(active + [w])
        known = (order, [order.index[j.job_id] for j in active], sum(rates.counts(j)[0] for j in active))
    order, xs, lows = known
    if lows + lo > total:
        return False
    ov = rates.snap.overheads
    cost = ov.stop_resume_s if ov.mode == "stop-resume" else ov.pause_s
    x = order.index[w.job_id]
    return _admits(order, xs, x, total, cost)


def _admits(order: StepOrder, xs: list[int], x: int, total: int, cost: float) -> bool:
    """:func:`adds_no_jct` on the step order: the event-driven estimate
    where it decides by a margin, else the exact paired one."""
    if order.positive and not order.capped_seen:  # the event-driven estimate, trusted where it decides by a margin
        sums = event_pair(order, xs, x, total, cost)
        order.capped_seen = sums is None
        verdict = None if sums is None else decided(*sums)
        if verdict is not None:
            return verdict
    with_w, without = fluid_pair(order, xs, x, total, cost)
    return with_w <= without * (1 + 1e-9)


def elastic_admission(
    rates: Rates, snap: Snapshot, plan: Plan, backfill: bool
) -> list[JobView]:
    """E-FIFO's admission, or E-Backfill's with an EASY reservation for the
    blocked head job. Returns the jobs to run (running ones first)."""
    total = snap.cluster.num_gpus
    jobs = rates.cover = schedulable(snap, plan)
    running = list(map(_RUNNING, jobs))
    active = list(itertools.compress(jobs, running))
    queue = sorted(itertools.compress(jobs, map(operator.not_, running)), key=lambda j: (j.spec.submit_time, j.job_id))
    idle = total - sum(map(len, map(_GPUS, active)))
    # from the first job that does not fit the idle GPUs: the sum of active's min_res; from the
    # first admission test: one step order for all of the round's jobs and active's indexes in it
    known: dict = {}

    def admissible(w: JobView) -> bool:
        lo = rates.counts(w)[0]
        if lo <= idle:
            return True
        if "lows" not in known:
            known["lows"] = sum(rates.counts(j)[0] for j in active)
        if known["lows"] + lo > total:
            return False  # adds_no_jct's answer, without the order
        if "order" not in known:
            order = known["order"] = rates.order(jobs)
            known["xs"] = [order.index[j.job_id] for j in active]
        return adds_no_jct(rates, active, w, total, (known["order"], known["xs"], known["lows"]))

    def start(w: JobView) -> int:
        active.append(w)
        lo = rates.counts(w)[0]
        if "lows" in known:
            known["lows"] += lo
        if "order" in known:
            known["xs"].append(known["order"].index[w.job_id])
        return max(0, idle - lo)

    head = None
    for i, w in enumerate(queue):
        if not admissible(w):
            head = i
            break
        idle = start(w)
    if head is None or not backfill:
        return active
    shadow, extra = _reservation(rates, active, rates.counts(queue[head])[0], idle, total)
    for w in queue[head + 1:]:
        lo = rates.counts(w)[0]
        r = rates.rate(w, lo)
        ends_before = r > 0 and w.remaining / r <= shadow
        if not (ends_before or lo <= extra) or not admissible(w):
            continue
        if not ends_before:
            extra -= lo
        idle = start(w)
    return active


def _reservation(rates: Rates, active: list[JobView], need: int, idle: int, total: int) -> tuple[float, int]:
    """EASY's reservation of the head job's min_res ``need`` (backfill.py's
    rule): the shadow time (s from now) when the running jobs' completions
    at the rule's allocation free enough GPUs, and the GPUs beyond ``need``
    free then."""
    alloc = elan_allocation(rates, active, total)
    ends = sorted((t, alloc[jid]) for jid, t in _finish_times(rates, active, alloc, 0.0).items())
    avail = idle
    for t, n in ends:
        avail += n
        if avail >= need:
            return t, avail - need
    return math.inf, 0


class _Elan(Policy):
    backfill = False

    def __init__(
        self,
        hybrid: bool = False,
        saturation: float = 0.2,
        min_factor: float = 0.5,
        max_factor: float = 2.0,
    ) -> None:
        self.hybrid = hybrid
        self.saturation = saturation
        self.min_factor = min_factor
        self.max_factor = max_factor
        self._cache = ElanCache()  # per-job tables kept across decisions (never changes one)
        self._plenty: Plan | None = None  # the last plan, if plenty_allocation made its allocation

    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        rates = Rates(snap, self.hybrid, self.saturation, self.min_factor, self.max_factor, self._cache)
        active = elastic_admission(rates, snap, plan, self.backfill)
        total = snap.cluster.num_gpus
        tables = rates.tables_of(active)
        alloc = plenty_allocation(rates, active, total, tables=tables)
        self._plenty = plan if alloc is not None else None
        if alloc is None:
            alloc = rule_allocation(rates, active, total)
        plan.allocation.update(alloc)
        for j, t in zip(active, tables):
            spec = j.spec
            if t.hybrid:
                b = rates.batch(j, alloc[spec.job_id])
            elif not j.batch:
                continue  # the spec's batch at every count, and now
            else:
                b = spec.batch_size
            if b != (j.batch or spec.batch_size):
                plan.batch[spec.job_id] = b

    def settled(self, snap: Snapshot, plan: Plan) -> bool:
        """Every job runs, at its batch and at the count after its last
        uncapped step, all of them fitting (:func:`plenty_allocation`): with
        only completions since, the remaining jobs' counts fit too, so no job
        waits and none changes its count (the simulator skips those rounds)."""
        alloc = plan.allocation
        return (self._plenty is plan and not plan.batch and len(alloc) + len(plan.drop) == len(snap.jobs)
                and all(alloc.values()))


class EFIFO(_Elan):
    """Elan §VI-C E-FIFO: FIFO admission by the Elan rule, elastic allocation."""


class EBackfill(_Elan):
    """Elan §VI-C E-Backfill: E-FIFO's allocation with EASY backfill's admission."""

    backfill = True
