"""Discrete-event simulator: the executor that runs a policy's plans on a trace.

Events are arrivals, completions and scheduling rounds; nothing loops per
second. A job's progress is a list of segments (:mod:`tidal.sim.progress`), so
a rescale's overhead (:mod:`tidal.core.overhead`) is exact and completion
times are computed, not stepped. Scheduling rounds happen at multiples of
``slot`` seconds after any event (``slot=0``: at the event itself), and when a
plan asks to be woken; rounds in which a policy's last plan is
:meth:`~tidal.scheduler.api.Policy.settled` (only completions since) skip the
policy. Plans are validated and applied by :mod:`tidal.sim.apply`.

State is kept between rounds (:mod:`tidal.sim.views`): views of waiting jobs
are rebuilt only when they change, running jobs' counters advance as numpy
rows (:mod:`tidal.sim.runset`, bit-identical to the per-job sums), and the
snapshot carries the engine's indexes (GPUs held, free GPUs per node) so that
placement, validation and diffing look only at the jobs that change.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable, Iterable, Iterator

from tidal.core.job import JobSpec, JobState, check_transition
from tidal.core.overhead import OverheadModel
from tidal.core.profile import ThroughputProfile, load_profiles
from tidal.core.topology import Cluster
from tidal.scheduler.api import Policy
from tidal.sim.apply import PlanExecutor, PolicyError
from tidal.sim.goodput import goodput_tick, init_jobs
from tidal.sim.progress import Progress, SimJob, finish_time
from tidal.sim.views import ViewCache

_COMPLETE, _ARRIVAL, _SCHED = 0, 1, 2
_COMPLETED = JobState.COMPLETED
_ORDER = attrgetter("submit_time", "job_id")  # event order of the arrivals
__all__ = ["PolicyError", "SimResult", "Simulator", "simulate"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Automatic garbage collection off for a while: the engine keeps hundreds
    of thousands of objects alive (jobs, views, events) and makes almost no
    reference cycles, so the collector's passes over them, a sixth of a Philly
    run, find nothing. Back on, the objects made meanwhile join the oldest
    generation (freeze, then unfreeze: no pass over them), so the first young
    collection does not walk them all; cycles among them are collected by the
    next full collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()


@dataclass
class SimResult:
    policy: str
    cluster: Cluster
    jobs: list[SimJob]
    timeline: list[tuple[float, int]]  # (time, GPUs allocated) at each change
    start: float
    end: float
    busy_gpu_s: float
    useful_norm_s: float  # integral of sum_j rate_j / rate_j(1) dt (ElasticFlow eq. 8)
    rounds: int
    wall_seconds: float = 0.0


class Simulator(PlanExecutor):
    """Run one policy over a list of job specs."""

    def __init__(
        self,
        cluster: Cluster,
        policy: Policy,
        jobs: Iterable[JobSpec],
        profiles: ThroughputProfile | None = None,
        overheads: OverheadModel | None = None,
        slot: float = 60.0,
        until: float | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        validate: bool = True,
    ) -> None:
        with gc_paused():
            self._setup(cluster, policy, jobs, profiles, overheads, slot, until, on_progress, validate)

    def _setup(self, cluster: Cluster, policy: Policy, jobs: Iterable[JobSpec], profiles: ThroughputProfile | None,
               overheads: OverheadModel | None, slot: float, until: float | None,
               on_progress: Callable[[int, int], None] | None, validate: bool) -> None:
        self.cluster = cluster
        self.policy = policy
        self.profiles = profiles or load_profiles()
        self.overheads = overheads or OverheadModel()
        self.slot = slot
        self.until = until
        self.on_progress = on_progress
        self.validate = validate
        specs = sorted(jobs, key=_ORDER)
        one = self.profiles.throughput
        self.jobs: dict[str, SimJob] = {
            s.job_id: SimJob(spec=s, last_t=s.submit_time, batch=s.batch_size,
                             single_rate=one(s.model, s.batch_size, 1) or 1.0)
            for s in specs
        }
        if len(self.jobs) != len(specs):
            raise ValueError("duplicate job ids in the trace")
        self._goodput = init_jobs(self)  # goodput jobs: re-rated every round (tidal.sim.goodput)
        self.active: dict[str, SimJob] = {}
        self.running: dict[str, SimJob] = {}
        self.cache = ViewCache(cluster)  # views, running rows, GPU owners
        self.owner: dict[int, str] = self.cache.owner  # GPU -> job (updated by the cache)
        self._heap: list[tuple[float, int, int, Any]] = []  # completions and rounds
        # arrivals, already in event order: merged with the heap, not pushed
        self._arrivals = [(s.submit_time, _ARRIVAL, seq, s.job_id) for seq, s in enumerate(specs, 1)]
        self._seq = len(specs)
        self._arrived = 0
        self._sched_times: set[float] = set()
        self.now = specs[0].submit_time if specs else 0.0
        self.timeline: list[tuple[float, int]] = [(self.now, 0)]
        self.progress = Progress(self.now)
        self._arrivals_left = len(specs)
        self.rounds = 0
        self._settled = False  # the last plan holds until an arrival (Policy.settled)
        self.finished = 0
        self.dropped = 0

    # -- event queue ---------------------------------------------------------
    def _schedule_completion(self, job: SimJob) -> None:
        job.version += 1
        segs = job.segments
        if len(segs) == 1:  # finish_time, for one segment
            start, rate, _ = segs[0]
            if rate <= 0:
                return
            t = max(start, job.last_t) + (job.spec.iterations - job.done) / rate
        else:
            t = finish_time(job)
        if t < math.inf:
            self._seq += 1
            heapq.heappush(self._heap, (max(t, self.now), _COMPLETE, self._seq, (job, job.version)))

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    def _request_round(self, t: float) -> None:
        if self.slot > 0:
            t = math.ceil(t / self.slot - 1e-9) * self.slot
        if t not in self._sched_times:
            self._sched_times.add(t)
            self._push(t, _SCHED, None)

    def _complete(self, job: SimJob, t: float) -> None:
        cache = self.cache
        jid = job.spec.job_id
        cache.rows.remove(job)  # its fields are the truth from here on
        self.progress.advance(job, t)
        job.done = job.spec.iterations
        # _release, and the view cache forgetting the job (ViewCache.unhold, leave)
        cache.unhold(job, leaving=True)
        job.gpus = ()
        job.alloc.append((self.now, 0))
        job.segments = []
        del self.running[jid]
        check_transition(job.state, _COMPLETED)
        job.state = _COMPLETED
        job.end_time = t
        del self.active[jid]
        cache.leave(job)
        self.finished += 1

    # -- the loop ----------------------------------------------------------------
    def run(self) -> SimResult:
        with gc_paused():
            return self._run()

    def _run(self) -> SimResult:
        wall0 = time.perf_counter()
        total = len(self.jobs)
        last_report = -1
        until, owner, progress, jobs = self.until, self.owner, self.progress, self.jobs
        heap, pop, arrivals, n_arrivals = self._heap, heapq.heappop, self._arrivals, len(self._arrivals)
        active, arrive, on_progress = self.active, self.cache.arrive, self.on_progress
        sched_times, complete = self._sched_times, self._complete
        slot, timeline = self.slot, self.timeline
        while True:
            # the next event in (time, kind, sequence) order: the arrivals merged with the heap
            i = self._arrived
            if i < n_arrivals and not (heap and heap[0] < arrivals[i]):
                self._arrived = i + 1  # taken, like an event popped from the heap
                t, kind, _, payload = arrivals[i]
            elif heap:
                t, kind, _, payload = pop(heap)
            else:
                break
            if until is not None and t > until:
                break
            dt = t - progress._t  # Progress.account, inlined
            if dt > 0:
                progress.busy_gpu_s += len(owner) * dt
                progress._t = t
            self.now = t
            if kind == _SCHED:
                sched_times.discard(t)
                self._round(t)
            else:
                if kind == _COMPLETE:
                    job, version = payload
                    if job.version != version or job.state.terminal:
                        continue
                    complete(job, t)
                else:
                    job = jobs[payload]
                    active[payload] = job
                    arrive(job)
                    self._settled = False
                    self._arrivals_left -= 1
                rt = math.ceil(t / slot - 1e-9) * slot if slot > 0 else t  # _request_round, inlined
                if rt not in sched_times:
                    sched_times.add(rt)
                    self._push(rt, _SCHED, None)
            if kind != _ARRIVAL:
                used = len(owner)  # _record_usage, inlined
                last = timeline[-1]
                if last[1] != used:
                    if last[0] == t:
                        timeline[-1] = (t, used)
                    else:
                        timeline.append((t, used))
            if on_progress and self.finished != last_report:
                last_report = self.finished
                on_progress(self.finished + self.dropped, total)
        result = self._result()
        result.wall_seconds = time.perf_counter() - wall0
        return result

    def _result(self) -> SimResult:
        end = self.now
        self.cache.rows.advance(end, self.progress, self.cache.tags)
        self.cache.rows.flush_all()
        self.progress.account(end, len(self.owner))
        return SimResult(
            policy=self.policy.name,
            cluster=self.cluster,
            jobs=list(self.jobs.values()),
            timeline=self.timeline,
            start=self._arrivals[0][0] if self._arrivals else 0.0,  # the first submission (in order)
            end=end,
            busy_gpu_s=self.progress.busy_gpu_s,
            useful_norm_s=self.progress.useful,
            rounds=self.rounds,
        )

    def _round(self, now: float) -> None:
        self.rounds += 1
        self.cache.rows.advance(now, self.progress, self.cache.tags)
        if self._settled:
            if self._goodput:
                goodput_tick(self, now)
            return  # the policy would change nothing (Policy.settled)
        snap = self.cache.snapshot(now, self.cluster, self.active, self.profiles, self.overheads)
        plan = self.policy.schedule(snap)
        if self.cache.used is None and "used_mask" in snap.__dict__:
            self.cache.track_used()  # the policy reads it: hand it over from now on
        self._apply(snap, plan, now)
        # a job waiting for GPUs of its types (Plan.waiting) needs the next rounds
        self._settled = not plan.waiting and self.policy.settled(snap, plan)
        stuck = not self.running and self._arrivals_left == 0
        if plan.wake_at is not None and plan.wake_at < math.inf and not stuck:
            self._request_round(max(plan.wake_at, now + (self.slot or 1e-6)))
        if self._goodput:
            goodput_tick(self, now)  # noise scales moved: new rates, and a round next slot

def simulate(
    jobs: Iterable[JobSpec],
    cluster: Cluster,
    policy: Policy,
    **kwargs: Any,
) -> SimResult:
    return Simulator(cluster, policy, jobs, **kwargs).run()
