"""ElasticFlow: deadline-guaranteed elastic scheduling of serverless DL jobs.

Gu et al., "ElasticFlow: An Elastic Serverless Training Platform for
Distributed Deep Learning", ASPLOS'23, §4:

- **Serverless jobs** (§4.1): a job gives its model, global batch, iterations
  and deadline; the GPU count is the scheduler's (a trace job's requested
  count is ignored). Each worker trains ``global batch / GPUs`` samples per
  step; the throughput profile is indexed by the global batch.
- **Admission control by Minimum Satisfactory Share** (§4.2, Algorithm 1):
  time is cut into slots; jobs are planned in deadline order on the future
  free-GPU timeline by *progressive filling*: for a cap ``i`` in the buddy
  sizes (powers of two among the profiled counts), the job gets
  ``min(i, free(t))`` (rounded down to a buddy size) in every slot from now
  on; its share is the smallest ``i`` with which it ends by its deadline.
  A new job is admitted only if it and every already-admitted job still get
  a satisfactory share; otherwise it is dropped with the reason. The
  timeline arithmetic is in :mod:`tidal.scheduler.timeline`.
- **Resource allocation** (§4.2, Algorithm 2): each job first gets its
  share for the current slot; the remaining GPUs go one step at a time, via
  a priority queue, to the job with the highest marginal return (extra
  normalised throughput per extra GPU), until no GPU is left or nobody gains.
- **Best-effort jobs and soft deadlines** (§4.4): a job without a deadline
  is admitted without a guarantee and competes for leftover GPUs in
  Algorithm 2; a job with a soft deadline (``soft_deadlines=True``, or
  ``("soft_deadline", "1")`` in its ``JobSpec.meta``) that cannot be
  guaranteed is admitted as best-effort instead of dropped.
- **Placement** (§4.3): buddy allocation with Best-Fit on the topology tree
  and migration to defragment (:mod:`tidal.scheduler.buddy`); extra GPUs
  from Algorithm 2 fall back to smaller counts rather than cause a
  migration, and defragmentation moves best-effort jobs and jobs with slack
  first.

Guarantees and overheads (details in docs/policies/elasticflow.md): each
admitted job's plan (GPUs per future interval) is stored in ``Plan.tags``
(``ef_plan``) and kept while it still delivers the job's remaining work by
its deadline; only jobs that fall behind are re-planned (on what the others
leave, or everyone from scratch in deadline order). A new job that does not
fit in what the others leave triggers Algorithm 1 from scratch. Every change
of count in a plan (and from what the job holds now) costs the progress the
:class:`OverheadModel` says it loses; a share must also cover
``reserve_rescales`` migrations' worth of extra work; GPUs are released at
the slot boundary after a job ends; a rescale still in progress is
remembered (``ef_busy_until``). Algorithm 2 only grows a job if the gain
over one slot beats the cost of growing and of shrinking back. Other tags:
``ef_class`` (``guaranteed``, ``best-effort``, ``late``) and ``ef_share``
(the share's cap).

Speed: the policy memoises, across calls, each job's levels and Algorithm
2's step tables (:mod:`tidal.scheduler.greedy`) by what they depend on; a
cache only, the decisions are those computed afresh.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import is_not, ne
from typing import Any

import numpy as np

from tidal.core.job import JobState
from tidal.core.overhead import OverheadModel
from tidal.scheduler.api import FrozenDict, JobView, Plan, Policy, Snapshot, schedulable
from tidal.scheduler.buddy import place_buddy
from tidal.scheduler.estimate import rigid_count
from tidal.scheduler import kernels
from tidal.scheduler.greedy import Steps, build_steps, greedy
from tidal.scheduler.timeline import (
    EPS,
    Costs,
    Levels,
    Segments,
    Share,
    Timeline,
    commit_segments,
    count_at,
    deliverable,
    fill,
    first_loss,
    reserve_all,
    take_share,
)


def job_levels(snap: Snapshot, job: JobView, cache: dict | None = None) -> Levels:
    """Powers of two among the profiled counts that fit the cluster, kept
    only while they raise throughput (never more GPUs than help); a rigid job
    has its one count. ``cache`` memoises by what the result depends on."""
    spec = job.spec
    cap = snap.cluster.num_gpus
    batch = job.batch or spec.batch_size
    key = (spec.model, batch, spec.batch_size, spec.elastic, spec.min_gpus, spec.max_gpus, spec.allowed_gpus,
           None if spec.elastic else spec.requested_gpus)
    if cache is not None and key in cache:
        return cache[key]
    if not spec.elastic:
        n = rigid_count(spec, cap)
        counts = [n] if n <= cap else []
    else:
        profiled = set(snap.profiles.profiled_counts(spec.model, batch))
        counts = [c for c in spec.counts(cap) if c in profiled and c & (c - 1) == 0]
    cs, rs = [0], [0.0]
    for c in counts:
        r = snap.progress_rate(job, c, batch)
        if c & (c - 1):  # not one buddy block: its pieces may span nodes
            r *= snap.profiles.cross_node_penalty
        if r > rs[-1] * (1 + 1e-9):
            cs.append(c)
            rs.append(r)
    lv = Levels(np.array(cs, dtype=np.int64), np.array(rs, dtype=float), tuple(cs), tuple(rs))
    if cache is not None:
        cache[key] = lv
    return lv


def is_soft(job: JobView, all_soft: bool) -> bool:
    return all_soft or any(k == "soft_deadline" and v not in ("", "0", "false") for k, v in job.spec.meta)


def slot_progress(snap: Snapshot, j: JobView, lv: Levels, costs: Costs, hold: float, share: int | None) -> list[float]:
    """Iterations over one slot (``hold`` seconds) at each of ``lv``'s levels,
    net of the cost of getting there from what the job holds and, for a
    guaranteed job (``share`` given), of shrinking back to its share."""
    n = len(j.gpus)
    r_old = (lv.rate_of(n) or snap.progress_rate(j, n, j.batch or None)) if n else 0.0
    started = j.executed > 0
    out = []
    for c, r in zip(lv.count_list, lv.rate_list):
        if c == 0:
            out.append(0.0)
            continue
        lost = first_loss(c, r, n, r_old, started, costs)
        if share is not None and c != share:
            lost += r * costs.shrink
        out.append(max(r * hold - lost, 0.0))
    return out


@dataclass
class _Book:
    """Guaranteed jobs' plans, reserved on the free-GPU timeline; ``caps``
    has the share cap of every job re-planned in this round."""

    tl: Timeline
    plans: dict[str, Segments] = field(default_factory=dict)
    caps: dict[str, int] = field(default_factory=dict)

    def take(self, jid: str, share: Share) -> None:
        self.plans[jid] = take_share(self.tl, share)
        self.caps[jid] = share.cap

    def adopt(self, tl: Timeline, trial: dict[str, tuple[Segments, int]]) -> None:
        """Replace the timeline by a from-scratch re-plan's."""
        self.tl = tl
        for jid, (segs, cap) in trial.items():
            self.plans[jid], self.caps[jid] = segs, cap


class ElasticFlow(Policy):
    """ElasticFlow (ASPLOS'23 §4): MSS admission, greedy marginal-return
    allocation, buddy placement.

    ``slot``: planning slot (s), the simulator's ``--slot``. ``assumed_overheads``:
    plan with these overheads instead of the snapshot's (to test what an
    untold overhead does). ``reserve_rescales``: migrations' worth of extra
    work every share must cover (slack). ``soft_deadlines``: never drop, admit
    the unsatisfiable as best-effort."""

    def __init__(
        self,
        slot: float = 60.0,
        assumed_overheads: OverheadModel | None = None,
        reserve_rescales: float = 1.0,
        soft_deadlines: bool = False,
    ) -> None:
        self.slot = float(slot)
        self.assumed_overheads = assumed_overheads
        self.reserve_rescales = float(reserve_rescales)
        self.soft_deadlines = soft_deadlines

    # -- helpers ------------------------------------------------------------
    def _costs(self, snap: Snapshot) -> Costs:
        return Costs.of(self.assumed_overheads or snap.overheads)

    @staticmethod
    def _order(j: JobView) -> tuple:
        return (j.spec.deadline, j.spec.submit_time, j.job_id)

    def _share(
        self, snap: Snapshot, tl: Timeline, j: JobView, lv: Levels, costs: Costs, slack: bool = True
    ) -> Share | None:
        """Minimum satisfactory share; ``slack=False`` drops the migration
        slack (for an admitted job that fell behind: better a share without
        slack than none)."""
        horizon = float(j.spec.deadline)
        if horizon <= snap.now or j.remaining <= 0:
            return None
        margin = self.reserve_rescales * costs.migrate if slack else 0.0
        return fill(tl, lv, j.remaining, horizon, j.size, j.executed > 0, costs, dead_time(snap, j, costs), margin)

    def _on_track(
        self, snap: Snapshot, j: JobView, segs: Segments, lv: Levels, costs: Costs, slack: float = 0.0
    ) -> bool:
        """Does the stored plan still deliver the remaining work (plus ``slack``
        seconds of work at its current rate) by the deadline?"""
        return plan_delivers(snap, j, segs, lv, costs) >= plan_needs(snap, j, segs, lv, (slack,))[0]

    # -- the three steps ------------------------------------------------------
    def schedule(self, snap: Snapshot) -> Plan:
        plan = Plan()
        ctx = self.admit(snap, plan)
        self.allocate(snap, plan, ctx)
        place_shares_first(snap, plan, ctx)
        record_rescales(snap, plan, ctx.costs)
        return plan

    def admission(self, snap: Snapshot, plan: Plan) -> None:
        self.admit(snap, plan)

    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        self.allocate(snap, plan, self.admit(snap, Plan()))

    def placement(self, snap: Snapshot, plan: Plan) -> None:
        plan.placement = place_buddy(snap, plan.allocation)

    def _replan(
        self, snap: Snapshot, jobs: list[JobView], levels: dict[str, Levels], costs: Costs, lenient: bool = False
    ) -> tuple[Timeline, dict[str, tuple[Segments, int]], JobView | None]:
        """Algorithm 1 from scratch: shares in deadline order on an empty
        timeline; stops at the first job that gets none (returned).
        ``lenient``: a job may get a share without migration slack."""
        tl = Timeline(snap.now, snap.cluster.num_gpus, self.slot)
        out: dict[str, tuple[Segments, int]] = {}
        for j in sorted(jobs, key=self._order):
            share = self._share(snap, tl, j, levels[j.job_id], costs)
            if share is None and lenient:
                share = self._share(snap, tl, j, levels[j.job_id], costs, slack=False)
            if share is None:
                return tl, out, j
            out[j.job_id] = (take_share(tl, share), share.cap)
        return tl, out, None

    # -- Algorithm 1: admission control by minimum satisfactory share --------
    def admit(self, snap: Snapshot, plan: Plan) -> "_Context":
        """Guaranteed jobs keep their stored plans while those still deliver
        their remaining work by the deadline (others are re-filled on what is
        left). A new deadline job is admitted if it fits in what the
        guaranteed jobs leave; otherwise all of them and it are re-planned
        from scratch in deadline order (Algorithm 1) and it is admitted only
        if every one still gets a satisfactory share."""
        costs = self._costs(snap)
        levels, guaranteed, new_ddl = self._classify(snap, plan, self._memo_for(snap, costs))
        book, thin, refill = self._keep_plans(snap, guaranteed, levels, costs)
        self._refill(snap, plan, book, guaranteed, refill, levels, costs)
        guaranteed = [j for j in guaranteed if j.job_id in book.plans]
        for x in sorted(new_ddl, key=self._order):
            guaranteed = self._admit_new(snap, plan, x, guaranteed, book, thin, levels, costs)
        for jid, cap in book.caps.items():
            plan.tags[jid] = {"ef_class": "guaranteed", "ef_plan": book.plans[jid], "ef_share": cap}
        shares_now = {jid: count_at(segs, snap.now) for jid, segs in book.plans.items()}
        still_thin = {j.job_id for j in thin if j.job_id not in book.caps or j.state is JobState.SUBMITTED}
        return _Context(levels, shares_now, costs, book.tl, still_thin)

    def _classify(
        self, snap: Snapshot, plan: Plan, memo: "_Memo"
    ) -> tuple[dict[str, Levels], list[JobView], list[JobView]]:
        """Every job's levels; admit best-effort and drop unrunnable new jobs;
        return the guaranteed jobs (deadline order) and the new deadline jobs."""
        total = snap.cluster.num_gpus
        levels = memo.levels_of(snap)
        guaranteed: list[JobView] = []
        new_ddl: list[JobView] = []
        for j in snap.submitted:  # in snapshot order
            lv = levels[j.job_id]
            if len(lv.counts) < 2:
                plan.drop[j.job_id] = f"model {j.spec.model} cannot run on this cluster ({total} GPUs)"
            elif j.spec.deadline is None:
                plan.admit.add(j.job_id)
                plan.tags[j.job_id] = {"ef_class": "best-effort"}
            else:
                new_ddl.append(j)
        submitted = JobState.SUBMITTED
        for j in snap.jobs:
            if (j.spec.deadline is not None and j.admitted and j.state is not submitted
                    and j.tags.get("ef_class", "guaranteed") == "guaranteed"):
                guaranteed.append(j)
        guaranteed.sort(key=self._order)
        return levels, guaranteed, new_ddl

    def _keep_plans(
        self, snap: Snapshot, guaranteed: list[JobView], levels: dict[str, Levels], costs: Costs
    ) -> tuple["_Book", list[JobView], list[JobView]]:
        """Reserve the stored plans that are still on track; a plan on track
        without slack for a migration left ("thin") gets a new share on what
        the others leave if one exists. Returns the book, the thin jobs and
        the jobs to re-fill (deadline order)."""
        book = _Book(Timeline(snap.now, snap.cluster.num_gpus, self.slot))
        refill: list[JobView] = []
        kept: list[JobView] = []
        thin: list[JobView] = []
        margin = self.reserve_rescales * costs.migrate
        worst = costs.worst_change
        for j in guaranteed:  # on track (see _on_track), and without slack for a migration left (thin)?
            segs = j.tags.get("ef_plan")
            if segs:
                got, need, need_slack = plan_check(snap, j, segs, levels[j.job_id], costs, margin, worst)
                if got >= need:
                    kept.append(j)
                    book.plans[j.job_id] = segs
                    if margin > 0 and not got >= need_slack:
                        thin.append(j)
                    continue
            refill.append(j)
        if not reserve_all(book.tl, [book.plans[j.job_id] for j in kept]):
            # stored plans collide (should not happen): keep them one by one
            book.tl = Timeline(snap.now, snap.cluster.num_gpus, self.slot)
            for j in kept:
                if not commit_segments(book.tl, book.plans[j.job_id]):
                    del book.plans[j.job_id]
                    refill.append(j)
            refill.sort(key=self._order)
        for j in thin:
            if j.job_id not in book.plans or not commit_segments(book.tl, book.plans[j.job_id], sign=-1):
                continue
            share = self._share(snap, book.tl, j, levels[j.job_id], costs)
            if share is None:
                commit_segments(book.tl, book.plans[j.job_id])
            else:
                book.take(j.job_id, share)
        return book, thin, refill

    def _refill(
        self, snap: Snapshot, plan: Plan, book: "_Book", guaranteed: list[JobView], refill: list[JobView],
        levels: dict[str, Levels], costs: Costs,
    ) -> None:
        """New shares for guaranteed jobs that fell behind, on what the others
        leave; if one gets none, every guaranteed job is re-planned from
        scratch (Algorithm 1 order), and failing that it is marked late."""
        late: set[str] = set()
        for j in refill:
            share = self._share(snap, book.tl, j, levels[j.job_id], costs)
            if share is None:
                share = self._share(snap, book.tl, j, levels[j.job_id], costs, slack=False)
            if share is not None:
                book.take(j.job_id, share)
                continue
            keep = [g for g in guaranteed if g.job_id not in late]
            trial_tl, trial, failed = self._replan(snap, keep, levels, costs, lenient=True)
            if failed is None:
                book.adopt(trial_tl, trial)
                break
            plan.tags[j.job_id] = {"ef_class": "late", "ef_plan": ()}
            late.add(j.job_id)

    def _admit_new(
        self, snap: Snapshot, plan: Plan, x: JobView, guaranteed: list[JobView], book: "_Book",
        thin: list[JobView], levels: dict[str, Levels], costs: Costs,
    ) -> list[JobView]:
        """Admit, admit as best-effort or drop the new deadline job ``x``;
        return the guaranteed jobs afterwards."""
        share = self._share(snap, book.tl, x, levels[x.job_id], costs)
        if share is not None:  # fits in what the guaranteed jobs leave
            book.take(x.job_id, share)
            plan.admit.add(x.job_id)
            return [*guaranteed, x]
        order = sorted([*guaranteed, x], key=self._order)
        trial_tl, trial, failed = self._replan(snap, order, levels, costs)
        if failed is x:
            # its deadline leaves no room for the migration slack: admit
            # it on what the others leave, placed as a job that must not move
            share = self._share(snap, book.tl, x, levels[x.job_id], costs, slack=False)
            if share is not None:
                book.take(x.job_id, share)
                plan.admit.add(x.job_id)
                thin.append(x)
                return [*guaranteed, x]
        if failed is None:
            book.adopt(trial_tl, trial)
            plan.admit.add(x.job_id)
            return order
        if is_soft(x, self.soft_deadlines):
            plan.admit.add(x.job_id)
            plan.tags[x.job_id] = {"ef_class": "best-effort"}
        elif failed is x:
            alone = self._share(snap, Timeline(snap.now, snap.cluster.num_gpus, self.slot), x, levels[x.job_id], costs)
            plan.drop[x.job_id] = (
                "cannot meet its deadline even with the whole cluster"
                if alone is None
                else "cannot meet its deadline on top of the admitted jobs' guaranteed shares"
            )
        else:
            plan.drop[x.job_id] = f"admitting it would make admitted job {failed.job_id} miss its deadline"
        return guaranteed

    # -- Algorithm 2: greedy allocation of the remaining GPUs ----------------
    def allocate(self, snap: Snapshot, plan: Plan, ctx: "_Context") -> None:
        """Shares for the current slot first; then one step at a time the job
        with the highest marginal return (extra progress over one slot, net of
        rescale costs, per extra GPU, in single-GPU units) gets more GPUs
        (:func:`tidal.scheduler.greedy.greedy`)."""
        levels = ctx.levels
        jobs, base = ctx.runnable(snap, plan)
        free = snap.cluster.num_gpus - sum(base.values())
        free = self._floors(snap, jobs, base, levels, free)
        hold = self.slot if self.slot > 0 else 60.0
        memo = self._memo_for(snap, ctx.costs)
        entries = algorithm2_input(snap, jobs, base, ctx, memo, list(self._weights(snap, jobs)), hold)
        alloc = plan.allocation
        for jid, i in greedy(entries, free).items():
            if i:  # level 0 is no GPUs
                alloc[jid] = levels[jid].count_list[i]
        # re-plan at the next change of the timeline (a share may grow then)
        plan.wake_at = float(ctx.timeline.t[1]) if len(ctx.timeline.t) > 1 else None

    def _memo_for(self, snap: Snapshot, costs: Costs) -> "_Memo":
        """The policy's memo of levels and step tables, emptied when what
        they depend on (profiles, cluster size, costs, slot) changes."""
        memo = getattr(self, "_memo", None)
        if memo is None or not memo.valid(snap, costs, self.slot):
            memo = self._memo = _Memo(snap, costs, self.slot)
        return memo

    # -- hooks for policies built on ElasticFlow (see policies/tidal.py) -----
    def _floors(self, snap: Snapshot, jobs: list[JobView], base: dict[str, int], levels: dict[str, Levels],
                free: int) -> int:
        """Raise ``base`` (GPUs a job gets before Algorithm 2) in place; return
        the GPUs still free. ElasticFlow: nothing beyond the shares."""
        return free

    def _weight(self, snap: Snapshot, job: JobView) -> float:
        """Scale a job's marginal return in Algorithm 2. ElasticFlow: 1."""
        return 1.0

    def _weights(self, snap: Snapshot, jobs: list[JobView]) -> Iterable[float]:
        """:meth:`_weight` of each of ``jobs`` (a policy may work them out
        together)."""
        if type(self)._weight is ElasticFlow._weight:
            return repeat(1.0, len(jobs))
        return [self._weight(snap, j) for j in jobs]


class _Memo:
    """What the policy's decisions share across scheduling rounds: each
    job's levels (by what :func:`job_levels` depends on) and its Algorithm 2
    step tables (by levels, GPUs held, started or not, share and weight).
    Valid for one profile set, cluster size, cost model and slot; a cache
    only, the decisions are the same without it."""

    def __init__(self, snap: Snapshot, costs: Costs, slot: float) -> None:
        self.profiles, self.cap, self.costs, self.slot = snap.profiles, snap.cluster.num_gpus, costs, slot
        self.by_key: dict = {}  # job_levels' cache
        self.by_job: dict[str, tuple[object, int, Levels]] = {}  # job id -> (spec, batch, levels)
        self.tables: dict[tuple, tuple[Levels, Steps]] = {}

    def valid(self, snap: Snapshot, costs: Costs, slot: float) -> bool:
        return (snap.profiles is self.profiles and snap.cluster.num_gpus == self.cap and costs == self.costs
                and slot == self.slot)

    def levels_of(self, snap: Snapshot) -> dict[str, Levels]:
        """Every job's levels (job id -> :class:`Levels`), in snapshot order."""
        by_job, out = self.by_job, {}
        if len(by_job) > 2 * len(snap.jobs) + 1024:  # forget jobs that left
            by_job = self.by_job = {j.job_id: by_job[j.job_id] for j in snap.jobs if j.job_id in by_job}
        fast = kernels.fast
        if fast is not None:
            got = fast.levels_of(snap.jobs, by_job, lambda j: job_levels(snap, j, self.by_key))
            if got is not NotImplemented:
                return got  # the loop below, compiled
        get = by_job.get
        for j in snap.jobs:
            spec = j.spec
            jid = spec.job_id
            hit = get(jid)
            if hit is None or hit[0] is not spec or hit[1] != j.batch:
                hit = by_job[jid] = (spec, j.batch, job_levels(snap, j, self.by_key))
            out[jid] = hit[2]
        return out

    def steps(self, snap: Snapshot, j: JobView, lv: Levels, hold: float, share: int | None, weight: float) -> Steps:
        """Algorithm 2's step tables for ``j`` (``lv`` must come from this
        memo: the tables are keyed by its identity)."""
        key = (id(lv), len(j.gpus), j.executed > 0, share, weight)
        hit = self.tables.get(key)
        if hit is None or hit[0] is not lv:
            vals = slot_progress(snap, j, lv, self.costs, hold, share)
            one = lv.rate_list[1] / lv.count_list[1] * hold
            hit = self.tables[key] = (lv, build_steps(lv.count_list, vals, one, weight))
        return hit[1]


@dataclass
class _Context:
    """What admission hands to allocation within one scheduling call."""

    levels: dict[str, Levels]
    shares: dict[str, int]  # guaranteed jobs' share for the current slot
    costs: Costs
    timeline: Timeline
    thin: set[str] = field(default_factory=set)  # guaranteed jobs without migration slack
    _runnable: tuple | None = None  # (admit, drop, their sizes, jobs, base, snap) of the last runnable()

    def runnable(self, snap: Snapshot, plan: Plan) -> tuple[list[JobView], dict[str, int]]:
        """The jobs Algorithm 2 may give GPUs (schedulable, with a level
        above 0) and a new copy of their base (the share for this slot, else
        0); kept for another pass over the same admits and drops."""
        admit, drop = plan.admit, plan.drop
        hit = self._runnable
        if (hit is None or hit[0] is not admit or hit[1] is not drop or hit[2] != (len(admit), len(drop))
                or hit[5] is not snap):
            levels, fast = self.levels, kernels.fast
            got = NotImplemented
            if fast is not None and type(levels) is dict and type(self.shares) is dict and type(snap.ids) is tuple:
                got = fast.runnable(tuple(snap.jobs), snap.ids, admit, drop, levels, self.shares)
            if got is NotImplemented:
                sget = self.shares.get
                got = [], {}
                for j in schedulable(snap, plan):
                    jid = j.spec.job_id
                    if len(levels[jid].count_list) > 1:
                        got[0].append(j)
                        got[1][jid] = sget(jid, 0)
            hit = self._runnable = (admit, drop, (len(admit), len(drop)), *got, snap)
        return list(hit[3]), dict(hit[4])


def algorithm2_input(snap: Snapshot, jobs: list[JobView], base: dict[str, int], ctx: "_Context", memo: "_Memo",
                     weights: list[float], hold: float) -> dict[str, tuple[Steps, int, float]]:
    """Algorithm 2's input, per job (in ``jobs`` order): its step tables
    (memoised by levels, GPUs held, started or not, share and weight), its
    starting level (its ``base`` count's) and its deadline (inf: none)."""
    levels, shares = ctx.levels, ctx.shares
    fast = kernels.fast
    if fast is not None and (type(jobs), type(levels), type(base), type(shares)) == (list, dict, dict, dict):
        def make(j: JobView, lv: Levels, share: int | None, weight: float) -> Steps:
            return memo.steps(snap, j, lv, hold, share, weight)

        got = fast.steps_input(jobs, levels, base, shares, weights, memo.tables, make, math.inf)
        if got is not NotImplemented:
            return got  # the loop below, compiled
    tget = memo.tables.get
    entries: dict[str, tuple[Steps, int, float]] = {}
    inf = math.inf
    for j, weight in zip(jobs, weights):
        spec = j.spec
        jid = spec.job_id
        lv = levels[jid]
        b = base[jid]
        share = b if jid in shares else None
        hit = tget((id(lv), len(j.gpus), j.executed > 0, share, weight))
        steps = hit[1] if hit is not None and hit[0] is lv else memo.steps(snap, j, lv, hold, share, weight)
        ddl = spec.deadline
        entries[jid] = (steps, bisect_left(lv.count_list, b) if b else 0, inf if ddl is None else ddl)
    return entries


def dead_time(snap: Snapshot, j: JobView, costs: Costs) -> float:
    """Seconds of the last rescale the job still has to sit out."""
    busy = j.tags.get("ef_busy_until")
    if busy is not None:
        return max(float(busy) - snap.now, 0.0)
    return costs.worst_change if j.state is JobState.RESIZING else 0.0


def plan_needs(snap: Snapshot, j: JobView, segs: Segments, lv: Levels, slacks: tuple[float, ...]) -> list[float]:
    """The work :meth:`ElasticFlow._on_track` asks of a stored plan, per slack."""
    rate = lv.rate_of(count_at(segs, snap.now) or len(j.gpus))
    base = j.remaining * (1 + 1e-9) + EPS
    return [base + slack * rate for slack in slacks]


def plan_check(
    snap: Snapshot, j: JobView, segs: Segments, lv: Levels, costs: Costs, margin: float, worst: float
) -> tuple[float, float, float]:
    """:func:`plan_delivers` and :func:`plan_needs` (slacks 0 and ``margin``)
    at once, the same numbers; ``worst`` is ``costs.worst_change``. A plan of
    one count (the common case) is worked out here."""
    if len(segs) != 2:
        return (plan_delivers(snap, j, segs, lv, costs), *plan_needs(snap, j, segs, lv, (0.0, margin)))
    (s0, c0), (s1, _) = segs
    now, spec = snap.now, j.spec
    busy = j.tags.get("ef_busy_until")  # dead_time, inlined (``a if a > b else b`` is max(b, a))
    if busy is not None:
        dead = float(busy) - now
        dead = 0.0 if 0.0 > dead else dead
    else:
        dead = worst if j.state is JobState.RESIZING else 0.0
    counts, rates = lv.count_list, lv.rate_list
    held = len(j.gpus)
    try:
        r = rates[counts.index(c0)]  # lv.rate_of(c0)
    except ValueError:
        r = 0.0
    if c0 == held and s0 <= now:
        ddl = spec.deadline
        got = r * ((ddl if ddl < s1 else s1) - now - dead)
    else:  # deliverable() over the one segment
        a = now if now > s0 else s0
        b = float(spec.deadline)
        b = b if b < s1 else s1
        if b <= a:
            got = 0.0
        else:
            loss = first_loss(c0, r, held, lv.rate_of(held), j.executed > 0, costs) + dead * r
            got = r * (b - a) - loss
            got = 0.0 + (0.0 if 0.0 > got else got)
    n = c0 if s0 <= now < s1 else 0  # count_at(segs, now)
    if not n:
        n = held
    try:
        rate = rates[counts.index(n)]
    except ValueError:
        rate = 0.0
    left = spec.iterations - j.done  # j.remaining
    base = (left if left > 0.0 else 0.0) * (1 + 1e-9) + EPS
    return got, base + 0.0 * rate, base + margin * rate


def plan_delivers(snap: Snapshot, j: JobView, segs: Segments, lv: Levels, costs: Costs) -> float:
    """The work a stored plan still delivers by the deadline."""
    if len(segs) == 2 and segs[0][0] <= snap.now and segs[0][1] == len(j.gpus):
        # the common case: one count from before now to the release, held now
        r = lv.rate_of(segs[0][1])
        return r * (min(segs[1][0], j.spec.deadline) - snap.now - dead_time(snap, j, costs))
    return deliverable(segs, snap.now, float(j.spec.deadline), lv, j.size, j.executed > 0, costs,
                       dead_time(snap, j, costs))


def place_shares_first(snap: Snapshot, plan: Plan, ctx: _Context) -> None:
    """Buddy placement (§4.3). Extra GPUs from Algorithm 2 are not worth
    a migration: a job that cannot get its block without moving others
    first falls back to smaller counts, down to its share; only shares
    may make the placer migrate, and it moves best-effort jobs first."""
    fallback = _Fallback(plan.allocation, ctx)
    # moving a guaranteed job costs more than a best-effort one, and much
    # more once its plan has no slack left for a migration
    shares, thin, held = ctx.shares, ctx.thin, snap.held
    # every other job's weight is 1 (the placer's default)
    weights = {jid: 10_000 if jid in thin else 100 for jid in shares if jid in held} if shares else {}
    plan.placement = placement = place_buddy(snap, plan.allocation, fallback, weights)
    plan.allocation = dict(zip(placement, map(len, placement.values())))


class _Fallback(Mapping[str, list[int]]):
    """Each job given more than its share: its smaller counts, down to the
    share, largest first; a job's list is built when the placer asks for it
    (only for the few jobs that do not fit)."""

    def __init__(self, allocation: dict[str, int], ctx: _Context) -> None:
        self.allocation, self.ctx = allocation, ctx

    def __getitem__(self, jid: str) -> list[int]:
        got = self.get(jid)
        if got is None:
            raise KeyError(jid)
        return got

    def get(self, jid: str, default: Any = None) -> Any:  # without raising: the placer asks for many
        n, base = self.allocation.get(jid, 0), self.ctx.shares.get(jid, 0)
        if n <= base:
            return default
        return [c for c in reversed(self.ctx.levels[jid].count_list) if base <= c < n]

    def __iter__(self) -> Iterator[str]:
        return (jid for jid, n in self.allocation.items() if n > self.ctx.shares.get(jid, 0))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def record_rescales(snap: Snapshot, plan: Plan, costs: Costs) -> None:
    """Remember until when each changed job makes (less) progress, so the
    next plan knows even if the overhead outlasts a slot."""
    alloc, placement, held = plan.allocation, plan.placement, snap.held
    # a job placed on the very GPUs it holds (and allocated their count) is skipped below: look at the others
    fast = kernels.fast
    look = NotImplemented
    if fast is not None and type(alloc) is dict and type(placement) is dict and type(held) in (dict, FrozenDict):
        look = fast.changed_jobs(alloc, placement, held)  # the two lines below, compiled
    if look is NotImplemented:
        look = set(compress(alloc, map(is_not, map(placement.get, alloc, repeat(())), map(held.get, alloc))))
        look.update(compress(alloc, map(ne, map(len, map(placement.get, alloc, repeat(()))), alloc.values())))
    for j in snap.in_order(look):
        n = alloc.get(j.job_id, 0)
        if n == 0:
            continue
        gpus = placement.get(j.job_id, ())
        if n == j.size and (gpus == j.gpus or sorted(gpus) == sorted(j.gpus)):
            continue
        if j.size == 0:
            dead = costs.resume if j.executed > 0 else costs.start
        elif n == j.size:
            dead = costs.migrate
        elif n > j.size:
            r_old, r_new = snap.progress_rate(j, j.size, j.batch or None), snap.progress_rate(j, n, j.batch or None)
            dead = costs.grow + (costs.warmup * max(r_new - r_old, 0.0) / r_new if r_new > 0 else 0.0)
        else:
            dead = costs.shrink
        if dead > 0 or "ef_busy_until" in j.tags:
            plan.tags.setdefault(j.job_id, {})["ef_busy_until"] = snap.now + dead
