"""The ElasticFlow artifact's own ElasticFlow (``ef-accessctrl``) executor.

``--fidelity artifact`` runs ElasticFlow through this module, not through
the registry policy (:mod:`tidal.scheduler.policies.elasticflow`, whose
behaviour is unchanged): the artifact's deadline ratios (ASPLOS'23 §6,
Fig. 8) come from its simulator's own planner and loop
(``ef_sim_jobs_access_control`` in ``scheduler/scheduler.py`` of
github.com/pkusys/ElasticFlow), which differ from §4.2 in ways that change
which jobs meet their deadlines. Every round (an arrival, a planned end or
a planned change of count; events less than a slot after a round are merged
into the round a slot later):

1. **progress**: each job with GPUs did ``(dt - overhead) * throughput``
   iterations; a job that finished early moves its end to this round;
2. **ends**: the jobs whose planned end is this round leave; one whose last
   planned (not actual) end was after its deadline counts as missed;
3. **admission**: all jobs, the new ones included, are re-planned from an
   empty timeline in deadline order (:func:`tidal.sim.artifact_ef_plan.plan`,
   as late as possible); if *any* plan misses its deadline, *every* new
   job of the round is declined;
4. **allocation**: every job gets its plan's count for now; spare GPUs go,
   one profiled step at a time, to the job whose next step adds the most
   GPU time to its plan (jobs without GPUs first);
5. **overheads**: each job with GPUs loses ``2 s`` in the next interval, or
   ``2 + 2 (log2 n + 1) s`` if its rank range is not in the trainer cache
   (:mod:`tidal.sim.artifact_ef_nodes`), plus ``27 s`` on a restart round
   (every ``slot``-th round, which also empties the cache); the planned end
   moves by that much.

The ratio is the artifact's: jobs that started and met their planned end,
over those plus the declined ones.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterable

from tidal.core.job import JobSpec, JobState
from tidal.core.profile import ThroughputProfile
from tidal.core.topology import Cluster
from tidal.sim.artifact_ef_nodes import SIZES, ElasticNodes
from tidal.sim.artifact_ef_plan import EFJob, PlanResult, gpu_time, merged, plan, value_before
from tidal.sim.artifact_gandiva import artifact_overhead
from tidal.sim.engine import SimResult
from tidal.sim.progress import SimJob

_INF = float(2**63 - 1)


def max_gpu(model: str, batch: int) -> int:
    """The artifact's hand-written per-model GPU cap (``models.get_max_gpu``, A100)."""
    caps = {("gpt2", 128): 16, ("gpt2", 256): 32, ("bert", 64): 8, ("inception3", 64): 16,
            ("inception3", 128): 32, ("resnet50", 64): 32, ("vgg16", 64): 32}
    if model == "deepspeech2":
        return batch
    if model == "bert":
        return caps.get((model, batch), 16)
    return caps.get((model, batch), min(batch, 64))


@dataclass(eq=False)
class ArtJob(EFJob):
    """A job record of the artifact's loop."""

    spec: JobSpec | None = None
    num_gpu: int = 0
    alloc: dict = field(default_factory=dict)
    end_time: float = 0.0
    real_end: float | None = None
    old_end: float = 0.0
    overhead: float = 0.0
    in_cache: bool = False
    next_level_gpu: int = 0
    marginal: float = 0.0
    trial: PlanResult | None = None
    hist: list = field(default_factory=list)  # (time, GPUs) at each change


@dataclass(eq=False)
class Event:
    time: float
    start: list = field(default_factory=list)
    end: list = field(default_factory=list)


class _Events:
    """The artifact's event list: arrivals, planned ends and planned changes,
    found by exact time (``search_dict_list``)."""

    events: list[Event]
    slot: float

    def _event_at(self, t: float) -> Event | None:
        for e in self.events:
            if e.time == t:
                return e
        return None

    def _add_end(self, job: ArtJob) -> None:
        e = self._event_at(job.end_time)
        if e is None:
            self.events.append(Event(job.end_time, [], [job]))
        elif job not in e.end:
            e.end.append(job)

    def _move_end(self, job: ArtJob) -> None:
        """The artifact's ``change_job_end_event`` (from ``old_end`` to ``end_time``)."""
        if job.old_end == job.end_time:
            return
        e = self._event_at(job.old_end)
        if e is not None:
            if job in e.end:
                e.end.remove(job)
            if not e.end and not e.start:
                self.events.remove(e)
        self._add_end(job)

    def _merge(self, now: float) -> float:
        """The next round: events less than a slot after ``now`` are merged
        into one event a slot after it (the first one moves there)."""
        ev = self.events
        ev.sort(key=lambda e: e.time)
        nxt = ev[0].time
        while int(nxt - now) <= self.slot and len(ev) > 1:
            ev[0].time = now + self.slot
            if ev[1].time - now > self.slot:
                break
            nxt = ev[1].time
            ev[0].start.extend(ev[1].start)
            ev[0].end.extend(ev[1].end)
            del ev[1]
        return ev[0].time


class _SpareGPUs(_Events):
    """The artifact's ``allocate_free_gpus``: spare GPUs go one profiled step
    at a time to the job whose step adds the most GPU time to its plan."""

    runnable: list[ArtJob]
    pending: list[ArtJob]
    tl: dict
    total: int

    def _start(self, j: ArtJob) -> None:
        raise NotImplementedError

    def _spare(self, now: float) -> None:
        used = 0
        for j in self.runnable:
            j.next_level_gpu = j.next_level(j.num_gpu)
            used += j.num_gpu
        free = self.total - used
        if free <= 0:
            return
        for j in self.runnable:
            self._marginal(j, free, now)
        self.runnable.sort(key=lambda j: j.marginal, reverse=True)
        grew = True
        while free > 0 and grew:
            grew = False
            for j in self.runnable:
                step = j.next_level_gpu - j.num_gpu
                if step > free or step == 0 or j.trial is None:
                    continue
                self.tl = j.trial.timeline
                j.alloc, j.num_gpu = j.trial.alloc, j.next_level_gpu
                j.old_end, j.end_time = j.end_time, j.trial.end
                if j in self.pending:
                    self._start(j)
                self._move_end(j)
                free -= step
                j.next_level_gpu = j.next_level(j.num_gpu)
                grew = True
                break
            for j in self.runnable:
                if j.next_level_gpu - j.num_gpu > 0:
                    self._marginal(j, free, now)
            self.runnable.sort(key=lambda j: j.marginal, reverse=True)

    def _marginal(self, j: ArtJob, free: int, now: float) -> None:
        """GPU time the job's plan gains per extra GPU if it takes its next step now."""
        step = j.next_level_gpu - j.num_gpu
        j.trial = None
        if step > free or step == 0:
            j.marginal = -_INF
            return
        tl = dict(self.tl)
        if j.end_time not in tl:
            tl[j.end_time] = value_before(tl, j.end_time, self.total)
            tl = dict(sorted(tl.items()))
        last = 0
        for a, n in j.alloc.items():
            if a not in tl:
                tl[a] = _available(tl, a, self.total)
                tl = dict(sorted(tl.items()))
            for t in tl:
                if t < a:
                    continue
                if t >= j.end_time:
                    break
                tl[t] += n - last
            last = n
        res = plan(j, now, merged(tl), self.total, self.slot, assign=j.next_level_gpu)
        j.trial = res
        j.marginal = (gpu_time(res.alloc, res.end) - gpu_time(j.alloc, j.end_time)) / step
        if j.num_gpu == 0:
            j.marginal = _INF


class ArtifactElasticFlow(_SpareGPUs):
    """The artifact's ``ef-accessctrl`` loop (see the module docstring)."""

    def __init__(self, cluster: Cluster, jobs: Iterable[JobSpec], profiles: ThroughputProfile,
                 slot: float = 60.0) -> None:
        self.c, self.slot = cluster, slot
        self.total = cluster.num_gpus
        self.nodes = ElasticNodes(cluster.num_nodes, cluster.gpus_per_node)
        specs = sorted(jobs, key=lambda s: s.submit_time)
        self.jobs = [self._job(i, s, profiles) for i, s in enumerate(specs)]
        self.events: list[Event] = []
        for j in self.jobs:
            t = _num(j.spec.submit_time)
            if self.events and self.events[-1].time == t:
                self.events[-1].start.append(j)
            else:
                self.events.append(Event(t, [j]))
        self.pending: list[ArtJob] = []
        self.running: list[ArtJob] = []
        self.runnable: list[ArtJob] = []
        self.tl: dict = {}
        self.rounds = 0
        self.charged = 0  # the artifact's ``schedule_count``
        self.outcome: dict[int, tuple[JobState, float, str]] = {}
        self.timeline: list[tuple[float, int]] = []

    @staticmethod
    def _job(i: int, s: JobSpec, profiles: ThroughputProfile) -> ArtJob:
        counts = profiles.profiled_counts(s.model, s.batch_size)

        def rate(n: int, m: str = s.model, b: int = s.batch_size) -> float:
            return profiles.throughput(m, b, n)

        return ArtJob(idx=i, model=s.model, batch=s.batch_size, ddl=_num(s.deadline), iter_left=_num(s.iterations),
                      max_gpu=max_gpu(s.model, s.batch_size), counts=tuple(counts), rate=rate, spec=s)

    # -- planning -----------------------------------------------------------------
    def _commit(self, job: ArtJob, now: float) -> bool:
        res = plan(job, now, self.tl, self.total, self.slot)
        self.tl = res.timeline
        job.end_time, job.real_end, job.alloc = res.end, res.real_end, res.alloc
        return res.ok

    def _estimate_all(self, jobs: list[ArtJob], now: float, record: bool = True) -> bool:
        self.tl = {now: self.total}
        jobs.sort(key=lambda j: j.ddl)
        for j in jobs:
            if record:
                j.old_end = j.end_time
            if self.nodes.placed(j):
                self.nodes.release(j, j.num_gpu)
        ok = True
        for j in jobs:
            ok = self._commit(j, now) and ok
        return ok

    # -- the loop -------------------------------------------------------------------
    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        start = self.events[0].time if self.events else 0.0
        now, diff = start, 0.0
        while self.events or self.pending or self.running:
            self._progress(diff, now)
            for j in self.runnable:
                j.overhead = 0.0
            ev = self._event_at(now)
            if ev is not None:
                self.events.remove(ev)
                if not self.pending and not self.running and not ev.end and not ev.start:
                    if not self.events:
                        break
                    self.events.sort(key=lambda e: e.time)
                    now, diff = self.events[0].time, self.events[0].time - now
                    continue
                self._plan_round(ev, now)
            first_change = self._allocate_round(now) if ev is not None else _INF
            self.nodes.mark_cache(lambda j: j.num_gpu)
            self._record(now)
            self.events.sort(key=lambda e: e.time)
            if not self.events or first_change < self.events[0].time:
                if self._event_at(first_change) is None:
                    self.events.append(Event(first_change))
                self.events.sort(key=lambda e: e.time)
            self.rounds += 1
            if now >= _INF:
                break  # nothing left but jobs that can never end
            if not self.events:
                now, diff = now + 10, 10.0
                continue
            self._charge()
            nxt = self._merge(now)
            now, diff = nxt, float(int(nxt - now))
        last = self.timeline[-1][0] if self.timeline else start
        end = max([last, *(t for _, t, _ in self.outcome.values())])
        return self._result(start, end, time.perf_counter() - wall0)

    def _progress(self, diff: float, now: float) -> None:
        """The artifact's ``run_all_jobs``."""
        for j in self.runnable:
            if j.num_gpu == 0:
                continue
            r = j.rate(j.num_gpu)
            run = diff
            ref = j.real_end if j.real_end is not None else j.end_time
            if now > ref:
                run -= now - ref
            run = 0.0 if run < j.overhead else run - j.overhead
            its = run * r
            if j.iter_left <= its and j.end_time > now:
                j.old_end = j.end_time
                actual = now - diff + math.ceil(j.iter_left / r)
                its = (j.end_time - now + diff) * r
                j.end_time = now
                self._move_end(j)
                j.end_time = actual
            j.iter_left -= its
            j.overhead = 0.0

    def _plan_round(self, ev: Event, now: float) -> None:
        for j in ev.end:
            if self.nodes.placed(j):
                self._finish(j, now)
        for j in self.runnable:
            j.old_end = j.end_time
        admitted = False
        if ev.start:
            saved = self.tl
            if not self._estimate_all(self.runnable + ev.start, now):
                for j in ev.start:
                    self.outcome[j.idx] = (JobState.DROPPED, now, "batch declined")
                self.tl = saved
            else:
                admitted = True
                for j in ev.start:
                    self.pending.append(j)
                    if j not in self.runnable:
                        self.runnable.append(j)
        if not admitted:
            self._estimate_all(self.runnable, now, record=not ev.start)
        self.tl = {now: self.total}
        self.runnable.sort(key=lambda j: j.ddl)
        for j in self.runnable:
            j.num_gpu = j.alloc[now]
            self._move_end(j)
            j.old_end = j.end_time
            self._commit(j, now)

    def _finish(self, j: ArtJob, now: float) -> None:
        if j in self.running:
            self.running.remove(j)
        if j in self.runnable:
            self.runnable.remove(j)
        self.nodes.release(j, j.num_gpu)
        j.hist.append((now, 0))
        late = j.real_end is not None and j.real_end > j.ddl
        self.outcome[j.idx] = (JobState.COMPLETED, j.real_end if j.real_end is not None else now,
                               "late" if late else "")

    def _start(self, j: ArtJob) -> None:
        self.pending.remove(j)
        self.running.append(j)
        if j not in self.runnable:
            self.runnable.append(j)

    def _allocate_round(self, now: float) -> float:
        """Start pending jobs planned to run now, give out spare GPUs, place
        every job; returns the first planned change of count after ``now``."""
        starting = []
        for p in self.pending:
            first = next((t for t, n in p.alloc.items() if n != 0), None)
            p.num_gpu = p.alloc[now]
            if (first is None or first <= now) and p.num_gpu <= self.total:
                starting.append(p)
        for p in starting:
            self._start(p)
            self._add_end(p)
        self._spare(now)
        first_change = _INF
        self.runnable.sort(key=lambda j: j.num_gpu, reverse=True)
        for j in self.runnable:
            later = [t for t in sorted(j.alloc) if t > now]
            if later:
                first_change = min(first_change, later[0])
            if j.num_gpu >= self.c.gpus_per_node:
                self.nodes.place(j, j.num_gpu)
        for k in reversed(SIZES):
            if k >= self.c.gpus_per_node:
                continue
            for j in self.runnable:
                if j.num_gpu == k:
                    self.nodes.place(j, k)
        return first_change

    # -- between rounds ----------------------------------------------------------------
    def _charge(self) -> None:
        restart = self.charged > 0 and self.charged % int(self.slot) == 0
        self.charged += 1
        if restart:
            self.nodes.cache.clear()
        for j in self.runnable:
            if j.num_gpu <= 0:
                j.overhead = 0.0
                continue
            j.overhead = artifact_overhead(j.num_gpu, restart, self.total, j.in_cache)
            j.old_end = j.end_time
            j.end_time += j.overhead
            self._move_end(j)

    def _record(self, now: float) -> None:
        used = 0
        for j in self.runnable:
            used += j.num_gpu
            if not j.hist or j.hist[-1][1] != j.num_gpu:
                j.hist.append((now, j.num_gpu))
        if not self.timeline or self.timeline[-1][1] != used:
            self.timeline.append((now, used))

    def _result(self, start: float, end: float, wall: float) -> SimResult:
        """Jobs as SimJobs; a finished job's ``end_time`` is the completion the
        artifact checks against its deadline (its last planned real end)."""
        out = []
        for j in self.jobs:
            sj = SimJob(spec=j.spec, last_t=j.spec.submit_time, batch=j.spec.batch_size, alloc=j.hist)
            state, t, why = self.outcome.get(j.idx, (JobState.PENDING, None, ""))
            sj.state, sj.end_time, sj.drop_reason = state, t, why
            sj.admitted = state is not JobState.DROPPED
            sj.start_time = next((t0 for t0, n in j.hist if n > 0), None)
            sj.max_gpus = max((n for _, n in j.hist), default=0)
            sj.gpu_seconds = _area(j.hist, end)
            out.append(sj)
        return SimResult(policy="ef-accessctrl", cluster=self.c, jobs=out, timeline=self.timeline or [(end, 0)],
                         start=start, end=end, busy_gpu_s=_area(self.timeline, end), useful_norm_s=0.0,
                         rounds=self.rounds, wall_seconds=wall)


def _area(steps: list[tuple[float, int]], end: float) -> float:
    """Integral of a step function (time, value) until ``end``."""
    total = 0.0
    for (t0, n), (t1, _) in zip(steps, steps[1:] + [(end, 0)]):
        total += n * max(min(t1, end) - t0, 0.0)
    return total


def _num(x: float | None) -> float:
    """Trace numbers as the artifact reads them (integers stay integers)."""
    if x is None:
        return _INF
    return int(x) if float(x).is_integer() else x


def _available(tl: dict, t: float, total: int) -> float:
    if t in tl:
        return tl[t]
    v = total
    for k, x in tl.items():
        if k <= t:
            v = x
    return v
