"""Discrete-event simulator: the executor that runs a policy's plans on a trace.

Events are arrivals, completions and scheduling rounds; nothing loops per
second. A job's progress is a list of segments ``(start, rate, idle_gpus)``
(rate in iterations/s, 0 while paused by a rescale), so a rescale's overhead
(:mod:`tidal.core.overhead`) is exact and completion times are computed, not
stepped. Scheduling rounds happen at multiples of ``slot`` seconds after any
event (``slot=0``: at the event itself), and when a plan asks to be woken.
The simulator validates every plan: a GPU is never held by two jobs, a rigid
job runs only at its count, allocations match placements.
"""

from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable

from tidal.core.job import JobSpec, JobState, check_transition
from tidal.core.overhead import OverheadModel
from tidal.core.profile import ThroughputProfile, load_profiles
from tidal.core.topology import Cluster
from tidal.scheduler.api import EMPTY, JobView, Plan, Policy, Snapshot

log = logging.getLogger(__name__)

_COMPLETE, _ARRIVAL, _SCHED = 0, 1, 2
_EPS = 1e-9


class PolicyError(RuntimeError):
    """A plan broke an invariant (double-allocated GPU, illegal count...)."""


@dataclass
class SimJob:
    spec: JobSpec
    state: JobState = JobState.SUBMITTED
    gpus: tuple[int, ...] = ()
    done: float = 0.0
    last_t: float = 0.0
    segments: list[tuple[float, float, int]] = field(default_factory=list)
    attained: float = 0.0
    executed: float = 0.0
    waiting_since: float = 0.0
    admitted: bool = False
    tags: dict[str, Any] = field(default_factory=dict)
    start_time: float | None = None
    end_time: float | None = None
    drop_reason: str = ""
    rescales: int = 0
    preemptions: int = 0
    migrations: int = 0
    overhead_gpu_s: float = 0.0
    max_gpus: int = 0
    gpu_seconds: float = 0.0
    version: int = 0
    single_rate: float = 0.0  # iterations/s on one GPU, for cluster efficiency
    batch: int = 0  # current global batch

    def view(self) -> JobView:
        return JobView(
            self.spec,
            self.state,
            self.gpus,
            self.done,
            self.attained,
            self.executed,
            self.waiting_since,
            self.admitted,
            MappingProxyType(dict(self.tags)) if self.tags else EMPTY,
            self.batch,
        )


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
        self.owner: dict[int, str] = {}
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._sched_times: set[float] = set()
        self.now = specs[0].submit_time if specs else 0.0
        self.timeline: list[tuple[float, int]] = [(self.now, 0)]
        self.busy_gpu_s = 0.0
        self.useful = 0.0
        self._acct_t = self.now
        self._arrivals_left = len(specs)
        self.rounds = 0
        self.finished = 0
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

    # -- progress accounting -------------------------------------------------
    def _account(self, t: float) -> None:
        """Cluster-wide integrals up to ``t`` (utilisation, efficiency)."""
        dt = t - self._acct_t
        if dt > 0:
            self.busy_gpu_s += len(self.owner) * dt
            self._acct_t = t

    def _advance(self, job: SimJob, t: float) -> None:
        """Bring ``job.done`` and its counters up to time ``t``."""
        if t <= job.last_t:
            return
        if not job.gpus:
            job.last_t = t
            return
        segs = job.segments
        n = len(job.gpus)
        t0 = job.last_t
        dt = t - t0
        if len(segs) == 1 and segs[0][0] <= t0:
            rate = segs[0][1]
            job.done += rate * dt
            job.overhead_gpu_s += segs[0][2] * dt
            self.useful += rate / job.single_rate * dt
            job.attained += n * dt
            job.executed += dt
            job.gpu_seconds += n * dt
            job.last_t = t
            return
        for i, (start, rate, idle) in enumerate(segs):
            end = segs[i + 1][0] if i + 1 < len(segs) else math.inf
            a, b = max(start, t0), min(end, t)
            if b > a:
                job.done += rate * (b - a)
                job.overhead_gpu_s += idle * (b - a)
                self.useful += rate / job.single_rate * (b - a)
        # keep only the segment in force at t and later ones
        while len(segs) > 1 and segs[1][0] <= t:
            segs.pop(0)
        job.attained += n * dt
        job.executed += dt
        job.gpu_seconds += n * dt
        job.last_t = t
        if job.state is JobState.RESIZING and len(segs) == 1:
            job.state = JobState.RUNNING

    def _finish_time(self, job: SimJob) -> float:
        left = job.spec.iterations - job.done
        t = job.last_t
        segs = job.segments
        for i, (start, rate, _idle) in enumerate(segs):
            end = segs[i + 1][0] if i + 1 < len(segs) else math.inf
            a = max(start, t)
            if end <= a:
                continue
            if rate > 0:
                need = left / rate
                if a + need <= end:
                    return a + need
                left -= rate * (end - a)
        return math.inf

    def _schedule_completion(self, job: SimJob) -> None:
        job.version += 1
        t = self._finish_time(job)
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
        for g in job.gpus:
            del self.owner[g]
        job.gpus = ()
        job.segments = []
        self.running.pop(job.spec.job_id, None)

    def _hold(self, job: SimJob, gpus: tuple[int, ...]) -> None:
        for g in gpus:
            if g in self.owner and self.owner[g] != job.spec.job_id:
                raise PolicyError(f"GPU {g} given to {job.spec.job_id} but held by {self.owner[g]}")
        for g in gpus:
            self.owner[g] = job.spec.job_id
        job.gpus = gpus
        job.max_gpus = max(job.max_gpus, len(gpus))
        self.running[job.spec.job_id] = job

    def _complete(self, job: SimJob, t: float) -> None:
        self._advance(job, t)
        job.done = job.spec.iterations
        self._release(job)
        self._set_state(job, JobState.COMPLETED)
        job.end_time = t
        del self.active[job.spec.job_id]
        self.finished += 1

    # -- the loop ----------------------------------------------------------------
    def run(self) -> SimResult:
        import time

        wall0 = time.perf_counter()
        total = len(self.jobs)
        last_report = -1
        while self._heap:
            t, kind, _, payload = heapq.heappop(self._heap)
            if self.until is not None and t > self.until:
                break
            self._account(t)
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
                job = self.jobs[payload]
                self.active[payload] = job
                self._arrivals_left -= 1
                self._request_round(t)
            else:
                self._sched_times.discard(t)
                self._round(t)
                self._record_usage(t)
            if self.on_progress and self.finished != last_report:
                last_report = self.finished
                self.on_progress(self.finished + self._dropped(), total)
        end = self.now
        for job in self.running.values():
            self._advance(job, end)
        self._account(end)
        starts = [j.spec.submit_time for j in self.jobs.values()]
        result = SimResult(
            policy=self.policy.name,
            cluster=self.cluster,
            jobs=list(self.jobs.values()),
            timeline=self.timeline,
            start=min(starts) if starts else 0.0,
            end=end,
            busy_gpu_s=self.busy_gpu_s,
            useful_norm_s=self.useful,
            rounds=self.rounds,
        )
        result.wall_seconds = time.perf_counter() - wall0
        return result

    _n_dropped = 0

    def _dropped(self) -> int:
        return self._n_dropped

    def _record_usage(self, t: float) -> None:
        used = len(self.owner)
        if self.timeline[-1][1] != used:
            if self.timeline[-1][0] == t:
                self.timeline[-1] = (t, used)
            else:
                self.timeline.append((t, used))

    def _round(self, now: float) -> None:
        self.rounds += 1
        for job in self.running.values():
            self._advance(job, now)
        snap = Snapshot(
            now=now,
            cluster=self.cluster,
            jobs=tuple(j.view() for j in self.active.values()),
            profiles=self.profiles,
            overheads=self.overheads,
        )
        plan = self.policy.schedule(snap)
        self._apply(plan, now)
        stuck = not self.running and self._arrivals_left == 0
        if plan.wake_at is not None and plan.wake_at < math.inf and not stuck:
            self._request_round(max(plan.wake_at, now + (self.slot or 1e-6)))

    def _apply(self, plan: Plan, now: float) -> None:
        jobs = self.jobs
        for jid, reason in plan.drop.items():
            job = jobs[jid]
            if job.state not in (JobState.SUBMITTED, JobState.PENDING, JobState.ADMITTED):
                raise PolicyError(f"policy {self.policy.name} dropped {jid} in state {job.state.value}")
            job.state = JobState.DROPPED
            job.drop_reason = reason or "dropped by policy"
            job.end_time = now
            del self.active[jid]
            self._n_dropped += 1
        for jid in plan.admit:
            job = jobs[jid]
            if job.state is JobState.SUBMITTED:
                self._set_state(job, JobState.ADMITTED)
                self._set_state(job, JobState.PENDING)
                job.admitted = True
                job.waiting_since = now
        for jid, tags in plan.tags.items():
            if jid in self.active:
                self.active[jid].tags.update(tags)
        if self.validate:
            self._check(plan)
        for jid, b in plan.batch.items():
            if jid in self.active and not self.active[jid].gpus:
                self.active[jid].batch = b
        # preempt first, so GPUs are free for the others
        for jid in list(self.running):
            if plan.allocation.get(jid, 0) == 0:
                job = self.running[jid]
                self._advance(job, now)
                self._release(job)
                self._set_state(job, JobState.PENDING)
                job.waiting_since = now
                job.preemptions += 1
                job.version += 1
        # two passes, so that jobs may swap GPUs: release every changing job's
        # old GPUs, then hold the new ones (checked against double use)
        changes = []
        for jid, n in sorted(plan.allocation.items()):
            if n <= 0:
                continue
            job = jobs[jid]
            gpus = tuple(sorted(plan.placement[jid]))
            new_batch = plan.batch.get(jid, job.batch)
            if job.gpus == gpus and new_batch == job.batch:
                continue
            self._advance(job, now)
            if job.gpus == gpus:
                # batch change only: applied at the next step boundary, no rescale
                job.batch = new_batch
                start, _, idle = job.segments[-1]
                job.segments[-1] = (max(start, now), self._rate(job, gpus), idle)
                self._schedule_completion(job)
                continue
            job.batch = new_batch
            changes.append((job, gpus, len(job.gpus), self._current_rate(job)))
            for g in job.gpus:
                del self.owner[g]
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
            job.segments = [
                (start, rate, len(gpus) if rate == 0 else (warm_idle if i == 0 else 0))
                for i, (start, rate) in enumerate(segs)
            ]
            job.last_t = now
            self._schedule_completion(job)

    def _current_rate(self, job: SimJob) -> float:
        return job.segments[-1][1] if job.segments else 0.0

    def _check(self, plan: Plan) -> None:
        """Validate the jobs whose GPUs change; unchanged ones were checked when
        they got them. A new GPU must be free now or held by a job that gives
        it up in this plan, and no two changing jobs may take the same GPU."""
        taken: dict[int, str] = {}
        total = self.cluster.num_gpus
        for jid, b in plan.batch.items():
            if not isinstance(b, int) or b <= 0:
                raise PolicyError(f"global batch {b!r} for {jid} must be a positive integer")
        keeps = {jid for jid, n in plan.allocation.items() if n > 0}
        for jid, n in plan.allocation.items():
            if n <= 0:
                continue
            job = self.jobs.get(jid)
            if job is None or jid not in self.active:
                raise PolicyError(f"allocation for unknown or finished job {jid}")
            gpus = plan.placement.get(jid)
            if gpus is None or len(gpus) != n or len(set(gpus)) != n:
                raise PolicyError(f"placement of {jid} does not match its allocation {n}")
            if job.gpus and (gpus is job.gpus or tuple(sorted(gpus)) == job.gpus):
                continue
            if not job.admitted:
                raise PolicyError(f"allocation for job {jid} that was never admitted")
            if not job.spec.can_run_at(n):
                raise PolicyError(f"job {jid} cannot run at {n} GPUs")
            for g in gpus:
                if not 0 <= g < total:
                    raise PolicyError(f"GPU {g} of {jid} is not in the cluster")
                if g in taken:
                    raise PolicyError(f"GPU {g} placed for both {taken[g]} and {jid}")
                taken[g] = jid
            if self._rate(job, tuple(gpus)) <= 0:
                raise PolicyError(f"job {jid} has zero throughput at {n} GPUs")
        for g, jid in taken.items():
            holder = self.owner.get(g)
            if holder is not None and holder != jid and holder in keeps:
                held = plan.placement.get(holder, ())
                if g in held:
                    raise PolicyError(f"GPU {g} placed for both {holder} and {jid}")


def simulate(
    jobs: Iterable[JobSpec],
    cluster: Cluster,
    policy: Policy,
    **kwargs: Any,
) -> SimResult:
    return Simulator(cluster, policy, jobs, **kwargs).run()
