"""The free-GPU timeline and minimum satisfactory shares (ElasticFlow §4.2).

Time after ``now`` is a list of intervals with a number of free GPUs
(:class:`Timeline`). A job's :class:`Levels` are the GPU counts it may get
(buddy sizes) and its progress rate at each. :func:`fill` is Algorithm 1's
progressive filling: the smallest cap whose filling ``min(cap, free(t))``
finishes the job's remaining work by its deadline, net of the progress every
change of count costs (:class:`Costs`, from the overhead model); :func:`commit`
reserves the resulting :class:`Share`. A share is stored between scheduling
rounds as absolute-time :data:`Segments`, which :func:`commit_segments` and
:func:`reserve_all` put back on a new timeline and :func:`deliverable` checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tidal.core.overhead import OverheadModel

EPS = 1e-6  # iterations of slack on every "finishes in time" test
_MIN = np.minimum.reduce  # ndarray.min without its Python-level wrapper


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
    steady: bool = False  # ``cap`` GPUs in every interval (fill's fast path)


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
    rem = remaining * (1 + 1e-9) + EPS
    counts, rates = lv.count_list, lv.rate_list
    r_held = lv.rate_of(held)
    dead = extra_dead + margin
    for x in range(1, len(counts)):
        c, r = counts[x], rates[x]
        loss = first_loss(c, r, held, r_held, started, costs) + dead * r
        finish = now + (rem + loss) / r
        if finish > horizon:
            continue
        p = max(int(t.searchsorted(tl.release(finish), "left")), 1)
        if _MIN(free[:p]) >= c:
            k = max(int(t.searchsorted(finish, "right")) - 1, 0)
            return Share(c, np.full(k + 1, c, dtype=np.int64), finish, True)
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
    need = remaining * (1 + 1e-9) + EPS + margin * lv.rates[1:]
    ok = cum[:, -1] >= need
    if not ok.any():
        return None
    row = int(np.argmax(ok))
    c = cum[row]
    k = min(int(np.searchsorted(c, need[row], side="left")), m - 1)
    r = rate[row, k]
    finish = ends[k] - (c[k] - need[row]) / r if r > 0 else ends[k]
    return Share(int(lv.counts[row + 1]), alloc[row, : k + 1].copy(), max(finish, float(t[0])))


def commit(tl: Timeline, share: Share) -> None:
    """Reserve ``share`` on the timeline until the slot boundary after it ends."""
    _reserve(tl, share, tl.release(share.finish))


def _reserve(tl: Timeline, share: Share, release: float) -> None:
    """:func:`commit` with the share's release time given."""
    alloc = share.alloc
    k = len(alloc) - 1
    t, free = tl.t, tl.free
    p = int(t.searchsorted(release, "left"))
    n = len(t)
    if p == n or t[p] != release:
        p = max(p, k + 1)
        if p == n or t[p] != release:  # a new breakpoint at ``p``
            t2 = np.empty(n + 1, dtype=t.dtype)
            t2[:p] = t[:p]
            t2[p] = release
            t2[p + 1 :] = t[p:]
            f2 = np.empty(n + 1, dtype=free.dtype)
            f2[:p] = free[:p]
            f2[p] = free[p - 1]
            f2[p + 1 :] = free[p:]
            t, free = t2, f2
    if share.steady:  # the same count all along
        free[: max(k, p)] -= share.cap
    else:
        free[:k] -= alloc[:k]
        free[k:p] -= alloc[k]
    tl.t, tl.free = t, free


Segments = tuple[tuple[float, int], ...]  # (start time, GPUs); the last one has 0 GPUs


def share_segments(tl: Timeline, share: Share) -> Segments:
    """A share as absolute-time segments, ending at its release (slot-aligned)."""
    return _segments(tl, share, tl.release(share.finish))


def take_share(tl: Timeline, share: Share) -> Segments:
    """:func:`share_segments` of ``share``, then :func:`commit` it."""
    release = tl.release(share.finish)
    segs = _segments(tl, share, release)
    _reserve(tl, share, release)
    return segs


def _segments(tl: Timeline, share: Share, release: float) -> Segments:
    """:func:`share_segments` with the share's release time given."""
    if share.steady:
        return ((float(tl.t[0]), int(share.cap)), (release, 0))
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
        if len(segs) == 2:  # the common case: one count, then the release
            (start, c), (end, _) = segs
            if c > 0 and end > now:
                starts.append(now if now > start else start)  # max(start, now)
                ends.append(end)
                counts.append(c)
            continue
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
    # GPUs taken from each breakpoint on (sums of whole numbers: exact in floats)
    cnt = np.array(counts, dtype=np.float64)
    m = len(bp) + 1
    delta = np.bincount(bp.searchsorted(a), cnt, m) - np.bincount(bp.searchsorted(b), cnt, m)
    free = int(tl.free[0]) - np.cumsum(delta.astype(np.int64))[: len(bp)]
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
