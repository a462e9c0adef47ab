"""Algorithm 2 of ElasticFlow (ASPLOS'23 §4.2) on precomputed step tables.

After the shares, the remaining GPUs go one step at a time, through a
priority queue, to the job with the highest marginal return per extra GPU.
A job's best step from level ``i`` with ``free`` GPUs left is the best
return among the levels above ``i`` that fit in ``free``; scanning those in
ascending order, the best only changes at a few *records*. :class:`Steps`
keeps, per level, those records (extra GPUs, return, level), so a step is
one bisection instead of a scan, and a job's tables are shared by every
scheduling round in which its inputs (levels, held GPUs, share, weight) are
the same.

:func:`greedy` runs the priority queue on them. When the GPUs left can
never bind (every job could climb its whole chain of best steps and still
find every record within reach), the order of the steps does not matter and
the result is each job at the end of its chain, without the queue. Otherwise
the queue's opening, while every job still sees all its records, is one
sort of the jobs' chains (:func:`_merge`), and the queue plays the rest.
Every path gives the plain queue's result, ties included.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from tidal.scheduler import kernels


@dataclass(frozen=True)
class Steps:
    """Best-step records of one job state, per level ``i`` (index into
    ``counts``): ``ext[i]`` (ascending extra GPUs), ``gain[i]`` (the best
    return among the levels up to that extra) and ``to[i]`` (that level).
    ``end[i]``: where best steps lead from ``i`` when GPUs never run out;
    ``need[i]``: the most extra GPUs a record on that chain asks for."""

    counts: tuple[int, ...]
    ext: tuple[tuple[int, ...], ...]
    gain: tuple[tuple[float, ...], ...]
    to: tuple[tuple[int, ...], ...]
    end: tuple[int, ...]
    need: tuple[int, ...]
    lead: tuple[tuple[int, int, int] | None, ...]  # per level: (GPUs up the chain, ``need``, first need)
    chains: dict = field(default_factory=dict, compare=False, repr=False)  # start level -> :func:`_chain`


def build_steps(counts: Sequence[int], vals: Sequence[float], one: float, weight: float) -> Steps:
    """Step tables for levels ``counts`` with progress ``vals`` per level;
    a step's return is its extra progress per extra GPU in units of ``one``,
    times ``weight``; only a return above the best so far by more than
    1e-12 counts (and none unless above 0)."""
    n = len(counts)
    ext: list[tuple[int, ...]] = []
    gain: list[tuple[float, ...]] = []
    to: list[tuple[int, ...]] = []
    for i in range(n):
        e: list[int] = []
        g: list[float] = []
        t: list[int] = []
        best, ci, vi = 0.0, counts[i], vals[i]
        for k in range(i + 1, n):
            extra = counts[k] - ci
            x = (vals[k] - vi) / extra / one * weight
            if x > best + 1e-12:
                best = x
                e.append(extra)
                g.append(x)
                t.append(k)
        ext.append(tuple(e))
        gain.append(tuple(g))
        to.append(tuple(t))
    end = list(range(n))
    need = [0] * n
    for i in range(n - 1, -1, -1):
        if to[i]:
            k = to[i][-1]
            end[i] = end[k]
            need[i] = max(ext[i][-1], need[k])
    lead = tuple((counts[end[i]] - counts[i], need[i], ext[i][-1]) if to[i] else None for i in range(n))
    return Steps(tuple(counts), tuple(ext), tuple(gain), tuple(to), tuple(end), tuple(need), lead)


def greedy(entries: dict[str, tuple[Steps, int, float]], free: int) -> dict[str, int]:
    """Algorithm 2's queue: ``entries`` maps a job to its step tables, its
    starting level and its deadline (ties: earlier deadline, then job id);
    returns each job's final level. A job pops its best step; if fewer GPUs
    are left than that step needs it looks again, otherwise it takes it."""
    fast = kernels.fast
    opened = None
    if fast is not None and type(entries) is dict and type(free) is int:
        opened = fast.greedy_open(entries, free)
    if opened is not None:  # the opening below, compiled
        binds, jobs, need0, cur = opened
        if not binds:
            return cur
        return _play(entries, jobs, cur, free, need0)
    jobs: list[str] = []  # the jobs that gain from a step
    total = need = need0 = 0
    for jid, (st, i, _) in entries.items():
        lead = st.lead[i]
        if lead is not None:
            jobs.append(jid)
            total += lead[0]
            if lead[1] > need:
                need = lead[1]
            if lead[2] > need0:
                need0 = lead[2]
    cur = {jid: e[1] for jid, e in entries.items()}
    if free - total >= need:  # the GPUs left never bind
        for jid in jobs:
            st, i, _ = entries[jid]
            cur[jid] = st.end[i]
        return cur
    return _play(entries, jobs, cur, free, need0)


def _play(entries: dict[str, tuple[Steps, int, float]], jobs: list[str], cur: dict[str, int], free: int,
          need0: int) -> dict[str, int]:
    """The queue when the GPUs left may bind (``jobs``: those with a chain;
    ``need0``: the largest first need)."""
    if free >= need0:  # every job sees all its records at first
        free, heap = _merge(entries, jobs, cur, free)
    else:
        heap = []
        for jid in jobs:
            st, i, ddl = entries[jid]
            p = bisect_right(st.ext[i], free)
            if p:
                heap.append((-st.gain[i][p - 1], ddl, jid, st.to[i][p - 1]))
    heapq.heapify(heap)
    return _run(entries, cur, free, heap)


def _run(entries: dict[str, tuple[Steps, int, float]], cur: dict[str, int], free: int,
         heap: list[tuple[float, float, str, int]]) -> dict[str, int]:
    """The queue itself, from ``heap`` (one entry per job that gains)."""
    push, pop = heapq.heappush, heapq.heappop
    while heap and free > 0:
        item = pop(heap)
        jid, k = item[2], item[3]
        st, _, ddl = entries[jid]
        i = cur[jid]
        extra = st.counts[k] - st.counts[i]
        if extra <= free:
            free -= extra
            cur[jid] = i = k
        p = bisect_right(st.ext[i], free)
        if p:
            push(heap, (-st.gain[i][p - 1], ddl, jid, st.to[i][p - 1]))
    return cur


def _merge(entries: dict[str, tuple[Steps, int, float]], jobs: list[str], cur: dict[str, int],
           free: int) -> tuple[int, list[tuple[float, float, str, int]]]:
    """Play the queue's opening at once while every job still sees all its
    records (``free`` >= every job's first need, and each step leaves at
    least the need of the level it reaches): each job then climbs its chain
    of best steps, and the queue pops a step once it is the smallest among
    the jobs' next steps, i.e. in the order of (the largest key on its chain
    up to it, the job's deadline and id, its place on the chain). Stops
    before the first step the GPUs left cannot pay, or after the first step
    that leaves fewer than its job's next need. Moves ``cur`` on (``jobs``:
    those with a chain); returns the GPUs left and the queue's entries then
    (a job's last record, or for the job that stopped the merge, its entry
    with the GPUs left)."""
    fast = kernels.fast
    if fast is not None and (type(entries), type(jobs), type(cur), type(free)) == (dict, list, dict, int):
        got = fast.merge_open(entries, jobs, cur, free, _chain)  # this function, compiled
        if got is not NotImplemented:
            return got
    keyed = [(entries[jid][2], jid) for jid in jobs]
    keyed.sort()  # the queue's tie order (job ids are unique)
    ranked = [jid for _, jid in keyed]
    chains = []
    for jid in ranked:
        st, i, _ = entries[jid]
        chains.append(st.chains.get(i) or _chain(st, i))
    cut = fast.merge_cut([c[0] for c in chains], free) if fast is not None and type(free) is int else NotImplemented
    if cut is NotImplemented:
        end, took, free, stop = _cut(chains, free)
    else:
        end, took, free, stop = cut
    special = ranked[stop] if stop >= 0 else None
    heap = []
    for x, jid in enumerate(ranked):
        st, i, ddl = entries[jid]
        if took[x]:
            i = cur[jid] = chains[x][1][took[x] - 1]
        ext = st.ext[i]
        p = bisect_right(ext, free) if jid == special else len(ext)
        if p and ext[0] <= free:  # (a job that can pay no step would only be popped and dropped)
            heap.append((-st.gain[i][p - 1], ddl, jid, st.to[i][p - 1]))
    return free, heap


def _cut(chains: list[tuple[np.ndarray, tuple[int, ...], bytes]], free: int) -> tuple[int, list[int], int, int]:
    """Where :func:`_merge` stops: the rows taken, in the order of a stable
    sort on the key (the rows are in (tie order, place) order already); the
    rows taken per job; the GPUs left; the job whose row stopped the merge
    when that row was taken (else -1)."""
    lens = [len(c[1]) for c in chains]
    table = np.concatenate([c[0] for c in chains])  # rows: key, extra, need after, place
    owner = np.repeat(np.arange(len(chains)), lens)
    order = np.argsort(table[:, 0], kind="stable")
    left = free - np.cumsum(table[order, 1].astype(np.int64))
    bad = left < table[order, 2]
    stop = -1
    if not bad.any():
        end = len(order)
    else:
        m = int(np.argmax(bad))
        end = m if left[m] < 0 else m + 1
        if end > m:
            stop = int(owner[order[m]])
    took = np.bincount(owner[order[:end]], minlength=len(chains)).tolist() if end else [0] * len(chains)
    return end, took, int(left[end - 1]) if end else free, stop


def _chain(st: Steps, i: int) -> tuple[np.ndarray, tuple[int, ...], bytes]:
    """The chain of best steps from level ``i`` with GPUs to spare: a row
    per step (the largest queue key ``-return`` so far on the chain, extra
    GPUs, the need at the level reached, place), the levels reached, and
    the rows' bytes (what the compiled merge reads)."""
    hit = st.chains.get(i)
    if hit is None:
        rows, levels = [], []
        k = i
        while st.to[k]:
            nxt = st.to[k][-1]
            rows.append((-st.gain[k][-1], st.ext[k][-1], st.ext[nxt][-1] if st.ext[nxt] else 0, len(rows)))
            levels.append(nxt)
            k = nxt
        table = np.array(rows, dtype=float)
        table[:, 0] = np.maximum.accumulate(table[:, 0])
        hit = st.chains[i] = (table, tuple(levels), table.tobytes())
    return hit
