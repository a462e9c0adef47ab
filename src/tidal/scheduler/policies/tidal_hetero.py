"""Tidal's heterogeneity-aware policy: a (GPU type, count) per job, chosen
for speedup under per-type capacity, Tiresias' least-attained-service order
deciding who runs.

In the spirit of Sia (Jayaram Subramanya et al., SOSP'23): every round each
job has candidate *configurations* — a GPU type and a count it may run at, on
one type only, bounded by that type's GPUs — each valued by the job's
progress rate there normalised by its rate on its smallest configuration (on
the slowest type it may use): a speedup. Unlike Sia's p-norm over speedups
(solved as an integer programme), the fairness comes from Tiresias' 2D-LAS
(NSDI'19 §4; thresholds 500 and 10,000 GPU·s as in EDL §5.1), the same order
as Tidal's own policy: the objective here is average JCT, which a
least-attained-service order shortens for heavy-tailed job lengths, and the
speedups then decide where each running job goes and how big it grows.
Each round:

1. **Who runs** — jobs in LAS order (queue, running first, then submission)
   each take their smallest count (a rigid job its requested count) while
   some type they may use still has room; the others wait.
2. **Which type** — the jobs that run are given a type in decreasing
   *regret* per GPU: weight x (speedup on its best type − on its second
   best), so the jobs that gain most from the fast GPUs get them when they
   are scarce (comparative advantage, Sia §3 / Gavel §3); each takes the
   best type that still has room.
3. **How big** — a priority queue of moves: a job's best change of
   configuration (a larger count on its type, or any count on another type)
   by gain in weighted speedup per extra GPU; the best move that fits is
   applied and the job's next move queued, until no move gains
   (greedy marginal gain, as Sia's heuristic fallback does).

A running job's configurations other than its current one are worth
``H / (H + cost)`` of their value: ``cost`` the seconds the snapshot's
overhead model charges for the change (a rescale, or a migration for another
type), ``H`` the larger of ``horizon_s`` and the time the job has run (a job
that has run long will likely run long: Sia's restart penalty in spirit).

``hetero=False`` is the same policy blind to GPU types: one pool of all the
cluster's GPUs, valued with the default profile, placed anywhere (the
simulator then runs a job at its slowest GPU type's pace). GPU-type
constraints are honoured either way; a job too large for any single type it
may use runs on several of them (at the slowest one's pace) if enough are free.
"""

from __future__ import annotations

import heapq
import logging
from bisect import bisect_right
from dataclasses import dataclass, field

from tidal.scheduler.api import JobView, Plan, Policy, Snapshot, schedulable
from tidal.scheduler.estimate import rigid_count, useful_counts
from tidal.scheduler.typed import ANY, allowed_types, cluster_types, place_typed, typed_rate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Table:
    """The configurations of jobs of one shape (model, batch, counts, types):
    ``(pool, count, speedup)`` pool by pool, counts ascending; speedups are
    rates over the rate of the smallest count on the slowest pool."""

    cfgs: tuple[tuple[str, int, float], ...]
    first: dict[str, int]  # pool -> index of its smallest count
    end: dict[str, int]  # pool -> index past its largest count
    floors: dict[str, int]  # pool -> its smallest count


@dataclass
class Cand:
    """One job's candidate configurations this round."""

    view: JobView
    weight: float
    table: Table
    cur: tuple[str, int] | None = None  # (pool, count) it runs at now, if on one pool
    keep: float = 1.0  # factor on the value of a configuration other than ``cur``
    mixed: int = 0  # fits no single pool: runs on several at this count
    cfgs: tuple[tuple[str, int, float], ...] = ()  # the table's (pool, count, speedup)
    cfg: int | None = None  # index in cfgs chosen
    ci: int = -1  # index in cfgs of ``cur`` (-1: none)
    wk: float = 1.0  # weight x keep: the value of a speedup elsewhere than ``cur``

    def finish(self) -> None:
        """Set the values' factors (``cur`` and ``keep`` known)."""
        t = self.table
        self.cfgs, self.wk = t.cfgs, self.weight * self.keep
        if self.cur is not None and self.cur[0] in t.first:
            p0, n0 = self.cur
            for i in range(t.first[p0], t.end[p0]):
                if t.cfgs[i][1] == n0:
                    self.ci = i

    def value(self, i: int) -> float:
        """Configuration ``i``'s value: weighted speedup, times ``keep`` unless it is ``cur``."""
        return self.cfgs[i][2] * (self.weight if i == self.ci else self.wk)

    def floor(self, pool: str) -> int:
        return self.table.floors[pool]


def _thin(counts: list[int]) -> list[int]:
    """A job's candidate counts on a pool: its smallest and largest, and the
    powers of two between (the sizes that pack nodes of 2^k GPUs without
    fragments, as Sia's configurations and ElasticFlow's buddy sizes), so
    a decision stays fast where profiles list every count."""
    if len(counts) <= 2:
        return counts
    lo, hi = counts[0], counts[-1]
    return [c for c in counts if c in (lo, hi) or not c & (c - 1)]


def change_cost(snap: Snapshot, same_pool: bool) -> float:
    """Seconds of progress a running job loses when its configuration changes
    (the overhead model the executor charges: a rescale or a migration)."""
    o = snap.overheads
    if o.mode == "stop-resume":
        return o.stop_resume_s if same_pool or o.migrate_s is None else o.migrate_s
    if same_pool:
        return o.pause_s
    return o.migrate_s if o.migrate_s is not None else o.warmup_s + o.pause_s


class TidalHetero(Policy):
    """``hetero``: see GPU types (False: one pool, the default profile).
    ``thresholds``: LAS queues (GPU·s). ``horizon_s``: the restart penalty's
    least horizon. ``round_s``: while a job waits, call again after this long."""

    def __init__(self, hetero: bool = True, thresholds: tuple[float, ...] = (500.0, 10_000.0),
                 horizon_s: float = 600.0, round_s: float = 60.0) -> None:
        self.hetero = bool(hetero)
        self.thresholds = tuple(thresholds)
        self.horizon_s = float(horizon_s)
        self.round_s = float(round_s)
        # the last allocation's GPU types per job, for its placement (the snapshot it was made for)
        self._want: tuple[Snapshot | None, dict[str, tuple[tuple[str, ...], int]]] = (None, {})

    # -- candidates ------------------------------------------------------------------
    def _capacity(self, snap: Snapshot) -> dict[str, int]:
        if self.hetero:
            return dict(cluster_types(snap.cluster).capacity)
        return {ANY: snap.cluster.num_gpus}

    def _table(self, snap: Snapshot, j: JobView, memo: dict) -> Table:
        """The job's :class:`Table` (memoised across jobs of the same shape)."""
        spec = j.spec
        ct = cluster_types(snap.cluster)
        types = allowed_types(spec, snap.cluster)
        key = (spec.model, spec.batch_size, spec.elastic, spec.requested_gpus, spec.min_gpus, spec.max_gpus,
               spec.allowed_gpus, types)
        hit = memo.get(key)
        if hit is not None:
            return hit
        total = snap.cluster.num_gpus
        pools = {t: ct.capacity[t] for t in types} if self.hetero else {ANY: sum(ct.capacity[t] for t in types)}
        rates: dict[str, list[tuple[int, float]]] = {}
        for p, room in pools.items():
            if spec.elastic:
                counts = _thin(useful_counts(snap, j, room)) or ([spec.lo] if spec.lo <= room else [])
            else:
                counts = [n for n in (rigid_count(spec, total),) if n <= room]
            pairs = [(n, typed_rate(snap, spec, p, n)) for n in counts]
            pairs = [(n, r) for n, r in pairs if r > 0]
            if pairs:
                rates[p] = pairs
        base = min((r[0][1] for r in rates.values()), default=1.0)
        cfgs: list[tuple[str, int, float]] = []
        first, end, floors = {}, {}, {}
        for p, pairs in rates.items():
            first[p], floors[p] = len(cfgs), pairs[0][0]
            cfgs += [(p, n, r / base) for n, r in pairs]
            end[p] = len(cfgs)
        memo[key] = table = Table(tuple(cfgs), first, end, floors)
        return table

    def _cand(self, snap: Snapshot, j: JobView, memo: dict, costs: tuple[float, float]) -> Cand:
        spec = j.spec
        table = self._table(snap, j, memo)
        q = bisect_right(self.thresholds, j.attained - j.tags.get("tiresias_base", 0.0))
        c = Cand(j, 2.0 ** -q, table)
        if not table.cfgs:
            c.mixed = rigid_count(spec, snap.cluster.num_gpus) if not spec.elastic else spec.lo
        if j.gpus:
            on = {snap.cluster.gpu_type_of(g) for g in j.gpus} if self.hetero else {ANY}
            if len(on) == 1:
                c.cur = (on.pop(), len(j.gpus))
            horizon = max(self.horizon_s, j.executed)
            cost = min(costs) if c.cur is not None else max(costs)
            c.keep = horizon / (horizon + cost) if c.cur is not None else 1.0
        c.finish()
        return c

    # -- allocation --------------------------------------------------------------------
    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        jobs = schedulable(snap, plan)
        cap = self._capacity(snap)
        costs = (change_cost(snap, True), change_cost(snap, False))
        memo: dict = {}
        cands = [self._cand(snap, j, memo, costs) for j in jobs]
        order = sorted(range(len(cands)), key=lambda i: (
            -cands[i].weight, not jobs[i].gpus, jobs[i].spec.submit_time, jobs[i].job_id))
        free = dict(cap)
        running = self._who_runs(snap, [cands[i] for i in order], free)
        _choose_types(running, free)
        _grow([c for c in running if c.cfg is not None], free)
        want: dict[str, tuple[tuple[str, ...], int]] = {}
        self._want = (snap, want)
        types_of = cluster_types(snap.cluster).capacity
        for c in running:
            spec, jid = c.view.spec, c.view.job_id
            if c.mixed:
                want[jid] = (allowed_types(spec, snap.cluster), c.mixed)
            elif c.cfg is not None:
                pool, n, _ = c.cfgs[c.cfg]
                types = (pool,) if pool != ANY else tuple(t for t in types_of if spec.allows_type(t))
                want[jid] = (types, n)
        plan.allocation.update({jid: n for jid, (_, n) in want.items()})
        if len(want) < len(jobs) and self.round_s > 0:
            plan.wake_at = snap.now + self.round_s

    def _who_runs(self, snap: Snapshot, ordered: list[Cand], free: dict[str, int]) -> list[Cand]:
        """Step 1: in LAS order, jobs whose smallest configuration still fits
        a pool (tentatively taken from the pool with the most room)."""
        out: list[Cand] = []
        tentative: list[tuple[str, int]] = []
        for c in ordered:
            if c.mixed:
                types = allowed_types(c.view.spec, snap.cluster)
                pools = [p for p in free if p in types or p == ANY]
                if sum(free[p] for p in pools) >= c.mixed:
                    need = c.mixed
                    for p in sorted(pools, key=lambda p: -free[p]):
                        use = min(need, free[p])
                        free[p] -= use
                        need -= use
                    out.append(c)
                continue
            fits = [p for p, n in c.table.floors.items() if n <= free[p]]
            if fits:
                p = max(fits, key=lambda p: (free[p] - c.floor(p), p))
                free[p] -= c.floor(p)
                tentative.append((p, c.floor(p)))
                out.append(c)
        for p, n in tentative:  # give the tentative floors back: step 2 places them for good
            free[p] += n
        return out

    def placement(self, snap: Snapshot, plan: Plan) -> None:
        made_for, last = self._want
        want = {jid: w for jid, w in last.items() if plan.allocation.get(jid) == w[1]} if made_for is snap else {}
        for jid, n in plan.allocation.items():
            if jid not in want:  # not from this object's allocation: keep its types
                types = tuple({snap.cluster.gpu_type_of(g) for g in snap.held.get(jid, ())}) or snap.cluster.gpu_types
                want[jid] = (types, n)
        plan.placement = place_typed(snap, want)
        for jid in [j for j in plan.allocation if j not in plan.placement]:
            del plan.allocation[jid]


def _choose_types(running: list[Cand], free: dict[str, int]) -> None:
    """Step 2: each job's smallest configuration on a pool, in decreasing
    regret per GPU; a job that fits nowhere any more waits (``cfg`` None)."""
    keyed = []
    for k, c in enumerate(running):
        if c.mixed:
            continue
        vals = sorted(((c.value(i), p) for p, i in c.table.first.items()), reverse=True)
        second = vals[1][0] if len(vals) > 1 else 0.0
        regret = (vals[0][0] - second) / c.floor(vals[0][1])
        keyed.append((-regret, k, [p for _, p in vals]))
    keyed.sort()
    for _, k, prefs in keyed:
        c = running[k]
        for p in prefs:
            if c.floor(p) <= free[p]:
                free[p] -= c.floor(p)
                c.cfg = c.table.first[p]
                break


def _best_up(c: Cand, free: dict[str, int]) -> tuple[float, int] | None:
    """The job's larger count on its own pool with the largest gain per extra
    GPU that fits ``free`` (None if none gains)."""
    i0 = c.cfg
    p0, n0, _ = c.cfgs[i0]  # type: ignore[index]
    v0 = c.value(i0)  # type: ignore[arg-type]
    room, w, wk, ci = free[p0], c.weight, c.wk, c.ci
    best = None
    for idx in range(i0 + 1, c.table.end[p0]):  # type: ignore[operator]
        _, n, x = c.cfgs[idx]
        if n - n0 > room:
            break
        v = x * (w if idx == ci else wk)
        if v - v0 > 1e-12:
            d = (v - v0) / (n - n0)
            if best is None or d > best[0]:
                best = (d, idx)
    return best


def _grow_within(running: list[Cand], free: dict[str, int], only: str | None = None) -> None:
    """Step 3a: on each pool (or only pool ``only``), apply the best growth
    that fits until none gains; a growth that no longer fits when its turn
    comes is replaced by the job's next best."""
    heap: list[tuple[float, int, int]] = []
    for k, c in enumerate(running):
        if c.cfg is not None and (only is None or c.cfgs[c.cfg][0] == only):
            m = _best_up(c, free)
            if m is not None:
                heap.append((-m[0], k, m[1]))
    heapq.heapify(heap)
    while heap:
        _, k, idx = heapq.heappop(heap)
        c = running[k]
        p0, n0, _ = c.cfgs[c.cfg]  # type: ignore[index]
        n = c.cfgs[idx][1]
        if n - n0 <= free[p0]:
            free[p0] -= n - n0
            c.cfg = idx
        m = _best_up(c, free)
        if m is not None:
            heapq.heappush(heap, (-m[0], k, m[1]))


def _spill(running: list[Cand], free: dict[str, int]) -> bool:
    """Step 3b: the one move of a job to another pool with free GPUs that
    gains most (weighted speedup), applied; the GPUs it leaves go to the
    jobs of its old pool (3a). False if no move gains."""
    best = None
    room = [(p, f) for p, f in free.items() if f > 0]
    for k, c in enumerate(running):
        if c.cfg is None:
            continue
        cfgs, first, end, w, wk, ci = c.cfgs, c.table.first, c.table.end, c.weight, c.wk, c.ci
        p0 = cfgs[c.cfg][0]
        v0 = c.value(c.cfg)
        top = v0 + 1e-12 if best is None else max(v0 + 1e-12, v0 + best[0])
        for p, f in room:
            if p == p0 or p not in first:
                continue
            for idx in range(first[p], end[p]):
                _, n, x = cfgs[idx]
                if n > f:
                    break
                v = x * (w if idx == ci else wk)
                if v > top:
                    top, best = v, (v - v0, k, idx)
    if best is None:
        return False
    _, k, idx = best
    c = running[k]
    p0, n0, _ = c.cfgs[c.cfg]  # type: ignore[index]
    p, n, _ = c.cfgs[idx]
    free[p0] += n0
    free[p] -= n
    c.cfg = idx
    _grow_within(running, free, only=p0)
    _grow_within(running, free, only=p)
    return True


def _grow(running: list[Cand], free: dict[str, int]) -> None:
    """Step 3: growth within pools, then moves to pools with GPUs left (at
    most one per job and round), each followed by growth where it freed GPUs."""
    _grow_within(running, free)
    for _ in range(len(running)):
        if not any(free.values()) or not _spill(running, free):
            break
