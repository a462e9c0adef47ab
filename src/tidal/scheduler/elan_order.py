"""Elan's allocation rule evaluated for many job sets of one round, exactly.

Used only by :mod:`tidal.scheduler.policies.elan`. Elan's admission test
(§VI-C) re-applies the allocation rule (min_res to each job, then one step at
a time to the largest marginal gain) at every completion of a fluid estimate.
Here the rule's result for any set S of the round's jobs is read off one
order computed once per round:

* While at least ``lookahead`` GPUs are free, a job's next step does not
  depend on the other jobs, so each job has a fixed sequence of steps. The
  rule's heap merges these sequences: it takes them in the order of
  (-prefix minimum of the job's gains, submit time, job id, step), the
  round's *step order*. For S the rule applies the order restricted to S
  while the free GPUs are at least ``lookahead`` (the *prefix*).
* Below ``lookahead`` free GPUs a step can be cut by the cap: the rest (the
  *tail*) re-runs the rule's heap, fed lazily from the step order (each job's
  next step there is an upper bound of its capped step, so the first of the
  remaining order bounds every job not yet fed).
* Removing a finished job from S only moves the prefix forward, so a fluid
  estimate advances a pointer instead of re-running the rule.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import math
from typing import NamedTuple, Sequence

import numpy as np

EPS = 1e-12


def next_step(
    counts: Sequence[int], rs: Sequence[float], i: int, one: float, cap: int, lookahead: int
) -> tuple[float, int]:
    """The allocation rule's next step from count index ``i``: the best gain
    per GPU and the target index (0: none), at most ``cap`` GPUs."""
    n, r0 = counts[i], rs[i]
    best, target = 0.0, 0
    for k in range(i + 1, len(counts)):
        c = counts[k]
        if c > cap or c - n > lookahead:
            break
        g = (rs[k] - r0) / one / (c - n)
        if g > best + EPS:
            best, target = g, k
    return best, target


class OrderJob(NamedTuple):
    """What the step order needs of one job (from the policy's per-round rates)."""

    job_id: str
    submit: float
    counts: tuple[int, ...]
    rates: tuple[float, ...]  # progress rate at each count
    one: float  # one-GPU rate: gains are in its units
    remaining: float
    running: bool
    size: int  # GPUs held now


def job_steps(j: OrderJob, lookahead: int, memo: dict | None = None) -> list[tuple]:
    """The job's uncapped steps, each (-prefix minimum of the gains, submit
    time, job id, step number, count index after it, its gain, GPUs it adds):
    sorted together, the steps of a job set give the step order."""
    out: list[tuple] = []
    i, eff, s = 0, math.inf, 0
    counts, rates = j.counts, j.rates
    while True:
        hit = None if memo is None else memo.get((j.job_id, i, lookahead))
        if hit is None:
            hit = next_step(counts, rates, i, j.one, counts[i] + lookahead, lookahead)
            if memo is not None:
                memo[(j.job_id, i, lookahead)] = hit
        g, k = hit
        if not k:
            return out
        eff = min(eff, g)
        out.append((-eff, j.submit, j.job_id, s, k, g, counts[k] - counts[i]))
        i, s = k, s + 1


def step_arrays(seq: Sequence[tuple]) -> np.ndarray:
    """A job's steps (:func:`job_steps`) as rows of an array: the sort
    key's first part (-prefix minimum of the gains), the count index after
    the step, its gain, the GPUs it adds (the integers exact as floats).
    They do not depend on the job's submit time or id: jobs of the same
    shape share them."""
    return np.array([(st[0], st[4], st[5], st[6]) for st in seq], dtype=float).reshape(len(seq), 4)


class StepOrder:
    """The round's step order (module docstring) and the rule evaluated on it."""

    def __init__(self, jobs: Sequence[OrderJob], lookahead: int = 8, memo: dict | None = None,
                 steps: Sequence[list[tuple]] | None = None,
                 parts: Sequence[np.ndarray] | None = None) -> None:
        """``steps``: each job's steps (:func:`job_steps`), or ``parts``:
        the same as :func:`step_arrays`; computed when neither is given."""
        self.jobs = list(jobs)
        self.lookahead = lookahead
        ids, submits, counts, rates = (list(c) for c in list(zip(*self.jobs))[:4]) if self.jobs else ([], [], [], [])
        self.index = dict(zip(ids, range(len(ids))))
        self.counts, self.rs = counts, rates
        self.lows = [c[0] for c in counts]
        self.tie = list(zip(submits, ids))
        if parts is None:
            if steps is None:
                steps = [job_steps(j, lookahead, memo) for j in self.jobs]
            parts = [step_arrays(seq) for seq in steps]
        self._grids()
        self._sort(parts)
        self.capped: dict[tuple[int, int, int], tuple[float, int]] = {}  # (job, count index, free) -> step
        self._job_arrays()

    def _grids(self) -> None:
        """Each job's rates and counts by count index as rows of 2-D arrays
        (padded with rate 1 and count 0), and the min_res."""
        n = len(self.jobs)
        lens = np.fromiter(map(len, self.counts), dtype=np.int64, count=n)
        width = int(lens.max()) if n else 1
        rows = np.repeat(np.arange(n), lens)
        cols = np.arange(len(rows)) - np.repeat(np.cumsum(lens) - lens, lens)
        self.rate2d = np.ones((n, width))
        self.rate2d[rows, cols] = np.fromiter(itertools.chain.from_iterable(self.rs), dtype=float, count=len(rows))
        self.positive = bool((self.rate2d > 0).all())  # every count runs (the padding is 1)
        self.counts2d = np.zeros((n, width), dtype=np.int64)
        self.counts2d[rows, cols] = np.fromiter(itertools.chain.from_iterable(self.counts), dtype=np.int64,
                                                count=len(rows))
        self.lows_np = self.counts2d[:, 0].copy() if n else np.zeros(0, dtype=np.int64)

    def _sort(self, parts: Sequence[np.ndarray]) -> None:
        """The step order: the jobs' steps sorted by (-prefix minimum of the
        gains, submit time, job id, step number), as arrays of the job,
        count index after, GPUs added and gain (the lists of these and of
        the GPUs and rate after each step are made when first read)."""
        n = len(self.jobs)
        lens = np.fromiter(map(len, parts), dtype=np.int64, count=n)
        rows = np.concatenate(parts) if n else np.zeros((0, 4))
        job = np.repeat(np.arange(n), lens)
        step = np.arange(len(job)) - np.repeat(np.cumsum(lens) - lens, lens)
        rank = np.empty(n, dtype=np.int64)
        rank[sorted(range(n), key=[t[1] for t in self.tie].__getitem__)] = np.arange(n)
        submit = np.array([t[0] for t in self.tie], dtype=float)
        by = np.lexsort((step, rank[job], submit[job], rows[:, 0]))
        rows = rows[by]
        self.oj_np, self.ot_np, self.on_np = job[by], rows[:, 1].astype(np.int64), rows[:, 3].astype(np.int64)
        self._og_np = rows[:, 2]
        self._lists: dict[str, list] = {}

    def _list(self, name: str) -> list:
        """One of the step lists (``oj``, ``ot``, ``on``, ``og``, ``oc``,
        ``os``), made from the arrays when first read and shared with the
        copies of :meth:`with_jobs`."""
        lists = self._lists
        got = lists.get(name)
        if got is None:
            if name == "oc":
                got = self.counts2d[self.oj_np, self.ot_np].tolist()
            elif name == "os":
                got = self.rate2d[self.oj_np, self.ot_np].tolist()
            else:
                got = getattr(self, f"{name}_np" if name != "og" else "_og_np").tolist()
            lists[name] = got
        return got

    def step_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The steps as arrays (``oj``, ``on``, ``oc``, ``os``: job, GPUs
        added, the job's GPUs and rate after), for the compiled event-driven
        estimate; made once and shared with the copies of :meth:`with_jobs`."""
        got = self._lists.get("columns")
        if got is None:
            got = self._lists["columns"] = (self.oj_np, self.on_np, self.counts2d[self.oj_np, self.ot_np],
                                            self.rate2d[self.oj_np, self.ot_np])
        return got  # type: ignore[return-value]

    oj = property(lambda self: self._list("oj"), doc="The job of each step.")
    ot = property(lambda self: self._list("ot"), doc="The count index after each step.")
    on = property(lambda self: self._list("on"), doc="The GPUs each step adds.")
    og = property(lambda self: self._list("og"), doc="Each step's gain.")
    oc = property(lambda self: self._list("oc"), doc="The job's GPUs after each step.")
    os = property(lambda self: self._list("os"), doc="The job's progress rate after each step.")

    def _job_arrays(self) -> None:
        """The arrays of the jobs' state: remaining work (and the exact
        loop's completion tolerance on it), GPUs held by running jobs."""
        _, _, _, _, _, rem, running, size = zip(*self.jobs) if self.jobs else ((),) * 8
        self.rem_np = np.array(rem, dtype=float)
        self.thr = 1e-9 * np.maximum(1.0, self.rem_np)
        self._running = np.array(running, dtype=bool)
        self.size_np = np.where(self._running, np.array(size, dtype=np.int64), 0)
        self.capped_seen = False  # an event-driven estimate met capped steps (elan_event): the exact one runs
        self.begun: dict[tuple, tuple] = {}  # elan_event's start of a run, by job set: shared by consecutive tests

    def with_jobs(self, jobs: Sequence[OrderJob]) -> StepOrder:
        """This order for the same jobs at another time (their remaining work
        and GPUs held): the job-independent arrays are shared."""
        o = copy.copy(self)
        o.jobs = list(jobs)
        o._job_arrays()
        return o

    def prefix(self, present: np.ndarray, free: int) -> tuple[list[int], int, int]:
        """The prefix for the jobs marked in ``present`` with ``free`` GPUs
        beyond their min_res: each job's count index, the pointer, the GPUs
        still free."""
        pos, ptr, free = self.prefix_np(present, free)
        return pos.tolist(), ptr, free

    def prefix_np(self, present: np.ndarray, free: int) -> tuple[np.ndarray, int, int]:
        """:meth:`prefix` with the count indexes as an array. A job's steps
        come in the order one after another (the sort key's prefix minimum
        does not rise along them, ties go by step number) and each raises its
        count index, so a job's index is that of its last step before the
        pointer."""
        pos = np.zeros(len(self.jobs), dtype=np.int64)
        if free < self.lookahead or not len(self.oj_np):
            return pos, 0, free
        m = present[self.oj_np]
        need = np.where(m, self.on_np, 0)
        before = np.cumsum(need) - need  # GPUs the earlier steps take
        ptr = int(np.searchsorted(before, free - self.lookahead, side="right"))
        last = m[:ptr] & (self._next_step()[:ptr] >= ptr)  # a job's last step before the pointer
        pos[self.oj_np[:ptr][last]] = self.ot_np[:ptr][last]
        return pos, ptr, free - int(need[:ptr].sum())

    def _next_step(self) -> np.ndarray:
        """For each step of the order, the position of the same job's next
        step (the order's length after its last one); computed once."""
        nxt = self.__dict__.get("_nxt")
        if nxt is None:
            oj = self.oj_np
            by_job = np.argsort(oj, kind="stable")  # each job's steps, in order
            nxt = np.full(len(oj), len(oj), dtype=np.int64)
            same = oj[by_job[1:]] == oj[by_job[:-1]]
            nxt[by_job[:-1][same]] = by_job[1:][same]
            self._nxt = nxt
        return nxt

    def advance(self, pos: list[int], present: list[bool], spd: np.ndarray, ptr: int, free: int) -> tuple[int, int]:
        """Move the prefix forward after jobs left ``present`` (their GPUs
        added to ``free``); the jobs that got steps have their new speeds
        written to ``spd``. Returns the new ``(ptr, free)``."""
        oj, ot, on, rs, look = self.oj, self.ot, self.on, self.rs, self.lookahead
        end = len(oj)
        while free >= look and ptr < end:
            x = oj[ptr]
            if present[x]:
                pos[x] = k = ot[ptr]
                spd[x] = rs[x][k]
                free -= on[ptr]
            ptr += 1
        return ptr, free

    def tail(self, pos: list[int], present: list[bool], ptr: int, free: int) -> dict[int, int]:
        """The rule's last steps, with fewer than ``lookahead`` GPUs free: the
        jobs whose count index differs from the prefix, and the new one. While
        every step of the order fits, the heap takes them in order (a capped
        step differs only when its uncapped one does not fit); otherwise the
        heap is re-run (:meth:`_tail_heap`)."""
        out: dict[int, int] = {}
        if free <= 0 or free >= self.lookahead:
            return out
        oj, ot, on = self.oj, self.ot, self.on
        c, end, left = ptr, len(oj), free
        while left > 0 and c < end:
            x = oj[c]
            if present[x]:
                if on[c] > left:
                    return self._tail_heap(pos, present, ptr, free)
                out[x] = ot[c]
                left -= on[c]
            c += 1
        return out

    def _tail_heap(self, pos: list[int], present: list[bool], ptr: int, free: int) -> dict[int, int]:
        """:meth:`tail` by the rule's heap, fed lazily from the step order."""
        out: dict[int, int] = {}
        look = self.lookahead
        oj, ot, og, tie, counts, rs, capped = self.oj, self.ot, self.og, self.tie, self.counts, self.rs, self.capped
        heap: list[tuple[float, float, str, int, int]] = []
        fed: set[int] = set()
        c, end = ptr, len(oj)
        while free > 0:
            while c < end and (not present[oj[c]] or oj[c] in fed):
                c += 1
            if c < end:
                x = oj[c]
                s, jid = tie[x]
                if not heap or (-og[c], s, jid) < heap[0][:3]:
                    fed.add(x)
                    heapq.heappush(heap, (-og[c], s, jid, x, ot[c]))
                    c += 1
                    continue
            if not heap:
                break
            _, s, jid, x, k = heapq.heappop(heap)
            cur = out.get(x, pos[x])
            cs = counts[x]
            need = cs[k] - cs[cur]
            if need <= free:
                out[x], cur = k, k
                free -= need
            key = (x, cur, free)
            hit = capped.get(key)
            if hit is None:
                hit = capped[key] = next_step(cs, rs[x], cur, self.jobs[x].one, cs[cur] + free, look)
            g, k = hit
            if k:
                heapq.heappush(heap, (-g, s, jid, x, k))
        return out

    def allocation(self, members: Sequence[int], total: int) -> list[int]:
        """Count index of each job under the rule for ``members`` (others: 0)."""
        present = np.zeros(len(self.jobs), dtype=bool)
        present[list(members)] = True
        free = total - sum(self.lows[x] for x in members)
        if free < 0:
            raise ValueError("min_res of the started jobs exceed the cluster")
        pos, ptr, free = self.prefix(present, free)
        for x, k in self.tail(pos, present.tolist(), ptr, free).items():
            pos[x] = k
        return pos


def fluid_sum(order: StepOrder, members: Sequence[int], total: int, late: int | None, shrink_cost: float) -> float:
    """Sum of the completion times (s from now) of ``members`` when the rule is
    re-applied at every completion; ``late`` joins at the first completion
    after which its min_res fits beside the others'. A running job that starts
    below the GPUs it holds pays ``shrink_cost``. The per-job arithmetic is
    the original loop's, element by element (numpy), so the sums are identical;
    once no step is left
    (:func:`quiet_sum`) only the completions remain."""
    n = len(order.jobs)
    present = [False] * n
    rem, spd = np.full(n, math.inf), np.ones(n)
    for x in members:
        present[x] = True
        rem[x] = order.jobs[x].remaining
    live, lowv = len(members), order.lows
    lows = sum(lowv[x] for x in members)
    pos, ptr, free = restart(order, present, total - lows, spd)
    t = acc = 0.0
    first = True
    rs, counts, thr, oj, look = order.rs, order.counts, order.thr, order.oj, order.lookahead
    end, positive, q, done = len(oj), order.positive, np.empty(n), np.empty(n, dtype=bool)
    divide, least, subtract, multiply, less_equal = np.divide, np.minimum.reduce, np.subtract, np.multiply, np.less_equal
    while live:
        if ptr >= end and late is None and positive and not first:
            return quiet_sum(rem, spd, thr, present, t, acc)
        extra: dict[int, int] = {}
        if 0 < free < look:
            while ptr < end and not present[oj[ptr]]:  # leading finished jobs' steps: passed for good
                ptr += 1
            extra = order.tail(pos, present, ptr, free)
            for x, k in extra.items():
                spd[x] = rs[x][k]
        if first:  # the first allocation: running jobs squeezed below their GPUs pay the cost
            first = False
            for x in members:
                j = order.jobs[x]
                if j.running and counts[x][extra.get(x, pos[x])] < j.size:
                    rem[x] += shrink_cost * spd[x]
        if positive:
            dt = float(least(divide(rem, spd, out=q)))
        else:  # a count that does not run: its job never ends at it (the original's inf)
            q.fill(math.inf)
            dt = float(divide(rem, spd, out=q, where=spd > 0).min())
        if dt == math.inf:
            return math.inf
        t += dt
        subtract(rem, multiply(spd, dt, out=q), out=rem)
        for x in extra:
            spd[x] = rs[x][pos[x]]
        for x in less_equal(rem, thr, out=done).nonzero()[0].tolist():
            acc += t
            present[x] = False
            live -= 1
            rem[x], spd[x] = math.inf, 1.0
            free += counts[x][pos[x]]
            lows -= lowv[x]
        if late is not None and lows + lowv[late] <= total:
            present[late], rem[late], live, lows = True, order.jobs[late].remaining, live + 1, lows + lowv[late]
            late = None
            pos, ptr, free = restart(order, present, total - lows, spd)
            continue
        ptr, free = order.advance(pos, present, spd, ptr, free)
    return acc if late is None else math.inf


def restart(order: StepOrder, present: list[bool], free: int, spd: np.ndarray) -> tuple[list[int], int, int]:
    """The prefix for the ``present`` jobs (:meth:`StepOrder.prefix`), their
    speeds at it written to ``spd``."""
    mask = np.array(present, dtype=bool)
    pos, ptr, free = order.prefix(mask, free)
    idx = np.flatnonzero(mask)
    spd[idx] = order.rate2d[idx, np.array(pos)[idx]]
    return pos, ptr, free


def quiet_sum(rem: np.ndarray, spd: np.ndarray, thr: np.ndarray, present: list[bool], t: float, acc: float) -> float:
    """The rest of :func:`fluid_sum` once no job can gain a GPU: completions
    only, on the live jobs alone (the same per-job arithmetic)."""
    idx = np.flatnonzero(np.array(present, dtype=bool))
    rem, spd, thr = rem[idx], spd[idx], thr[idx]
    live = len(idx)
    q, done = np.empty(live), np.empty(live, dtype=bool)
    divide, least, subtract, multiply, less_equal = np.divide, np.minimum.reduce, np.subtract, np.multiply, np.less_equal
    while live:
        dt = float(least(divide(rem, spd, out=q)))
        if dt == math.inf:
            return math.inf
        t += dt
        subtract(rem, multiply(spd, dt, out=q), out=rem)
        for x in less_equal(rem, thr, out=done).nonzero()[0].tolist():
            acc += t
            live -= 1
            rem[x] = math.inf
    return acc
