"""Discrete-event simulator: the executor that runs a policy's plans on a trace.

Events are arrivals, completions and scheduling rounds; nothing loops per
second. A job's progress is a list of segments (:mod:`tidal.sim.progress`), so
a rescale's overhead (:mod:`tidal.core.overhead`) is exact and completion
times are computed, not stepped. Scheduling rounds happen at multiples of
``slot`` seconds after any event (``slot=0``: at the event itself), and when a
plan asks to be woken. The simulator validates every plan
(:func:`tidal.scheduler.diff.validate_plan`: a GPU is never held by two jobs,
a rigid job runs only at its count, allocations match placements) and applies
its :func:`~tidal.scheduler.diff.diff_plan`.

State is kept between rounds (:mod:`tidal.sim.views`): views of waiting jobs
are rebuilt only when they change, running jobs' counters advance as numpy
rows (:mod:`tidal.sim.runset`, bit-identical to the per-job sums), and the
snapshot carries the engine's indexes (GPUs held, free GPUs per node) so that
placement, validation and diffing look only at the jobs that change.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from tidal.core.job import JobSpec, JobState, check_transition
from tidal.core.overhead import OverheadModel
from tidal.core.profile import ThroughputProfile, load_profiles
from tidal.core.topology import Cluster
from tidal.scheduler.api import Plan, Policy, Snapshot
from tidal.scheduler.diff import JobDelta, PlanError, changing, diff_plan, validate_plan
from tidal.sim.progress import Progress, SimJob, finish_time, with_idle
from tidal.sim.views import ViewCache

_COMPLETE, _ARRIVAL, _SCHED = 0, 1, 2
_DROPPABLE = (JobState.SUBMITTED, JobState.PENDING, JobState.ADMITTED)


class PolicyError(RuntimeError):
    """A plan broke an invariant (double-allocated GPU, illegal count...)."""


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


class Simulator:
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
        self.cluster = cluster
        self.policy = policy
        self.profiles = profiles or load_profiles()
        self.overheads = overheads or OverheadModel()
        self.slot = slot
        self.until = until
        self.on_progress = on_progress
        self.validate = validate
        specs = sorted(jobs, key=lambda s: (s.submit_time, s.job_id))
        ids = [s.job_id for s in specs]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate job ids in the trace")
        self.jobs: dict[str, SimJob] = {s.job_id: SimJob(spec=s, last_t=s.submit_time) for s in specs}
        for j in self.jobs.values():
            j.single_rate = self.profiles.throughput(j.spec.model, j.spec.batch_size, 1) or 1.0
            j.batch = j.spec.batch_size
        self.active: dict[str, SimJob] = {}
        self.running: dict[str, SimJob] = {}
        self.cache = ViewCache(cluster)  # views, running rows, GPU owners
        self.owner: dict[int, str] = self.cache.owner  # GPU -> job (updated by the cache)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._sched_times: set[float] = set()
        self.now = specs[0].submit_time if specs else 0.0
        self.timeline: list[tuple[float, int]] = [(self.now, 0)]
        self.progress = Progress(self.now)
        self._arrivals_left = len(specs)
        self.rounds = 0
        self._settled = False  # the last plan holds until an arrival (Policy.settled)
        self.finished = 0
        self.dropped = 0
        for s in specs:
            self._push(s.submit_time, _ARRIVAL, s.job_id)

    # -- event queue ---------------------------------------------------------
    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    def _request_round(self, t: float) -> None:
        if self.slot > 0:
            t = math.ceil(t / self.slot - 1e-9) * self.slot
        if t not in self._sched_times:
            self._sched_times.add(t)
            self._push(t, _SCHED, None)

    def _schedule_completion(self, job: SimJob) -> None:
        job.version += 1
        t = finish_time(job)
        if t < math.inf:
            self._push(max(t, self.now), _COMPLETE, (job.spec.job_id, job.version))

    def _rate(self, job: SimJob, gpus: tuple[int, ...], batch: int | None = None) -> float:
        """Progress rate in the spec's iterations/s (see Snapshot.progress_rate)."""
        n = len(gpus)
        b = batch or job.batch
        spread = self.cluster.nodes_spanned(gpus) > self.cluster.min_nodes(n)
        return self.profiles.throughput(job.spec.model, b, n, spread) * b / job.spec.batch_size

    # -- state changes ---------------------------------------------------------
    def _set_state(self, job: SimJob, state: JobState) -> None:
        check_transition(job.state, state)
        job.state = state

    def _release(self, job: SimJob) -> None:
        """Free ``job``'s GPUs; it must have left the running rows already."""
        self.cache.unhold(job)
        job.gpus = ()
        job.alloc.append((self.now, 0))
        job.segments = []
        self.running.pop(job.spec.job_id, None)

    def _hold(self, job: SimJob, gpus: tuple[int, ...]) -> None:
        owner = self.owner
        for g in gpus:
            if g in owner and owner[g] != job.spec.job_id:
                raise PolicyError(f"GPU {g} given to {job.spec.job_id} but held by {owner[g]}")
        job.gpus = gpus
        job.alloc.append((self.now, len(gpus)))
        self.cache.hold(job)
        job.max_gpus = max(job.max_gpus, len(gpus))
        self.running[job.spec.job_id] = job

    def _complete(self, job: SimJob, t: float) -> None:
        self.cache.stop_running(job)
        self.progress.advance(job, t)
        job.done = job.spec.iterations
        self._release(job)
        self._set_state(job, JobState.COMPLETED)
        job.end_time = t
        del self.active[job.spec.job_id]
        self.cache.leave(job)
        self.finished += 1

    # -- the loop ----------------------------------------------------------------
    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        total = len(self.jobs)
        last_report = -1
        while self._heap:
            t, kind, _, payload = heapq.heappop(self._heap)
            if self.until is not None and t > self.until:
                break
            self.progress.account(t, len(self.owner))
            self.now = t
            if kind == _COMPLETE:
                jid, version = payload
                job = self.jobs[jid]
                if job.version != version or job.state.terminal:
                    continue
                self._complete(job, t)
                self._record_usage(t)
                self._request_round(t)
            elif kind == _ARRIVAL:
                self.active[payload] = self.jobs[payload]
                self.cache.arrive(self.jobs[payload])
                self._settled = False
                self._arrivals_left -= 1
                self._request_round(t)
            else:
                self._sched_times.discard(t)
                self._round(t)
                self._record_usage(t)
            if self.on_progress and self.finished != last_report:
                last_report = self.finished
                self.on_progress(self.finished + self.dropped, total)
        result = self._result()
        result.wall_seconds = time.perf_counter() - wall0
        return result

    def _result(self) -> SimResult:
        end = self.now
        self.cache.rows.advance(end, self.progress, self.cache.tags)
        self.cache.rows.flush_all()
        self.progress.account(end, len(self.owner))
        starts = [j.spec.submit_time for j in self.jobs.values()]
        return SimResult(
            policy=self.policy.name,
            cluster=self.cluster,
            jobs=list(self.jobs.values()),
            timeline=self.timeline,
            start=min(starts) if starts else 0.0,
            end=end,
            busy_gpu_s=self.progress.busy_gpu_s,
            useful_norm_s=self.progress.useful,
            rounds=self.rounds,
        )

    def _record_usage(self, t: float) -> None:
        used = len(self.owner)
        if self.timeline[-1][1] != used:
            if self.timeline[-1][0] == t:
                self.timeline[-1] = (t, used)
            else:
                self.timeline.append((t, used))

    def _round(self, now: float) -> None:
        self.rounds += 1
        self.cache.rows.advance(now, self.progress, self.cache.tags)
        if self._settled:
            return  # the policy would change nothing (Policy.settled)
        snap = self.cache.snapshot(now, self.cluster, self.active, self.profiles, self.overheads)
        plan = self.policy.schedule(snap)
        self._apply(snap, plan, now)
        self._settled = self.policy.settled(snap, plan)
        stuck = not self.running and self._arrivals_left == 0
        if plan.wake_at is not None and plan.wake_at < math.inf and not stuck:
            self._request_round(max(plan.wake_at, now + (self.slot or 1e-6)))

    # -- applying a plan -----------------------------------------------------------
    def _apply(self, snap: Snapshot, plan: Plan, now: float) -> None:
        self._drop_and_admit(plan, now)
        look = changing(snap, plan)
        deltas = diff_plan(snap, plan, look)
        if self.validate:
            self._check(snap, plan, deltas, look)
        for jid, b in plan.batch.items():
            if jid in self.active and not self.active[jid].gpus:
                self.active[jid].batch = b
                self.cache.touch(self.active[jid])
        # preempt first, so GPUs are free for the others
        for jid, delta in deltas.items():
            if not delta.want:
                self._preempt(self.jobs[jid], now)
        self._rebatch(plan, deltas, now)
        self._move(plan, [deltas[jid] for jid in sorted(deltas) if deltas[jid].want], now)

    def _drop_and_admit(self, plan: Plan, now: float) -> None:
        for jid, reason in plan.drop.items():
            job = self.jobs[jid]
            if job.state not in _DROPPABLE:
                raise PolicyError(f"policy {self.policy.name} dropped {jid} in state {job.state.value}")
            job.state = JobState.DROPPED
            job.drop_reason = reason or "dropped by policy"
            job.end_time = now
            del self.active[jid]
            self.cache.leave(job)
            self.dropped += 1
        for jid in plan.admit:
            job = self.jobs[jid]
            if job.state is JobState.SUBMITTED:
                self._set_state(job, JobState.ADMITTED)
                self._set_state(job, JobState.PENDING)
                job.admitted = True
                job.waiting_since = now
                self.cache.touch(job)
        for jid, tags in plan.tags.items():
            if jid in self.active:
                self.active[jid].tags.update(tags)
                self.cache.retag(self.active[jid])

    def _check(self, snap: Snapshot, plan: Plan, deltas: dict[str, JobDelta], look: set[str]) -> None:
        """:func:`validate_plan`, and every job that gets new GPUs must make
        progress on them (at its current batch)."""
        try:
            validate_plan(snap, plan, look)
        except PlanError as e:
            raise PolicyError(f"policy {self.policy.name}: {e}") from e
        for jid, delta in deltas.items():
            if delta.want and self._rate(self.jobs[jid], delta.want) <= 0:
                raise PolicyError(f"job {jid} has zero throughput at {len(delta.want)} GPUs")

    def _preempt(self, job: SimJob, now: float) -> None:
        self.cache.stop_running(job)
        self.progress.advance(job, now)
        self._release(job)
        self._set_state(job, JobState.PENDING)
        job.waiting_since = now
        job.preemptions += 1
        job.version += 1
        self.cache.touch(job)

    def _rebatch(self, plan: Plan, deltas: dict[str, JobDelta], now: float) -> None:
        """A new global batch for a job that keeps its GPUs: applied at the next
        step boundary, no rescale (Elan §VI, hybrid scaling)."""
        for jid in sorted(plan.batch):
            job = self.running.get(jid)
            b = plan.batch[jid]
            if job is None or jid in deltas or b == job.batch:
                continue
            self.cache.rows.flush(job)
            self.progress.advance(job, now)
            job.batch = b
            start, _, idle = job.segments[-1]
            job.segments[-1] = (max(start, now), self._rate(job, job.gpus), idle)
            self._schedule_completion(job)
            self.cache.rows.load(job, self.cache.tags[jid])

    def _move(self, plan: Plan, deltas: list[JobDelta], now: float) -> None:
        """Start, grow, shrink and migrate jobs. Two passes, so that jobs may
        swap GPUs: release every changing job's old GPUs, then hold the new
        ones (checked against double use)."""
        changes = []
        for d in deltas:
            job = self.jobs[d.job_id]
            if d.job_id in self.running:
                self.cache.rows.flush(job)
            self.progress.advance(job, now)
            job.batch = plan.batch.get(d.job_id, job.batch)
            changes.append((job, d.want, len(job.gpus), job.segments[-1][1] if job.segments else 0.0))
            self.cache.unhold(job)
            job.gpus = ()
        for job, gpus, old_n, old_rate in changes:
            new_rate = self._rate(job, gpus)
            warm_idle = 0
            if old_n:
                if len(gpus) == old_n:
                    segs = self.overheads.migrate(now, new_rate)
                    job.migrations += 1
                else:
                    grow = len(gpus) > old_n
                    segs = self.overheads.resize(now, old_rate, new_rate, grow=grow)
                    job.rescales += 1
                    if grow and segs[0][1] > 0:
                        warm_idle = len(gpus) - old_n
                if job.state is not JobState.RESIZING:
                    self._set_state(job, JobState.RESIZING)
            else:
                segs = self.overheads.start(now, new_rate, resumed=job.start_time is not None)
                if job.start_time is None:
                    job.start_time = now
                self._set_state(job, JobState.RUNNING)
            self._hold(job, gpus)
            job.segments = with_idle(segs, len(gpus), warm_idle)
            job.last_t = now
            self._schedule_completion(job)
            self.cache.run(job, bool(old_n))


def simulate(
    jobs: Iterable[JobSpec],
    cluster: Cluster,
    policy: Policy,
    **kwargs: Any,
) -> SimResult:
    return Simulator(cluster, policy, jobs, **kwargs).run()
