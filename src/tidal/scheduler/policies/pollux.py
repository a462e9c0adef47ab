"""Pollux (Qiao et al., OSDI'21, §4): goodput-optimised, co-adaptive scheduling.

Each round Pollux picks the allocation ``A`` that maximises the cluster-wide
fitness (§4.2)

    FITNESS_p(A) = ( sum_j w_j * SPEEDUP_j(A_j)^p / sum_j w_j )^(1/p)

with ``SPEEDUP_j`` the job's goodput at its best batch on ``A_j`` over its
goodput on one GPU at its best batch (§4.1; :mod:`tidal.scheduler.goodput`)
and ``p = -1`` by default (a harmonic mean: fairness-weighted, no job is
starved for a slightly higher sum). Every job that is re-allocated pays the
re-allocation penalty of §4.2: its speedup is scaled by
``(T_j - R_j * delta) / (T_j + delta)`` (``T_j`` its age, ``R_j`` the
re-allocations it had, ``delta`` the restart delay), so a young or often
moved job is moved less. A job's allocation grows to at most ``growth`` x
the most GPUs it has held (§4.2: limits exploration of an unmeasured
throughput model; at least one node's worth here, as Pollux lets a job reach
a full node). The batch of each allocated job is the one that maximises its
goodput on the GPUs it gets (what Pollux's agent picks, §4.1), handed to the
executor in ``Plan.batch``.

Search: Pollux uses a genetic algorithm; here a deterministic greedy does the
same job within the latency budget. With ``p < 0`` a job without GPUs has
fitness ``-inf``, so first every job gets one GPU while GPUs last (jobs
holding GPUs first, then by submission time), then the remaining GPUs go,
one move at a time, to the job whose next candidate count raises the fitness
most per extra GPU (looking ahead over all its candidate counts, so a step
across a node boundary or back to an unpenalised count is found). Candidate
counts: 1 .. one node, then whole nodes (2, 3, 4, 6, 8, 12, 16, 24, ... nodes).

Jobs without goodput data (no :class:`~tidal.scheduler.goodput.GoodputProfile`)
are scheduled the same way on their throughput speedup at a fixed batch.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

from tidal.scheduler.api import JobView, Plan, Policy, Snapshot, schedulable
from tidal.scheduler.goodput import best_reported, local_batch_throughput, phi_bucket, reported_noise

_MAX = "pollux_max"  # tag: most GPUs the job has held
_MOVES = "pollux_moves"  # tag: re-allocations so far


def candidate_counts(cap: int, gpus_per_node: int, lo: int = 1) -> list[int]:
    """GPU counts a job is offered up to ``cap``: every count within one node,
    then whole nodes at 2, 3, 4, 6, 8, 12, 16, 24, ... nodes (powers of two and
    1.5 x powers of two)."""
    out = list(range(max(lo, 1), min(cap, gpus_per_node) + 1))
    k = 2
    while k * gpus_per_node <= cap:
        if k * gpus_per_node >= lo:
            out.append(k * gpus_per_node)
        k = k * 3 // 2 if k & (k - 1) == 0 else k * 4 // 3  # 2, 3, 4, 6, 8, 12, ...
    return out


def grow(tables: dict[str, tuple[Sequence[int], Sequence[float]]], base: dict[str, int], free: int,
         order: Sequence[str]) -> dict[str, int]:
    """Greedy ascent: ``tables[j] = (counts, values)`` (counts ascending,
    ``values`` the objective's term at each); from ``base`` (each job at one
    of its counts), repeatedly move the job whose best next count raises its
    value most per extra GPU, while ``free`` GPUs last and some move gains.
    Ties go to the job earlier in ``order``. Returns the new counts."""
    rank = {jid: i for i, jid in enumerate(order)}
    alloc = dict(base)
    heap: list[tuple[float, int, str, int]] = []

    def push(jid: str) -> None:
        counts, values = tables[jid]
        cur = alloc[jid]
        i = counts.index(cur)
        best, best_k = 0.0, -1
        for k in range(i + 1, len(counts)):
            extra = counts[k] - cur
            if extra > free:
                break
            gain = (values[k] - values[i]) / extra
            if gain > best * (1 + 1e-12) + 1e-15:
                best, best_k = gain, k
        if best_k >= 0:
            heapq.heappush(heap, (-best, rank[jid], jid, counts[best_k]))

    for jid in order:
        if jid in alloc:
            push(jid)
    while heap and free > 0:
        _, _, jid, target = heapq.heappop(heap)
        extra = target - alloc[jid]
        if extra > free:  # the pool shrank since it was pushed: look again within what is left
            push(jid)
            continue
        alloc[jid] = target
        free -= extra
        push(jid)
    return alloc


def _live_speedups(prof, model: str, counts: Sequence[int], phi: float, m0: int, top: int) -> list[float]:  # type: ignore[no-untyped-def]
    """SPEEDUP of a live job at each count: its best goodput there (the
    profile's per-GPU speed at each local batch, the job's reported noise
    scale) over its best on one GPU."""
    def best(k: int) -> float:
        return best_reported(lambda b: local_batch_throughput(prof, model, b, k), phi, m0, top)[1]

    one = best(1)
    return [best(k) / one if one > 0 else 0.0 for k in counts]


class Pollux(Policy):
    """``p``: the fitness exponent (-1: harmonic mean). ``restart_s``: the
    restart delay ``delta`` of the re-allocation penalty. ``growth``: a job
    may get at most this times the most GPUs it has held. ``slot``: the
    scheduling interval (a plan asks to be re-run after it)."""

    name = "pollux"

    def __init__(self, p: float = -1.0, restart_s: float = 30.0, growth: float = 2.0, slot: float = 60.0) -> None:
        if p == 0 or p > 1:
            raise ValueError(f"p must be < 0 or in (0, 1], got {p}")
        self.p = float(p)
        self.restart_s = float(restart_s)
        self.growth = float(growth)
        self.slot = float(slot) if slot > 0 else 60.0
        self._memo: dict[str, tuple] = {}  # job id -> (spec, key, its speedup curve)
        self._shared: dict[tuple, tuple] = {}  # counts and plain-profile speedups, shared by alike jobs

    # -- speedups ------------------------------------------------------------
    def _curve(self, snap: Snapshot, j: JobView, gpn: int) -> tuple[list[int], list[float], list[int]]:
        """(counts, SPEEDUP, best batch; 0 = keep the batch) of one job, only
        counts with a positive speedup; memoised per job while its noise-scale
        bucket, count cap and size stay (a cache: the same numbers without it)."""
        spec = j.spec
        total = snap.cluster.num_gpus
        prof = snap.profiles
        owns = getattr(prof, "owns", None)
        gp = prof.goodput if owns is not None and owns(spec) else None  # type: ignore[attr-defined]
        batch = j.batch or spec.batch_size
        phi = gp.phi(spec.model, j.done, batch) if gp is not None else 0.0  # what the job's agent measures now
        live = reported_noise(j.tags) if gp is None else None  # a live job's own measured noise scale
        held = max(j.tags.get(_MAX, 0), j.size)
        cap = min(spec.hi(total), max(int(self.growth * held), gpn)) if spec.elastic else 0
        key = (cap, j.size, gpn, total, id(prof),
               phi_bucket(phi) if gp is not None else (phi_bucket(live[0]), live[1:]) if live else batch)
        hit = self._memo.get(spec.job_id)
        if hit is not None and hit[0] is spec and hit[1] == key:
            return hit[2]
        counts = self._counts(spec, cap, gpn, total, j.size)
        if gp is not None:
            one = gp.best(spec.model, 1, phi)[1]
            bests = [gp.best(spec.model, k, phi) for k in counts]
            speedups, batches = [b[1] / one if one > 0 else 0.0 for b in bests], [b[0] for b in bests]
        elif live is not None:  # the job picks its batch itself (the runtime's goodput scaling): rate its best
            speedups, batches = _live_speedups(prof, spec.model, counts, *live), [0] * len(counts)
        else:  # alike jobs (model, batches, counts) share the curve
            skey = ("rate", id(prof), spec.model, batch, spec.batch_size, counts)
            shared = self._shared.get(skey)
            if shared is None or shared[0] is not prof:  # (an id may be reused by a later profile)
                one = snap.progress_rate(j, 1) or 1.0
                shared = self._shared[skey] = (prof, tuple(snap.progress_rate(j, k) / one for k in counts))
            speedups, batches = list(shared[1]), [0] * len(counts)
        keep = [i for i, x in enumerate(speedups) if x > 0]
        out = ([counts[i] for i in keep], [speedups[i] for i in keep], [batches[i] for i in keep])
        if len(self._memo) > 100_000:
            self._memo.clear()
        if len(self._shared) > 50_000:
            self._shared.clear()
        self._memo[spec.job_id] = (spec, key, out)
        return out

    def _counts(self, spec, cap: int, gpn: int, total: int, size: int) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
        """The counts a job is offered (its allowed ones among
        :func:`candidate_counts`, and the count it holds), shared by jobs
        with the same limits."""
        key = ("counts", spec.elastic, cap, gpn, total, size, spec.lo, spec.max_gpus, spec.allowed_gpus,
               spec.requested_gpus)
        hit = self._shared.get(key)
        if hit is None:
            if not spec.elastic:
                counts = spec.counts(total)
            else:
                counts = [k for k in candidate_counts(cap, gpn, spec.lo) if spec.can_run_at(k)]
                if size and size not in counts and spec.can_run_at(size):
                    counts = sorted(set(counts) | {size})
            hit = self._shared[key] = tuple(counts)
        return hit

    def _penalty(self, snap: Snapshot, j: JobView) -> float:
        """Pollux §4.2's re-allocation factor (T_j - R_j d) / (T_j + d)."""
        age = max(snap.now - j.spec.submit_time, 0.0)
        moves = j.tags.get(_MOVES, 0)
        return max(age - moves * self.restart_s, 0.0) / (age + self.restart_s) if self.restart_s > 0 else 1.0

    def _term(self, s: float) -> float:
        """A job's term of the objective (maximised): ``sign(p) * s^p``."""
        if s <= 0:
            return -math.inf if self.p < 0 else 0.0
        return -(s ** self.p) if self.p < 0 else s ** self.p

    def _table(self, snap: Snapshot, j: JobView, gpn: int) -> tuple[list[int], list[float], list[int]]:
        """Counts (0 first), objective terms (the re-allocation penalty on
        every count but the current one) and best batches of one job."""
        counts, speedups, batches = self._curve(snap, j, gpn)
        pen, size, term = self._penalty(snap, j), j.size, self._term
        terms = [term(x if c == size else x * pen) for c, x in zip(counts, speedups)]
        return [0] + counts, [term(0.0)] + terms, [0] + batches

    # -- the policy ---------------------------------------------------------------
    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        gpn = snap.cluster.max_gpus_per_node
        jobs = schedulable(snap, plan)
        jobs.sort(key=lambda j: (not j.gpus, j.spec.submit_time, j.job_id))
        tables, batches, base = {}, {}, {}
        free = snap.cluster.num_gpus
        finite = self.p < 0
        for j in jobs:
            counts, terms, bs = self._table(snap, j, gpn)
            if len(counts) < 2:
                continue
            jid = j.job_id
            tables[jid] = (counts, terms)
            batches[jid] = bs
            base[jid] = 0
            if finite and counts[1] <= free:  # p < 0: a job without GPUs is -inf, so one count each first
                base[jid] = counts[1]
                free -= counts[1]
        alloc = grow({jid: (t[0], [x if x > -math.inf else -1e300 for x in t[1]]) for jid, t in tables.items()},
                     base, free, [j.job_id for j in jobs if j.job_id in tables])
        views = snap.view_of
        for jid, n in alloc.items():
            if n <= 0:
                continue
            plan.allocation[jid] = n
            b = batches[jid][tables[jid][0].index(n)]
            j = views[jid]
            if b and b != (j.batch or j.spec.batch_size):
                plan.batch[jid] = b
            tags = {}
            if n > j.tags.get(_MAX, 0):
                tags[_MAX] = n
            if n != j.size:
                tags[_MOVES] = j.tags.get(_MOVES, 0) + 1
            if tags:
                plan.tags[jid] = tags
        for j in jobs:
            if j.gpus and j.job_id not in plan.allocation:
                plan.tags[j.job_id] = {_MOVES: j.tags.get(_MOVES, 0) + 1}
        if jobs:
            plan.wake_at = snap.now + self.slot
