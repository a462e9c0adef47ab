"""Elan's fluid admission estimate, event-driven (used only by
:mod:`tidal.scheduler.policies.elan`).

The estimate of Elan's admission test (§VI-C) re-applies the allocation rule
at every completion (:func:`~tidal.scheduler.elan_order.fluid_sum`), and
there every completion updates every live job's remaining work. Here a job
is kept as its completion time at its present speed (its remaining work at
``t`` is ``(fin - t) * speed``; a new speed ``s`` moves it to
``t + (fin - t) * (speed / s)``), in a heap, so a completion costs only the
jobs whose speed it changes.

Which jobs those are follows from the step order
(:class:`~tidal.scheduler.elan_order.StepOrder`): the rule's prefix and its
last steps (the tail) together take the present jobs' steps in the order as
long as each fits in the GPUs left. A completion only returns GPUs, so the
steps taken stay taken and the rule goes on from the first step not taken:
the jobs whose speed changes are those whose steps it now takes. When a step
does not fit while GPUs are left, the rule's tail re-runs its heap with
capped steps; this module does not follow that case and reports it (the
policy then runs the exact estimate). Once every present job's steps are
taken no speed changes again, and the completion times left are summed as
they stand.

The test's two runs (w started now; w waiting for the first completion) are
run side by side as in :mod:`tidal.scheduler.elan_pair`: while they hold the
same jobs the rule is followed once for both, and each run moves its own
clock and the speeds that change; where their completions differ each run
goes on alone until they hold the same jobs again.

The arithmetic is not the exact loop's (floats differ in the last bits, and
jobs that end within the loop's tolerance of one another end one after the
other here), so the policy trusts these sums only when they decide the test
by a wide margin (:func:`decided`).

Both runs, from their starts on, are also a compiled kernel
(``kernels.fast.elan_runs``): the same steps in the same order, so the same
sums to the last bit; these Python lines are its fallback and reference.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import NamedTuple, Sequence

import numpy as np

from tidal.scheduler import kernels
from tidal.scheduler.elan_order import StepOrder

MARGIN = 1e-7  # relative gap between the two sums below which the exact estimate decides


class Capped(Exception):
    """The rule's tail needs capped steps: not followed here."""


class _Alloc:
    """The allocation side of a run (shared by both runs while they agree):
    the jobs present, the GPUs each one gets and its speed there, the first
    step not taken, the GPUs left, the live count."""

    __slots__ = ("present", "held", "spd", "ptr", "left", "live")

    def __init__(self, present: list[bool], held: list[int], spd: list[float], ptr: int, left: int,
                 live: int) -> None:
        self.present, self.held, self.spd, self.ptr, self.left, self.live = present, held, spd, ptr, left, live

    def copy(self) -> _Alloc:
        return _Alloc(self.present.copy(), self.held.copy(), self.spd.copy(), self.ptr, self.left, self.live)

    def same(self, o: _Alloc) -> bool:
        """The same jobs at the same counts (so at the same speeds: a job's
        speed is its rate at the count it holds)."""
        return self.live == o.live and self.left == o.left and self.held == o.held and self.present == o.present


class Start(NamedTuple):
    """A run at its start, as arrays (read only): each job's completion
    time at its speed, the jobs present, the GPUs each gets and its speed
    there; the first step not taken, the GPUs left, the live count and the
    sum so far."""

    fin: np.ndarray
    present: np.ndarray
    held: np.ndarray
    spd: np.ndarray
    ptr: int
    left: int
    live: int
    acc: float


class _Run:
    """One run's clocks: each job's completion time at its present speed,
    the heap of completion times, the sum so far."""

    __slots__ = ("fin", "heap", "acc", "al", "result")

    def __init__(self, start: Start) -> None:
        fin, idx = start.fin, np.flatnonzero(start.present)
        at = fin[idx]
        by = np.argsort(at, kind="stable")  # a sorted list is a heap
        self.heap = list(zip(at[by].tolist(), idx[by].tolist()))
        self.fin = fin.tolist()
        self.al = _Alloc(start.present.tolist(), start.held.tolist(), start.spd.tolist(), start.ptr, start.left,
                         start.live)
        self.acc = start.acc
        self.result: float | None = None

    def peek(self) -> tuple[float, int]:
        """The next completion (stale heap entries dropped)."""
        heap, fin, present = self.heap, self.fin, self.al.present
        while heap:
            t, x = heap[0]
            if present[x] and fin[x] == t:
                return t, x
            heapq.heappop(heap)
        return math.inf, -1

    def quiet_sum(self) -> float:
        """The sum once no speed changes: the completion times as they stand."""
        return self.acc + sum(itertools.compress(self.fin, self.al.present))


def decided(with_w: float, without: float) -> bool | None:
    """Elan's test on the two sums (``with_w <= without * (1 + 1e-9)``), or
    None when they are within :data:`MARGIN` of that bound."""
    bound = without * (1 + 1e-9)
    if not (math.isfinite(with_w) and math.isfinite(bound)) or abs(with_w - bound) <= MARGIN * abs(bound):
        return None
    return with_w <= bound


def event_pair(order: StepOrder, members: Sequence[int], w: int, total: int,
               shrink_cost: float) -> tuple[float, float] | None:
    """``(fluid_sum(order, members + [w], total, None, c), fluid_sum(order,
    members, total, w, c))`` up to rounding (module docstring), or None
    where the rule's tail needs capped steps. ``order.positive`` must hold."""
    mask = np.zeros(len(order.jobs), dtype=bool)
    mask[list(members)] = True
    with_w = mask.copy()
    with_w[w] = True
    try:
        a = _start(order, with_w, total, shrink_cost)
        b = _start_late(order, mask, w, total, shrink_cost)
    except Capped:
        return None
    fast = kernels.fast
    got = NotImplemented if fast is None else fast.elan_runs(order.step_columns(), a, b)
    if got is NotImplemented:
        return _follow(order, _Run(a), _Run(b))
    if got is None:
        return None
    acc_a, rest_a, acc_b, rest_b = got  # a run's sum: acc, plus the times of the jobs left (_Run.quiet_sum)
    return acc_a + sum(rest_a or ()), acc_b + sum(rest_b or ())


def _follow(order: StepOrder, a: _Run, b: _Run) -> tuple[float, float] | None:
    """Both runs from their starts to their sums (None: capped steps)."""
    try:
        _alone(order, a)  # b has had its first completion, where w joined
        while a.result is None or b.result is None:
            if a.result is None and b.result is None and a.al.same(b.al):
                a.al.ptr = max(a.al.ptr, b.al.ptr)
                b.al = a.al
                _together(order, a, b)  # returns done, or with b.al a copy where they differ
            for r in (a, b):
                if r.result is None:
                    _alone(order, r)
    except Capped:
        return None
    return a.result, b.result  # type: ignore[return-value]


def _together(order: StepOrder, a: _Run, b: _Run) -> None:
    """Completions of both runs while they end the same job next (one
    :func:`_event` for both, written out with :func:`_fit` inline; the
    allocation and the speeds are shared, so a new speed's ratio is computed
    once for both); on a different job, ``b`` gets its own copy of the
    allocation."""
    al = a.al
    present, held, sp = al.present, al.held, al.spd
    oj, on, oc, os_ = order.oj, order.on, order.oc, order.os
    end = len(oj)
    ha, fa, hb, fb = a.heap, a.fin, b.heap, b.fin
    pop, push = heapq.heappop, heapq.heappush
    ptr, left, live, acc_a, acc_b = al.ptr, al.left, al.live, a.acc, b.acc
    while ptr < end:
        ta, xa = pop(ha)
        while not present[xa] or fa[xa] != ta:
            ta, xa = pop(ha)
        tb, xb = pop(hb)
        while not present[xb] or fb[xb] != tb:
            tb, xb = pop(hb)
        if xa != xb:
            push(ha, (ta, xa))
            push(hb, (tb, xb))
            break
        acc_a += ta
        acc_b += tb
        present[xa] = False
        live -= 1
        if not live:
            a.result, b.result = acc_a, acc_b
            break
        left += held[xa]
        held[xa] = 0
        moved = {}
        while ptr < end:  # the steps that now fit; their jobs' new speeds, in both runs
            y = oj[ptr]
            if present[y]:
                n = on[ptr]
                if n > left:
                    if left:
                        raise Capped
                    break
                held[y] = oc[ptr]
                left -= n
                s = os_[ptr]
                q = sp[y] / s
                sp[y] = s
                fa[y] = ta + (fa[y] - ta) * q
                fb[y] = tb + (fb[y] - tb) * q
                moved[y] = None
            ptr += 1
        for y in moved:  # one heap entry per job moved (its earlier ones are stale)
            push(ha, (fa[y], y))
            push(hb, (fb[y], y))
    else:
        a.result = acc_a + sum(itertools.compress(fa, present))
        b.result = acc_b + sum(itertools.compress(fb, present))
    al.ptr, al.left, al.live, a.acc, b.acc = ptr, left, live, acc_a, acc_b
    if a.result is None:
        b.al = al.copy()


def _alone(order: StepOrder, r: _Run) -> None:
    """One completion of run ``r`` by itself."""
    al = r.al
    if al.ptr >= len(order.oj):
        r.result = r.quiet_sum()
        return
    t, x = r.peek()
    heapq.heappop(r.heap)
    r.acc += t
    _event(order, al, r, t, x)
    if not al.live:
        r.result = r.acc


def _scratch(order: StepOrder, mask: np.ndarray, lows: int, total: int) -> tuple[np.ndarray, int, int]:
    """The rule for the jobs in ``mask``: each one's count index, the first
    step not taken and the GPUs left (raises :class:`Capped`)."""
    pos, ptr, free = order.prefix_np(mask, total - lows)
    if 0 < free < order.lookahead:
        oj, ot, on, end = order.oj, order.ot, order.on, len(order.oj)
        while ptr < end:
            x = oj[ptr]
            if mask[x]:
                if on[ptr] > free:
                    if free:
                        raise Capped
                    break
                pos[x] = ot[ptr]
                free -= on[ptr]
            ptr += 1
    return pos, ptr, free


def _begin(order: StepOrder, mask: np.ndarray, total: int, cost: float) -> tuple:
    """The rule for the jobs in ``mask`` at time 0 (:func:`_scratch`): each
    one's count index, the first step not taken, the GPUs left, the sum of
    min_res, the speeds, the remaining work with the shrink cost charged to
    running jobs that start below the GPUs they hold, and the completion
    times at those speeds. Read-only arrays, kept on the order for the next
    test (where the admitted set grew by ``w``, or stayed: the same jobs)."""
    key = (mask.tobytes(), total, cost)
    hit = order.begun.get(key)
    if hit is not None:
        return hit
    lows = int(order.lows_np[mask].sum())
    pos, ptr, left = _scratch(order, mask, lows, total)
    idx = np.arange(len(mask))
    spd = order.rate2d[idx, pos]
    rem = np.where(mask, order.rem_np, math.inf)
    squeezed = mask & (order.counts2d[idx, pos] < order.size_np)
    rem += np.where(squeezed, cost * spd, 0.0)
    if len(order.begun) >= 4:
        order.begun.clear()
    hit = order.begun[key] = (pos, ptr, left, lows, spd, rem, rem / spd)
    return hit


def _held(order: StepOrder, mask: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The GPUs each job in ``mask`` gets at count indexes ``pos`` (others: 0)."""
    return np.where(mask, order.counts2d[np.arange(len(mask)), pos], 0)


def _start(order: StepOrder, mask: np.ndarray, total: int, cost: float) -> Start:
    """The run with every job in ``mask`` started at time 0."""
    pos, ptr, left, lows, spd, rem, fin = _begin(order, mask, total, cost)
    return Start(fin, mask, _held(order, mask, pos), spd, ptr, left, int(np.count_nonzero(mask)), 0.0)


def _start_late(order: StepOrder, mask: np.ndarray, w: int, total: int, cost: float) -> Start:
    """The run where ``w`` waits (the others: ``mask``), after its first
    completion (numpy: no heap needed before it), where ``w`` joins (raises
    :class:`Capped` if its min_res does not fit then, a case not followed
    here)."""
    pos, ptr, left, lows, spd, rem, fin = _begin(order, mask, total, cost)
    x = int(np.argmin(fin))  # the heap's first: the earliest, then the smaller index
    t = float(fin[x])
    live = int(np.count_nonzero(mask))
    mask = mask.copy()
    mask[x] = False
    lows += order.lows[w] - order.lows[x]
    if lows > total:
        raise Capped
    mask[w] = True
    rem = rem - spd * t
    rem[w], rem[x] = order.jobs[w].remaining, math.inf
    pos, ptr, left = _scratch(order, mask, lows, total)
    spd = order.rate2d[np.arange(len(mask)), pos]
    return Start(t + rem / spd, mask, _held(order, mask, pos), spd, ptr, left, live, t)


def _fit(order: StepOrder, present: list[bool], held: list[int], ptr: int,
         left: int) -> tuple[dict[int, float], int, int]:
    """The rule's steps that fit in ``left`` free GPUs, from ``ptr`` on:
    (each stepping job's new speed, the next step, the GPUs left); the jobs'
    GPU counts are written to ``held``. Raises :class:`Capped` where a step
    needs more GPUs than are left while some are free."""
    oj, on, oc, os_, end = order.oj, order.on, order.oc, order.os, len(order.oj)
    new = {}
    while ptr < end:
        y = oj[ptr]
        if present[y]:
            n = on[ptr]
            if n > left:
                if left:
                    raise Capped
                break
            held[y] = oc[ptr]
            new[y] = os_[ptr]
            left -= n
        ptr += 1
    return new, ptr, left


def _event(order: StepOrder, al: _Alloc, r: _Run, t: float, x: int) -> None:
    """Job ``x`` ends in run ``r`` at ``t``: the rule takes the steps that
    now fit, and their jobs get their new speeds (a completion time moves by
    the ratio of the old speed to the new)."""
    present, held, spd = al.present, al.held, al.spd
    present[x] = False
    al.live -= 1
    left = al.left + held[x]
    held[x] = 0
    fin, heap = r.fin, r.heap
    new, al.ptr, al.left = _fit(order, present, held, al.ptr, left)
    for y, s in new.items():
        fin[y] = f = t + (fin[y] - t) * (spd[y] / s)
        spd[y] = s
        heapq.heappush(heap, (f, y))
