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
the result is each job at the end of its chain, without the queue.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass
from typing import Sequence


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
    return Steps(tuple(counts), tuple(ext), tuple(gain), tuple(to), tuple(end), tuple(need))


def greedy(entries: dict[str, tuple[Steps, int, float]], free: int) -> dict[str, int]:
    """Algorithm 2's queue: ``entries`` maps a job to its step tables, its
    starting level and its deadline (ties: earlier deadline, then job id);
    returns each job's final level. A job pops its best step; if fewer GPUs
    are left than that step needs it looks again, otherwise it takes it."""
    cur = {jid: i for jid, (_, i, _) in entries.items()}
    total = need = 0
    for st, i, _ in entries.values():
        e = st.end[i]
        if e != i:
            total += st.counts[e] - st.counts[i]
            need = max(need, st.need[i])
    if free - total >= need:  # the GPUs left never bind
        return {jid: st.end[i] for jid, (st, i, _) in entries.items()}
    heap: list[tuple[float, float, str, int]] = []
    push = heapq.heappush
    for jid, (st, i, ddl) in entries.items():
        p = bisect_right(st.ext[i], free)
        if p:
            push(heap, (-st.gain[i][p - 1], ddl, jid, st.to[i][p - 1]))
    pop = heapq.heappop
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
