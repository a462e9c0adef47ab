"""The two fluid estimates of Elan's admission test, run side by side.

Used only by :mod:`tidal.scheduler.policies.elan`. The test (§VI-C) compares
the fluid estimate with the new job w started now against the one where w
waits (:func:`~tidal.scheduler.elan_order.fluid_sum` for each). After the
first completion both runs hold the same jobs almost all the time, and the
allocation rule's result depends only on the job set. So while the sets agree
the rule is evaluated once for both runs and numpy updates both runs'
remaining work with one call per step (two rows); where a completion differs,
each run goes on alone until the sets agree again. Every per-job operation is
the one :func:`fluid_sum` does, in the same order, so both sums are
bit-identical to two separate calls.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

import numpy as np

from tidal.scheduler.elan_order import StepOrder, fluid_sum, quiet_sum, restart

_NONE: dict[int, int] = {}


class _Run:
    """One fluid run's state (the locals of :func:`fluid_sum`)."""

    __slots__ = ("members", "present", "pos", "ptr", "free", "lows", "live", "late", "first", "t", "acc", "spd",
                 "result")

    def __init__(self, order: StepOrder, rem: np.ndarray, members: list[int], total: int, late: int | None) -> None:
        n = len(order.jobs)
        self.members, self.present, self.spd = members, [False] * n, np.ones(n)
        for x in members:
            self.present[x], rem[x] = True, order.jobs[x].remaining
        self.live, self.lows = len(members), sum(order.lows[x] for x in members)
        self.pos, self.ptr, self.free = restart(order, self.present, total - self.lows, self.spd)
        self.late, self.first, self.t, self.acc = late, True, 0.0, 0.0
        self.result: float | None = None

    def same_jobs(self, other: _Run) -> bool:
        """Both runs hold the same jobs with the same allocation state."""
        return (self.result is None and other.result is None and self.late is None and other.late is None
                and not self.first and not other.first and self.live == other.live and self.free == other.free
                and self.lows == other.lows and self.present == other.present and self.pos == other.pos)

    def copy_state(self, other: _Run) -> None:
        """Take ``other``'s allocation state (own copies)."""
        self.present, self.pos, self.spd = other.present.copy(), other.pos.copy(), other.spd.copy()
        self.ptr, self.free, self.lows, self.live = other.ptr, other.free, other.lows, other.live


def fluid_pair(order: StepOrder, members: Sequence[int], w: int, total: int, shrink_cost: float) -> tuple[float, float]:
    """``(fluid_sum(order, members + [w], total, None, c), fluid_sum(order,
    members, total, w, c))``, computed together."""
    if not order.positive:  # a count that does not run: the plain estimates
        return (fluid_sum(order, list(members) + [w], total, None, shrink_cost),
                fluid_sum(order, members, total, w, shrink_cost))
    n = len(order.jobs)
    rem, q, done = np.full((2, n), math.inf), np.empty((2, n)), np.empty((2, n), dtype=bool)
    a = _Run(order, rem[0], list(members) + [w], total, None)
    b = _Run(order, rem[1], list(members), total, w)
    while a.result is None or b.result is None:
        if a.same_jobs(b):
            _together(order, a, b, rem, q, done, total)
            continue
        for i, r in enumerate((a, b)):
            if r.result is None:
                _alone(order, r, rem[i], q[i], done[i], total, shrink_cost)
    return a.result, b.result  # type: ignore[return-value]


def _alone(order: StepOrder, r: _Run, rem: np.ndarray, q: np.ndarray, done: np.ndarray, total: int,
           cost: float) -> None:
    """One completion of run ``r`` by itself (:func:`fluid_sum`'s loop body)."""
    rs, counts, oj, present, pos, spd = order.rs, order.counts, order.oj, r.present, r.pos, r.spd
    end, look = len(oj), order.lookahead
    if r.ptr >= end and r.late is None and not r.first:
        r.result = quiet_sum(rem, spd, order.thr, present, r.t, r.acc)
        return
    extra = _NONE
    if 0 < r.free < look:
        while r.ptr < end and not present[oj[r.ptr]]:
            r.ptr += 1
        extra = order.tail(pos, present, r.ptr, r.free)
        for x, k in extra.items():
            spd[x] = rs[x][k]
    if r.first:
        r.first = False
        for x in r.members:
            j = order.jobs[x]
            if j.running and counts[x][extra.get(x, pos[x])] < j.size:
                rem[x] += cost * spd[x]
    dt = float(np.minimum.reduce(np.divide(rem, spd, out=q)))
    if dt == math.inf:
        r.result = math.inf
        return
    r.t += dt
    np.subtract(rem, np.multiply(spd, dt, out=q), out=rem)
    for x in extra:
        spd[x] = rs[x][pos[x]]
    _settle(order, r, np.less_equal(rem, order.thr, out=done).nonzero()[0].tolist(), rem, total)


def _settle(order: StepOrder, r: _Run, fin: list[int], rem: np.ndarray, total: int) -> None:
    """After a step of run ``r`` alone: the completions ``fin``, the late
    job's start, the prefix moved forward."""
    counts, lowv, present, pos, spd = order.counts, order.lows, r.present, r.pos, r.spd
    for x in fin:
        r.acc += r.t
        present[x], rem[x], spd[x] = False, math.inf, 1.0
        r.live -= 1
        r.free += counts[x][pos[x]]
        r.lows -= lowv[x]
        pos[x] = 0  # as a fresh prefix has it: the runs' states stay comparable
    if r.late is not None and r.lows + lowv[r.late] <= total:
        x, r.late = r.late, None
        present[x], rem[x] = True, order.jobs[x].remaining
        r.live, r.lows = r.live + 1, r.lows + lowv[x]
        r.pos, r.ptr, r.free = restart(order, present, total - r.lows, spd)
    else:
        r.ptr, r.free = order.advance(r.pos, r.present, r.spd, r.ptr, r.free)
    if not r.live:
        r.result = r.acc if r.late is None else math.inf


def _together(order: StepOrder, a: _Run, b: _Run, rem: np.ndarray, q: np.ndarray, done: np.ndarray,
              total: int) -> None:
    """Steps of both runs while they hold the same jobs (``a``'s state serves
    both; ``rem`` row 0 is ``a``'s, row 1 ``b``'s; numpy works on both rows
    as one flat array, the speeds written twice). Returns when they are done,
    or, split at a completion that differs, with each run settled."""
    rs, counts, oj, ot, on, lowv = order.rs, order.counts, order.oj, order.ot, order.on, order.lows
    n, end, look, inf = len(order.jobs), len(order.oj), order.lookahead, math.inf
    present, pos, live, free, lows = a.present, a.pos, a.live, a.free, a.lows
    ptr, t0, t1, acc0, acc1 = max(a.ptr, b.ptr), a.t, b.t, a.acc, b.acc
    spd = np.concatenate((a.spd, a.spd))
    thr0, rf, qf, df = order.thr, rem.ravel(), q.ravel(), done.ravel()
    thr = np.concatenate((thr0, thr0))
    s0, s1, r0, r1, q0, q1 = spd[:n], spd[n:], rf[:n], rf[n:], qf[:n], qf[n:]
    divide, least_at, subtract, multiply, less_equal = (np.divide, np.minimum.reduceat, np.subtract, np.multiply,
                                                        np.less_equal)
    f0 = f1 = _NONE
    halves = np.array([0, n])
    while live:
        if ptr >= end:
            a.result, b.result = _quiet_pair(r0, r1, s0, thr0, present, (t0, t1), (acc0, acc1))
            return
        extra = _NONE
        if 0 < free < look:
            while ptr < end and not present[oj[ptr]]:
                ptr += 1
            extra = order.tail(pos, present, ptr, free)
            for x, k in extra.items():
                spd[x] = spd[x + n] = rs[x][k]
        d0, d1 = least_at(divide(rf, spd, out=qf), halves).tolist()
        if d0 == inf or d1 == inf:  # not at positive rates; as fluid_sum: the sum is inf, the other run goes on
            for x in extra:
                spd[x] = spd[x + n] = rs[x][pos[x]]
            a.result, b.result = (inf if d0 == inf else None), (inf if d1 == inf else None)
            f1 = [-1]
            break
        t0, t1 = t0 + d0, t1 + d1
        multiply(s0, d0, out=q0), multiply(s1, d1, out=q1), subtract(rf, qf, out=rf)
        for x in extra:
            spd[x] = spd[x + n] = rs[x][pos[x]]
        f0, f1 = _rows(less_equal(rf, thr, out=df).nonzero()[0].tolist(), n)
        if f0 != f1:
            break
        for x in f0:
            acc0 += t0
            acc1 += t1
            present[x], rf[x], rf[x + n] = False, inf, inf  # its speed no longer matters: inf stays inf
            live, free, lows = live - 1, free + counts[x][pos[x]], lows - lowv[x]
            pos[x] = 0
        while free >= look and ptr < end:
            x = oj[ptr]
            if present[x]:
                pos[x] = k = ot[ptr]
                spd[x] = spd[x + n] = rs[x][k]
                free -= on[ptr]
            ptr += 1
    a.ptr, a.free, a.lows, a.live, a.t, b.t, a.acc, b.acc = ptr, free, lows, live, t0, t1, acc0, acc1
    a.spd = s0.copy()
    if not live:
        a.result, b.result = acc0, acc1
        return
    b.copy_state(a)
    if f1 and f1[0] < 0:
        return
    _settle(order, a, f0, rem[0], total)
    _settle(order, b, f1, rem[1], total)


def _rows(fin: list[int], n: int) -> tuple[list[int], list[int]]:
    """The finished jobs of each run, from the flat indexes of both rows."""
    if len(fin) == 2 and fin[1] - fin[0] == n:
        return fin[:1], fin[:1]
    k = bisect.bisect_left(fin, n)
    return fin[:k], [x - n for x in fin[k:]]


def _quiet_pair(r0: np.ndarray, r1: np.ndarray, spd: np.ndarray, thr: np.ndarray, present: list[bool],
                t: tuple[float, float], acc: tuple[float, float]) -> tuple[float, float]:
    """:func:`quiet_sum` of both runs (the same jobs and speeds), on one flat
    array while both go on; the last one alone."""
    idx = np.flatnonzero(np.array(present, dtype=bool))
    m, inf = len(idx), math.inf
    rem, spd2, thr2 = np.concatenate((r0[idx], r1[idx])), np.tile(spd[idx], 2), np.tile(thr[idx], 2)
    q, done = np.empty(2 * m), np.empty(2 * m, dtype=bool)
    (t0, t1), (acc0, acc1), live0, live1 = t, acc, m, m
    a0, a1, q0, q1, s0, s1, halves = rem[:m], rem[m:], q[:m], q[m:], spd2[:m], spd2[m:], np.array([0, m])
    while live0 and live1:
        d0, d1 = np.minimum.reduceat(np.divide(rem, spd2, out=q), halves).tolist()
        if d0 == inf or d1 == inf:  # as quiet_sum: that sum is inf; the other run goes on alone
            acc0, live0 = (inf, 0) if d0 == inf else (acc0, live0)
            acc1, live1 = (inf, 0) if d1 == inf else (acc1, live1)
            break
        t0, t1 = t0 + d0, t1 + d1
        np.multiply(s0, d0, out=q0), np.multiply(s1, d1, out=q1), np.subtract(rem, q, out=rem)
        for x in np.less_equal(rem, thr2, out=done).nonzero()[0].tolist():
            if x < m:
                acc0, live0 = acc0 + t0, live0 - 1
            else:
                acc1, live1 = acc1 + t1, live1 - 1
            rem[x] = inf
    if live0:
        acc0 = quiet_sum(a0, s0, thr2[:m], (a0 < inf).tolist(), t0, acc0)
    if live1:
        acc1 = quiet_sum(a1, s1, thr2[m:], (a1 < inf).tolist(), t1, acc1)
    return acc0, acc1
