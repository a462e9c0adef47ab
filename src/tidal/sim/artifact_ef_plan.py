"""The ElasticFlow artifact's own planner (its ``ef_sim_allocation``).

The public ElasticFlow artifact (github.com/pkusys/ElasticFlow,
``scheduler/scheduler.py``) does not plan the way ASPLOS'23 §4.2 and Tidal's
:mod:`tidal.scheduler.policies.elasticflow` describe it; its simulator's
planner, which decides the paper's Fig. 8 ratios, works on a *free-GPU
timeline* (time -> GPUs free from then on) and fills a job **as late as
possible**:

- the job's deadline is aligned up to the slot grid (``aligned``); for each
  cap ``q`` in the profiled counts up to the job's maximum (``max_gpu``), the
  periods of the timeline are walked *backwards* from the aligned deadline
  (the last period only counts until the real deadline) giving the job
  ``q`` or the largest profiled count that fits; at the first cap whose
  periods from some point ``p`` on deliver the work, the plan is laid
  *forwards*: the previous cap before ``p``, ``q`` from ``p`` on, and the job
  ends where the work is done (``ceil`` seconds, the end aligned to a slot
  after that period's start);
- if no cap suffices, the job gets what fits until the aligned deadline,
  then what fits after it, then the whole cluster (a plan that misses);
- ``assign``: the job first holds ``assign`` GPUs until the next change of
  the timeline (how the artifact prices one more GPU step), then as above.

Times are the artifact's: integers from the trace, ends ``ceil``-ed.
Returned timelines and allocations have equal neighbours merged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

Timeline = dict  # time -> free GPUs from then on (insertion sorted by time)


@dataclass
class EFJob:
    """What the planner needs of a job (the artifact's job record)."""

    idx: int
    model: str
    batch: int
    ddl: float
    iter_left: float
    max_gpu: int
    counts: tuple[int, ...]
    rate: Callable[[int], float]

    def next_level(self, n: int) -> int:
        """The profiled count after ``n`` (the first one for ``n == 0``), up to ``max_gpu``."""
        found = n == 0
        for c in self.counts:
            if c > self.max_gpu:
                break
            if c == n:
                found = True
            elif found:
                return c
        return n

    def fit(self, free: float) -> int:
        """The largest profiled count at most ``free`` (and ``max_gpu``), else 0."""
        best = 0
        for c in self.counts:
            if c > self.max_gpu or c > free:
                break
            best = c
        return best


@dataclass
class PlanResult:
    ok: bool  # the real end is by the deadline
    timeline: Timeline
    alloc: dict
    end: float  # slot-aligned end (when the GPUs are released)
    real_end: float


def align(start: float, t: float, slot: float) -> float:
    """``t`` rounded up to the slot grid that starts at ``start``."""
    k = (t - start) // slot
    if (t - start) % slot > 0:
        k += 1
    return start + k * slot


def merged(d: dict) -> dict:
    """Drop entries equal to the previous one."""
    out: dict = {}
    last = None
    for k, v in d.items():
        if out and v == last:
            continue
        out[k] = v
        last = v
    return out


def _sorted(d: dict) -> dict:
    return dict(sorted(d.items()))


def value_before(tl: Timeline, t: float, default: float) -> float:
    """The timeline's value of the last key before ``t`` (sorted keys)."""
    v = default
    for k, x in tl.items():
        if k < t:
            v = x
        else:
            break
    return v


class _Fill:
    """One call of the planner (mutable state of its passes)."""

    def __init__(self, job: EFJob, start: float, tl: Timeline, total: int, slot: float) -> None:
        self.job, self.start, self.old, self.total, self.slot = job, start, tl, total, slot
        self.new: Timeline = dict(tl)
        self.alloc: dict = {start: 0}
        self.left = job.iter_left
        self.ev = start
        self.aligned = align(start, job.ddl, slot)
        self.before_aligned: float | None = None
        if self.aligned not in self.new and self.aligned >= start:
            self.before_aligned = value_before(self.new, self.aligned, total)
            self.new[self.aligned] = self.before_aligned
            self.new = _sorted(self.new)

    def dur(self, t_end: float, t0: float) -> float:
        """A period's length; the one ending at the aligned deadline ends at the deadline."""
        return (self.job.ddl if t_end == self.aligned else t_end) - t0

    def done(self, end: float, real_end: float) -> PlanResult:
        return PlanResult(real_end <= self.job.ddl, merged(self.new), merged(_sorted(self.alloc)), end, real_end)

    # -- ``assign``: hold a count until the next change of the timeline ----------
    def hold(self, q: int) -> PlanResult | None:
        avail = self.new[self.start]
        fut = None
        for t, v in self.old.items():
            if t < self.ev:
                avail = v
                self.new.pop(t, None)
                continue
            if t == self.ev:
                avail = v
                continue
            fut = t
            break
        if fut is None:
            fut = self.aligned
        self.alloc[self.ev] = q
        r = self.job.rate(q)
        real_end = math.ceil(self.ev + self.left / r)
        end = align(self.start, real_end, self.slot)
        if fut >= end and self.job.ddl >= real_end:
            last = avail
            for t in list(self.old):
                if self.ev <= t < end:
                    last = self.new[t]
                    self.new[t] -= q
            if self.ev != end:
                self.new[self.ev] = avail - q
            if end not in self.old:
                self.new[end] = last
            self.new = _sorted(self.new)
            return self.done(end, real_end)
        self.left -= self.dur(fut, self.ev) * r
        self.new[self.ev] = self.new.get(self.ev, avail) - q
        self.ev = fut
        self.alloc[self.ev] = 0
        return None

    # -- the search over caps --------------------------------------------------
    def search(self) -> PlanResult:
        job = self.job
        quota, last_q = job.next_level(0), 0
        while quota <= self.total and quota <= job.max_gpu:
            for t in self.new:
                if t < self.aligned and t not in self.alloc:
                    self.alloc[t] = 0
            period_end, acc = self.aligned, 0.0
            for ps in reversed(list(self.new)):
                if ps >= self.aligned:
                    continue
                if ps < self.ev:
                    break
                a = quota if self.new[ps] >= quota else min(quota, job.fit(self.new[ps]))
                if a == 0:
                    period_end = ps
                    continue
                acc += self.dur(period_end, ps) * job.rate(a)
                if acc >= self.left:
                    return self.lay(ps, quota, last_q)
                period_end = ps
            last_q, quota = quota, job.next_level(quota)
            if quota == last_q:
                break
        return self.fail(last_q)

    def _cap(self, t: float, point: float, hi: int, lo: int) -> int:
        return min(hi if t >= point else lo, self.job.fit(self.new[t]))

    def lay(self, point: float, quota: int, last_q: int) -> PlanResult:
        """Lay the plan forwards: ``last_q`` before ``point``, ``quota`` from it."""
        job = self.job
        lat, la, end, real_end = None, 0, None, 0.0
        for t in list(self.new):
            if t > self.aligned:
                break
            if t < self.ev:
                continue
            if lat is None:
                lat, la = t, self._cap(t, point, quota, last_q)
                continue
            self.alloc[lat] = la
            self.new[lat] -= la
            if la == 0:
                lat, la = t, self._cap(t, point, quota, last_q)
                continue
            its = self.dur(t, lat) * job.rate(la)
            if lat < point or its < self.left:
                self.left -= its
            else:
                real_left = math.ceil(self.left / job.rate(la))
                end, real_end = lat + align(0, real_left, self.slot), lat + real_left
                break
            lat, la = t, self._cap(t, point, quota, last_q)
        if end is None:
            self.alloc[lat] = la
            self.new[lat] -= la
            real_left = math.ceil(self.left / job.rate(la)) if la else math.inf
            end, real_end = lat + align(0, real_left, self.slot), lat + real_left
        release = self.total
        for t, v in self.old.items():
            if self.ev <= t < end:
                release = v
        if end not in self.old:
            self.new[end] = release
        self.new = _sorted(self.new)
        return self.done(end, real_end)

    def fail(self, last_q: int) -> PlanResult:
        """No cap suffices: what fits until the aligned deadline, then after it."""
        job = self.job
        lat, la = None, 0
        for t in list(self.new):
            if t > self.aligned:
                break
            if t < self.ev:
                continue
            if lat is not None:
                self.alloc[lat] = la
                self.new[lat] -= la
                if la != 0:
                    self.left -= self.dur(t, lat) * job.rate(la)
            lat, la = t, min(last_q, job.fit(self.new[t]))
        return self.after_deadline()

    def after_deadline(self) -> PlanResult:
        job = self.job
        lat = max(self.aligned, self.ev)
        for t in list(self.new):
            if t <= self.aligned:
                continue
            q = min(job.fit(self.new[lat]), job.max_gpu)
            self.alloc[lat] = q
            if q == 0:
                lat = t
                continue
            its = (t - lat) * job.rate(q)
            if its >= self.left:
                real_end = math.ceil(lat + self.left / job.rate(q))
                end = align(self.start, real_end, self.slot)
                last = self.before_aligned
                for t1 in list(self.new):
                    if t1 < self.aligned:
                        continue
                    if t1 < end and t1 in self.old:
                        last = self.old[t1]
                    if lat <= t1 < end:
                        self.new[t1] -= q
                last = self.total if last is None else last
                if lat != end:
                    self.new[lat] = last - q
                if end not in self.old:
                    self.new[end] = last
                self.new = _sorted(self.new)
                return self.done(end, real_end)
            self.left -= its
            for t1 in list(self.new):
                if lat <= t1 < t:
                    self.new[t1] -= q
            lat = t
        return self.whole_cluster(lat)

    def whole_cluster(self, lat: float) -> PlanResult:
        q = self.assigned if self.assigned is not None else min(self.total, self.job.max_gpu)
        self.alloc[lat] = q
        real_end = math.ceil(lat + self.left / self.job.rate(q))
        end = align(self.start, real_end, self.slot)
        self.new[lat] = self.total - q
        self.new[end] = self.total
        self.new = _sorted(self.new)
        return self.done(end, real_end)

    assigned: int | None = None


def plan(job: EFJob, start: float, tl: Timeline, total: int, slot: float, assign: int | None = None) -> PlanResult:
    """The artifact's ``ef_sim_allocation`` of ``job`` at ``start`` on the
    free-GPU timeline ``tl`` (not modified); see the module docstring."""
    f = _Fill(job, start, tl, total, slot)
    if assign is not None:
        f.assigned = assign
        res = f.hold(assign)
        if res is not None:
            return res
    return f.search()


def gpu_time(alloc: dict, end: float) -> float:
    """GPU-seconds of an allocation (time -> GPUs) until ``end``."""
    total, last_t, last_n = 0.0, None, 0
    for t, n in alloc.items():
        if last_t is not None:
            total += last_n * (t - last_t)
        last_t, last_n = t, n
    if last_t is not None:
        total += last_n * (end - last_t)
    return total
