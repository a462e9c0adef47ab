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
  a satisfactory share; otherwise it is dropped with the reason.
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
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from tidal.core.job import JobState
from tidal.core.overhead import OverheadModel
from tidal.scheduler.api import JobView, Plan, Policy, Snapshot, register_policy, schedulable
from tidal.scheduler.buddy import place_buddy
from tidal.scheduler.estimate import rigid_count

_EPS = 1e-6


@dataclass(frozen=True)
class Levels:
    """A job's buddy sizes and progress rates, with 0 GPUs at index 0."""

    counts: np.ndarray  # [0, c1, c2, ...] ascending, rate strictly rising
    rates: np.ndarray  # iterations/s at each count (spec iterations)
    count_list: tuple[int, ...] = ()
    rate_list: tuple[float, ...] = ()

    def rate_of(self, n: int) -> float:
        """Rate at a count among the levels (0.0 otherwise)."""
        try:
            return self.rate_list[self.count_list.index(n)]
        except ValueError:
            return 0.0


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


@dataclass(frozen=True)
class Costs:
    """Seconds of lost progress per change of count, from the overhead model."""

    start: float  # first launch
    resume: float  # restart after a preemption
    grow: float  # pause after the warm-up (stop-free) or the restart (stop-resume)
    warmup: float  # stop-free warm-up, while the old workers keep training
    shrink: float
    migrate: float

    @classmethod
    def of(cls, ov: OverheadModel) -> "Costs":
        mig = ov.migrate_s if ov.migrate_s is not None else (
            ov.stop_resume_s if ov.mode == "stop-resume" else ov.warmup_s + ov.pause_s
        )
        if ov.mode == "stop-resume":
            return cls(ov.launch_s, ov.stop_resume_s, ov.stop_resume_s, 0.0, ov.stop_resume_s, mig)
        return cls(ov.launch_s, ov.stop_resume_s, ov.pause_s, ov.warmup_s, ov.pause_s, mig)

    @property
    def worst_change(self) -> float:
        return max(self.grow + self.warmup, self.shrink, self.migrate, self.resume)


class Timeline:
    """Free GPUs over future time: interval ``k`` starts at ``t[k]`` and has
    ``free[k]`` GPUs; the last interval never ends. Releases are aligned to
    slot boundaries, where the executor re-plans."""

    def __init__(self, now: float, gpus: int, slot: float) -> None:
        self.t = np.array([now], dtype=float)
        self.free = np.array([gpus], dtype=np.int64)
        self.slot = slot

    def align(self, t: float) -> float:
        return math.ceil(t / self.slot - 1e-6) * self.slot if self.slot > 0 else t

    def release(self, finish: float) -> float:
        """When a share planned to end at ``finish`` gives its GPUs back."""
        return self.align(finish)


@dataclass
class Share:
    """A job's planned allocation: count per timeline interval, up to ``end``."""

    cap: int  # the minimum satisfactory share (0: none found)
    alloc: np.ndarray  # GPUs in intervals 0..k
    finish: float
    now_count: int


def fill(
    tl: Timeline,
    lv: Levels,
    remaining: float,
    horizon: float,
    held: int,
    started: bool,
    costs: Costs,
    extra_dead: float = 0.0,
    margin: float = 0.0,
) -> Share | None:
    """Progressive filling (Algorithm 1): the smallest cap ``i`` whose
    filling ``min(i, free(t))`` (rounded down to a buddy size) finishes
    ``remaining`` iterations by ``horizon``, net of the rescale cost of every
    change of count; None if no cap does.

    Fast path: the smallest cap that would finish in time at a constant
    count, if the timeline has that many GPUs free all along. Otherwise all
    caps are evaluated at once as rows of one array. ``margin`` seconds of
    work at the cap's rate are added to what the share must deliver: slack
    for changes the plan cannot foresee (a migration)."""
    t, free = tl.t, tl.free
    now = float(t[0])
    rem = remaining * (1 + 1e-9) + _EPS
    r_held = lv.rate_of(held)
    for c, r in zip(lv.count_list[1:], lv.rate_list[1:]):
        loss = first_loss(c, r, held, r_held, started, costs) + (extra_dead + margin) * r
        finish = now + (rem + loss) / r
        if finish > horizon:
            continue
        release = tl.release(finish)
        p = max(int(np.searchsorted(t, release, side="left")), 1)
        if free[:p].min() >= c:
            k = max(int(np.searchsorted(t, finish, side="right")) - 1, 0)
            return Share(c, np.full(k + 1, c, dtype=np.int64), finish, c)
        break  # contention: fill every cap
    return _fill_all(tl, lv, remaining, horizon, held, r_held, started, costs, extra_dead, margin)


def first_loss(c: int, r: float, held: int, r_held: float, started: bool, costs: Costs) -> float:
    """Iterations lost when a job holding ``held`` GPUs moves to ``c``."""
    if c == held or c == 0:
        return 0.0
    if held == 0:
        return r * (costs.resume if started else costs.start)
    if c > held:
        return r * costs.grow + costs.warmup * max(r - r_held, 0.0)
    return r * costs.shrink


def _fill_all(
    tl: Timeline,
    lv: Levels,
    remaining: float,
    horizon: float,
    held: int,
    r_held: float,
    started: bool,
    costs: Costs,
    extra_dead: float,
    margin: float,
) -> Share | None:
    t, free = tl.t, tl.free
    m = int(np.searchsorted(t, horizon, side="left"))
    if m == 0 or len(lv.counts) < 2:
        return None
    ends = np.empty(m)
    ends[:-1] = t[1:m]
    ends[-1] = horizon
    dt = ends - t[:m]
    caps = lv.counts[1:, None]  # (L, 1)
    idx = np.searchsorted(lv.counts, np.minimum(free[None, :m], caps), side="right") - 1  # (L, m)
    alloc = lv.counts[idx]
    rate = lv.rates[idx]
    prev_a = np.empty_like(alloc)
    prev_a[:, 0] = held
    prev_a[:, 1:] = alloc[:, :-1]
    prev_r = np.empty_like(rate)
    prev_r[:, 0] = r_held
    prev_r[:, 1:] = rate[:, :-1]
    changed = (alloc != prev_a) & (alloc > 0)
    ran = np.cumsum(alloc > 0, axis=1) - (alloc > 0) > 0  # ran in an earlier interval
    restart = np.where(ran | started, costs.resume, costs.start)
    grow_loss = costs.grow * rate + costs.warmup * np.maximum(rate - prev_r, 0.0)
    loss = np.where(prev_a == 0, restart * rate, np.where(alloc > prev_a, grow_loss, costs.shrink * rate))
    loss = np.where(changed, loss, 0.0)
    loss[:, 0] += extra_dead * rate[:, 0]
    prog = np.maximum(rate * dt - loss, 0.0)
    cum = np.cumsum(prog, axis=1)
    need = remaining * (1 + 1e-9) + _EPS + margin * lv.rates[1:]
    ok = cum[:, -1] >= need
    if not ok.any():
        return None
    row = int(np.argmax(ok))
    c = cum[row]
    k = min(int(np.searchsorted(c, need[row], side="left")), m - 1)
    r = rate[row, k]
    finish = ends[k] - (c[k] - need[row]) / r if r > 0 else ends[k]
    return Share(int(lv.counts[row + 1]), alloc[row, : k + 1].copy(), max(finish, float(t[0])), int(alloc[row, 0]))


def commit(tl: Timeline, share: Share) -> None:
    """Reserve ``share`` on the timeline until the slot boundary after it ends."""
    k = len(share.alloc) - 1
    release = tl.release(share.finish)
    t, free = tl.t, tl.free
    p = int(np.searchsorted(t, release, side="left"))
    if p == len(t) or t[p] != release:
        p = max(p, k + 1)
        if p == len(t) or t[p] != release:
            t = np.concatenate((t[:p], (release,), t[p:]))
            free = np.concatenate((free[:p], free[p - 1 : p], free[p:]))
    free[:k] -= share.alloc[:k]
    free[k:p] -= share.alloc[k]
    tl.t, tl.free = t, free



Segments = tuple[tuple[float, int], ...]  # (start time, GPUs); the last one has 0 GPUs


def share_segments(tl: Timeline, share: Share) -> Segments:
    """A share as absolute-time segments, ending at its release (slot-aligned)."""
    release = tl.release(share.finish)
    alloc = share.alloc
    starts = np.flatnonzero(np.diff(alloc)) + 1 if len(alloc) > 1 else np.empty(0, dtype=np.int64)
    segs = [(float(tl.t[0]), int(alloc[0]))]
    for i in starts.tolist():
        t0 = float(tl.t[i])
        if t0 >= release:
            break
        segs.append((t0, int(alloc[i])))
    segs.append((release, 0))
    return tuple(segs)


def count_at(segs: Segments, t: float) -> int:
    c = 0
    for start, n in segs:
        if start > t:
            break
        c = n
    return c


def commit_segments(tl: Timeline, segs: Segments, sign: int = 1) -> bool:
    """Reserve a stored plan from now on (``sign=-1``: give it back); False
    (timeline unchanged) if some interval would go below zero free GPUs."""
    now = float(tl.t[0])
    t, free = tl.t, tl.free
    for b, _ in segs:
        if b <= now:
            continue
        p = int(np.searchsorted(t, b, side="left"))
        if p == len(t) or t[p] != b:
            t = np.concatenate((t[:p], (b,), t[p:]))
            free = np.concatenate((free[:p], free[p - 1 : p], free[p:]))
    new = free.copy()
    for i, (start, c) in enumerate(segs[:-1]):
        if c == 0:
            continue
        lo = int(np.searchsorted(t, max(start, now), side="left"))
        hi = int(np.searchsorted(t, segs[i + 1][0], side="left"))
        new[lo:hi] -= sign * c
    if (new < 0).any():
        return False
    tl.t, tl.free = t, new
    return True


def reserve_all(tl: Timeline, plans: list[Segments]) -> bool:
    """Reserve many stored plans on a fresh timeline at once (one vectorised
    pass); False (timeline unchanged) if they need more GPUs than exist."""
    now = float(tl.t[0])
    starts: list[float] = []
    ends: list[float] = []
    counts: list[int] = []
    for segs in plans:
        for i in range(len(segs) - 1):
            start, c = segs[i]
            end = segs[i + 1][0]
            if c > 0 and end > now:
                starts.append(max(start, now))
                ends.append(end)
                counts.append(c)
    if not counts:
        return True
    a, b = np.array(starts), np.array(ends)
    bp = np.unique(np.concatenate((tl.t[:1], a, b)))
    delta = np.zeros(len(bp) + 1, dtype=np.int64)
    cnt = np.array(counts, dtype=np.int64)
    np.add.at(delta, np.searchsorted(bp, a), cnt)
    np.add.at(delta, np.searchsorted(bp, b), -cnt)
    free = int(tl.free[0]) - np.cumsum(delta)[: len(bp)]
    if (free < 0).any():
        return False
    tl.t, tl.free = bp, free
    return True


def deliverable(
    segs: Segments, now: float, horizon: float, lv: Levels, held: int, started: bool, costs: Costs, extra_dead: float
) -> float:
    """Iterations a stored plan still delivers between now and ``horizon``,
    net of the cost of every change of count (from what the job holds now)."""
    prog, prev, first = 0.0, held, True
    for i, (start, c) in enumerate(segs[:-1]):
        a, b = max(start, now), min(segs[i + 1][0], horizon)
        if b <= a:
            continue
        r = lv.rate_of(c)
        loss = first_loss(c, r, prev, lv.rate_of(prev), started, costs)
        if first:
            loss += extra_dead * r
            first = False
        prog += max(r * (b - a) - loss, 0.0)
        started = started or c > 0
        prev = c
    return prog


def is_soft(job: JobView, all_soft: bool) -> bool:
    return all_soft or any(k == "soft_deadline" and v not in ("", "0", "false") for k, v in job.spec.meta)


@register_policy("elasticflow")
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

    def _horizon(self, j: JobView, costs: Costs) -> float:
        return float(j.spec.deadline)

    def _dead(self, snap: Snapshot, j: JobView, costs: Costs) -> float:
        """Seconds of the last rescale the job still has to sit out."""
        busy = j.tags.get("ef_busy_until")
        if busy is not None:
            return max(float(busy) - snap.now, 0.0)
        return costs.worst_change if j.state is JobState.RESIZING else 0.0

    def _share(
        self, snap: Snapshot, tl: Timeline, j: JobView, lv: Levels, costs: Costs, slack: bool = True
    ) -> Share | None:
        """Minimum satisfactory share; ``slack=False`` drops the migration
        slack (for an admitted job that fell behind: better a share without
        slack than none)."""
        horizon = self._horizon(j, costs)
        if horizon <= snap.now or j.remaining <= 0:
            return None
        margin = self.reserve_rescales * costs.migrate if slack else 0.0
        return fill(tl, lv, j.remaining, horizon, j.n, j.executed > 0, costs, self._dead(snap, j, costs), margin)

    def _on_track(
        self, snap: Snapshot, j: JobView, segs: Segments, lv: Levels, costs: Costs, slack: float = 0.0
    ) -> bool:
        """Does the stored plan still deliver the remaining work (plus ``slack``
        seconds of work at its current rate) by the deadline?"""
        need = j.remaining * (1 + 1e-9) + _EPS + slack * lv.rate_of(count_at(segs, snap.now) or len(j.gpus))
        if len(segs) == 2 and segs[0][0] <= snap.now and segs[0][1] == len(j.gpus):
            # the common case: one count from before now to the release, held now
            r = lv.rate_of(segs[0][1])
            return r * (min(segs[1][0], j.spec.deadline) - snap.now - self._dead(snap, j, costs)) >= need
        got = deliverable(segs, snap.now, self._horizon(j, costs), lv, j.n, j.executed > 0, costs,
                          self._dead(snap, j, costs))
        return got >= need

    # -- the three steps ------------------------------------------------------
    def schedule(self, snap: Snapshot) -> Plan:
        plan = Plan()
        ctx = self.admit(snap, plan)
        self.allocate(snap, plan, ctx)
        self._place(snap, plan, ctx)
        self._record_rescales(snap, plan, ctx.costs)
        return plan

    def _place(self, snap: Snapshot, plan: Plan, ctx: "_Context") -> None:
        """Buddy placement (§4.3). Extra GPUs from Algorithm 2 are not worth
        a migration: a job that cannot get its block without moving others
        first falls back to smaller counts, down to its share; only shares
        may make the placer migrate, and it moves best-effort jobs first."""
        fallback: dict[str, list[int]] = {}
        for jid, n in plan.allocation.items():
            base = ctx.shares.get(jid, 0)
            if n > base:
                fallback[jid] = [c for c in reversed(ctx.levels[jid].count_list) if base <= c < n]
        # moving a guaranteed job costs more than a best-effort one, and much
        # more once its plan has no slack left for a migration
        weights = {j.job_id: (10_000 if j.job_id in ctx.thin else 100) if j.job_id in ctx.shares else 1
                   for j in snap.jobs if j.gpus}
        plan.placement = place_buddy(snap, plan.allocation, fallback, weights)
        plan.allocation = {jid: len(g) for jid, g in plan.placement.items()}

    def admission(self, snap: Snapshot, plan: Plan) -> None:
        self.admit(snap, plan)

    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        self.allocate(snap, plan, self.admit(snap, Plan()))

    def placement(self, snap: Snapshot, plan: Plan) -> None:
        plan.placement = place_buddy(snap, plan.allocation)

    def _record_rescales(self, snap: Snapshot, plan: Plan, costs: Costs) -> None:
        """Remember until when each changed job makes (less) progress, so the
        next plan knows even if the overhead outlasts a slot."""
        for j in snap.jobs:
            n = plan.allocation.get(j.job_id, 0)
            if n == 0:
                continue
            gpus = plan.placement.get(j.job_id, ())
            if n == j.n and tuple(sorted(gpus)) == tuple(sorted(j.gpus)):
                continue
            if j.n == 0:
                dead = costs.resume if j.executed > 0 else costs.start
            elif n == j.n:
                dead = costs.migrate
            elif n > j.n:
                r_old, r_new = snap.progress_rate(j, j.n, j.batch or None), snap.progress_rate(j, n, j.batch or None)
                dead = costs.grow + (costs.warmup * max(r_new - r_old, 0.0) / r_new if r_new > 0 else 0.0)
            else:
                dead = costs.shrink
            if dead > 0 or "ef_busy_until" in j.tags:
                plan.tags.setdefault(j.job_id, {})["ef_busy_until"] = snap.now + dead

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
            out[j.job_id] = (share_segments(tl, share), share.cap)
            commit(tl, share)
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
        now, total = snap.now, snap.cluster.num_gpus
        cache: dict = {}
        levels: dict[str, Levels] = {}
        guaranteed: list[JobView] = []
        new_ddl: list[JobView] = []
        for j in snap.jobs:
            lv = job_levels(snap, j, cache)
            levels[j.job_id] = lv
            if j.state is JobState.SUBMITTED:
                if len(lv.counts) < 2:
                    plan.drop[j.job_id] = f"model {j.spec.model} cannot run on this cluster ({total} GPUs)"
                elif j.spec.deadline is None:
                    plan.admit.add(j.job_id)
                    plan.tags[j.job_id] = {"ef_class": "best-effort"}
                else:
                    new_ddl.append(j)
            elif j.admitted and j.spec.deadline is not None and j.tags.get("ef_class", "guaranteed") == "guaranteed":
                guaranteed.append(j)
        guaranteed.sort(key=self._order)
        tl = Timeline(now, total, self.slot)
        plans: dict[str, Segments] = {}
        caps: dict[str, int] = {}
        refill: list[JobView] = []
        kept: list[JobView] = []
        thin: list[JobView] = []  # on track, but the slack for a migration is used up
        margin = self.reserve_rescales * costs.migrate
        for j in guaranteed:
            segs = j.tags.get("ef_plan")
            if segs and self._on_track(snap, j, segs, levels[j.job_id], costs):
                kept.append(j)
                plans[j.job_id] = segs
                if margin > 0 and not self._on_track(snap, j, segs, levels[j.job_id], costs, margin):
                    thin.append(j)
            else:
                refill.append(j)
        if not reserve_all(tl, [plans[j.job_id] for j in kept]):
            # stored plans collide (should not happen): keep them one by one
            tl = Timeline(now, total, self.slot)
            for j in kept:
                if not commit_segments(tl, plans[j.job_id]):
                    del plans[j.job_id]
                    refill.append(j)
            refill.sort(key=self._order)
        for j in thin:
            # try to get the slack back: a new share on what the others leave
            if j.job_id not in plans or not commit_segments(tl, plans[j.job_id], sign=-1):
                continue
            share = self._share(snap, tl, j, levels[j.job_id], costs)
            if share is None:
                commit_segments(tl, plans[j.job_id])
            else:
                plans[j.job_id] = share_segments(tl, share)
                caps[j.job_id] = share.cap
                commit(tl, share)
        late: set[str] = set()
        for j in refill:
            share = self._share(snap, tl, j, levels[j.job_id], costs)
            if share is None:
                share = self._share(snap, tl, j, levels[j.job_id], costs, slack=False)
            if share is None:
                # repair: re-plan every guaranteed job from scratch (Algorithm 1 order)
                keep = [g for g in guaranteed if g.job_id not in late]
                trial_tl, trial, failed = self._replan(snap, keep, levels, costs, lenient=True)
                if failed is None:
                    tl = trial_tl
                    for jid, (segs, cap) in trial.items():
                        plans[jid], caps[jid] = segs, cap
                    break
                plan.tags[j.job_id] = {"ef_class": "late", "ef_plan": ()}
                late.add(j.job_id)
            else:
                plans[j.job_id] = share_segments(tl, share)
                caps[j.job_id] = share.cap
                commit(tl, share)
        guaranteed = [j for j in guaranteed if j.job_id in plans]
        for x in sorted(new_ddl, key=self._order):
            share = self._share(snap, tl, x, levels[x.job_id], costs)
            if share is not None:  # fits in what the guaranteed jobs leave
                plans[x.job_id] = share_segments(tl, share)
                caps[x.job_id] = share.cap
                commit(tl, share)
                guaranteed.append(x)
                plan.admit.add(x.job_id)
                continue
            order = sorted([*guaranteed, x], key=self._order)
            trial_tl, trial, failed = self._replan(snap, order, levels, costs)
            if failed is x:
                # its deadline leaves no room for the migration slack: admit
                # it on what the others leave, placed as a job that must not move
                share = self._share(snap, tl, x, levels[x.job_id], costs, slack=False)
                if share is not None:
                    plans[x.job_id] = share_segments(tl, share)
                    caps[x.job_id] = share.cap
                    commit(tl, share)
                    guaranteed.append(x)
                    plan.admit.add(x.job_id)
                    thin.append(x)
                    continue
            if failed is None:
                for jid, (segs, cap) in trial.items():
                    plans[jid], caps[jid] = segs, cap
                tl = trial_tl
                guaranteed = order
                plan.admit.add(x.job_id)
            elif is_soft(x, self.soft_deadlines):
                plan.admit.add(x.job_id)
                plan.tags[x.job_id] = {"ef_class": "best-effort"}
            elif failed is x:
                alone = self._share(snap, Timeline(now, total, self.slot), x, levels[x.job_id], costs)
                plan.drop[x.job_id] = (
                    "cannot meet its deadline even with the whole cluster"
                    if alone is None
                    else "cannot meet its deadline on top of the admitted jobs' guaranteed shares"
                )
            else:
                plan.drop[x.job_id] = f"admitting it would make admitted job {failed.job_id} miss its deadline"
        for jid, cap in caps.items():
            plan.tags[jid] = {"ef_class": "guaranteed", "ef_plan": plans[jid], "ef_share": cap}
        shares_now = {jid: count_at(segs, now) for jid, segs in plans.items()}
        still_thin = {j.job_id for j in thin if j.job_id not in caps or j.state is JobState.SUBMITTED}
        return _Context(levels, shares_now, costs, tl, still_thin)

    # -- Algorithm 2: greedy allocation of the remaining GPUs ----------------
    def allocate(self, snap: Snapshot, plan: Plan, ctx: "_Context") -> None:
        """Shares for the current slot first; then one step at a time the job
        with the highest marginal return (extra progress over one slot, net of
        rescale costs, per extra GPU, in single-GPU units) gets more GPUs."""
        levels, shares, costs = ctx.levels, ctx.shares, ctx.costs
        jobs = [j for j in schedulable(snap, plan) if len(levels[j.job_id].counts) > 1]
        base = {j.job_id: shares.get(j.job_id, 0) for j in jobs}
        free = snap.cluster.num_gpus - sum(base.values())
        free = self._floors(snap, jobs, base, levels, free)
        hold = self.slot if self.slot > 0 else 60.0

        def progress(j: JobView, lv: Levels) -> list[float]:
            """Iterations over one slot at each level, net of the cost of getting
            there and (for guaranteed jobs) of shrinking back to the share."""
            n, jid = len(j.gpus), j.job_id
            r_old = (lv.rate_of(n) or snap.progress_rate(j, n, j.batch or None)) if n else 0.0
            restart = costs.resume if j.executed > 0 else costs.start
            guaranteed, b = jid in shares, base[jid]
            out = []
            for c, r in zip(lv.count_list, lv.rate_list):
                if c == 0:
                    out.append(0.0)
                    continue
                if c == n:
                    lost = 0.0
                elif n == 0:
                    lost = r * restart
                elif c > n:
                    lost = r * costs.grow + costs.warmup * max(r - r_old, 0.0)
                else:
                    lost = r * costs.shrink
                if guaranteed and c != b:
                    lost += r * costs.shrink
                out.append(max(r * hold - lost, 0.0))
            return out

        cur: dict[str, int] = {}
        info: dict[str, tuple[JobView, Levels, float, list[float]]] = {}
        heap: list[tuple[float, float, str, int]] = []
        weight = {j.job_id: self._weight(snap, j) for j in jobs}

        def push(jid: str) -> None:
            j, lv, one, vals = info[jid]
            i = cur[jid]
            best, best_k = 0.0, -1
            for k in range(i + 1, len(lv.counts)):
                extra = int(lv.counts[k] - lv.counts[i])
                if extra > free:
                    break
                gain = (vals[k] - vals[i]) / extra / one * weight[jid]
                if gain > best + 1e-12:
                    best, best_k = gain, k
            if best_k > 0:
                ddl = j.spec.deadline if j.spec.deadline is not None else math.inf
                heapq.heappush(heap, (-best, ddl, jid, best_k))

        for j in jobs:
            lv = levels[j.job_id]
            cur[j.job_id] = int(np.searchsorted(lv.counts, base[j.job_id]))
            one = float(lv.rates[1]) / int(lv.counts[1]) * hold
            info[j.job_id] = (j, lv, one, progress(j, lv))
            push(j.job_id)
        while heap and free > 0:
            _, _, jid, k = heapq.heappop(heap)
            lv = info[jid][1]
            extra = int(lv.counts[k] - lv.counts[cur[jid]])
            if extra > free:
                push(jid)  # fewer GPUs left than when queued: look again
                continue
            free -= extra
            cur[jid] = k
            push(jid)
        for jid, i in cur.items():
            n = int(levels[jid].counts[i])
            if n > 0:
                plan.allocation[jid] = n
        # re-plan at the next change of the timeline (a share may grow then)
        plan.wake_at = float(ctx.timeline.t[1]) if len(ctx.timeline.t) > 1 else None


    # -- hooks for policies built on ElasticFlow (see policies/tidal.py) -----
    def _floors(self, snap: Snapshot, jobs: list[JobView], base: dict[str, int], levels: dict[str, Levels],
                free: int) -> int:
        """Raise ``base`` (GPUs a job gets before Algorithm 2) in place; return
        the GPUs still free. ElasticFlow: nothing beyond the shares."""
        return free

    def _weight(self, snap: Snapshot, job: JobView) -> float:
        """Scale a job's marginal return in Algorithm 2. ElasticFlow: 1."""
        return 1.0


@dataclass
class _Context:
    """What admission hands to allocation within one scheduling call."""

    levels: dict[str, Levels]
    shares: dict[str, int]  # guaranteed jobs' share for the current slot
    costs: Costs
    timeline: Timeline
    thin: set[str] = field(default_factory=set)  # guaranteed jobs without migration slack
