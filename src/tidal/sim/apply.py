"""Applying a policy's plan to the simulated cluster (the executor half of
:class:`tidal.sim.engine.Simulator`).

Each round's plan is validated (:func:`tidal.scheduler.diff.validate_plan`:
a GPU is never held by two jobs, a rigid job runs only at its count,
allocations match placements) and its :func:`~tidal.scheduler.diff.diff_plan`
applied: drops and admissions, preemptions, batch changes, then starts,
rescales and migrations with their overheads (:mod:`tidal.core.overhead`).
Only the jobs whose GPUs may change are looked at closely.
"""

from __future__ import annotations

from tidal.core.job import JobState, check_transition
from tidal.core.overhead import OverheadModel
from tidal.core.profile import ThroughputProfile
from tidal.core.topology import Cluster
from tidal.scheduler.api import Plan, Policy, Snapshot
from tidal.scheduler.constraints import breaks
from tidal.scheduler.diff import JobDelta, PlanError, changing, diff_plan, validate_plan
from tidal.sim.progress import Progress, SimJob, with_idle
from tidal.sim.views import ViewCache

_DROPPABLE = (JobState.SUBMITTED, JobState.PENDING, JobState.ADMITTED)
_PENDING, _RUNNING = JobState.PENDING, JobState.RUNNING


class PolicyError(RuntimeError):
    """A plan broke an invariant (double-allocated GPU, illegal count...)."""


class PlanExecutor:
    """The state changes a plan makes; :class:`~tidal.sim.engine.Simulator`
    owns the state and the event queue."""

    cluster: Cluster
    policy: Policy
    profiles: ThroughputProfile
    overheads: OverheadModel
    validate: bool
    jobs: dict[str, SimJob]
    active: dict[str, SimJob]
    running: dict[str, SimJob]
    cache: ViewCache
    owner: dict[int, str]
    progress: Progress
    now: float
    dropped: int

    def _schedule_completion(self, job: SimJob) -> None:
        """Queue ``job``'s completion event (the engine's event queue)."""
        raise NotImplementedError

    def _rate(self, job: SimJob, gpus: tuple[int, ...], batch: int | None = None) -> float:
        """Progress rate in the spec's iterations/s (see Snapshot.progress_rate)."""
        n = len(gpus)
        b = batch or job.batch
        # -- goodput jobs (Pollux): goodput on the nodes the GPUs span, tidal.scheduler.goodput
        owns = getattr(self.profiles, "owns", None)
        if owns is not None and owns(job.spec):
            nodes = self.cluster.nodes_spanned(gpus) if n else 0
            return self.profiles.job_rate(job.spec, n, b, job.done, nodes)  # type: ignore[attr-defined]
        # -- end goodput
        if self.profiles.by_type:  # the slowest GPU type of the placement sets the pace
            types = {self.cluster.gpu_type_of(g) for g in gpus}
            # spread: more nodes than the placement's own types need (4-GPU T4 nodes hold 8 GPUs on 2)
            spread = n > 1 and self.cluster.nodes_spanned(gpus) > self.cluster.min_nodes(n, types)
            return self.profiles.throughput_on(job.spec.model, b, n, spread, types) * b / job.spec.batch_size
        spread = n > 1 and self.cluster.nodes_spanned(gpus) > self.cluster.min_nodes(n)
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
        if job.spec.constrained:
            bad = breaks(self.cluster, job.spec, gpus)
            if bad is not None:
                raise PolicyError(f"policy {self.policy.name} placed {job.spec.job_id} on GPU {bad} of type "
                                  f"{self.cluster.gpu_type_of(bad)!r}, which the job does not allow")
        job.gpus = gpus
        job.alloc.append((self.now, len(gpus)))
        self.cache.hold(job)
        job.max_gpus = max(job.max_gpus, len(gpus))
        self.running[job.spec.job_id] = job

    def _apply(self, snap: Snapshot, plan: Plan, now: float) -> None:
        self._drop_and_admit(plan, now)
        if not plan.batch:
            look = self._starting(snap, plan)
            if look is not None and self._start_only(plan, look, now):
                return
        look = changing(snap, plan)
        deltas = diff_plan(snap, plan, look)
        rates = self._check(snap, plan, deltas, look) if self.validate else {}
        for jid, b in plan.batch.items():
            if jid in self.active and not self.active[jid].gpus:
                self.active[jid].batch = b
                self.cache.touch(self.active[jid])
        # preempt first, so GPUs are free for the others
        for jid, delta in deltas.items():
            if not delta.want:
                self._preempt(self.jobs[jid], now)
        self._rebatch(plan, deltas, now)
        self._move(plan, [deltas[jid] for jid in sorted(deltas) if deltas[jid].want], now, rates)

    def _starting(self, snap: Snapshot, plan: Plan) -> set[str] | None:
        """What :func:`~tidal.scheduler.diff.changing` returns when every job
        holding GPUs keeps them and every other job ``plan`` allocates or
        places is a job of ``snap`` without GPUs, allocated and placed (most
        rounds): those jobs. None if that is not so (``changing`` tells)."""
        alloc, placement, held, sizes = plan.allocation, plan.placement, snap.held, snap.sizes
        if not (held.items() <= placement.items() and sizes.items() <= alloc.items()):
            return None
        new = [jid for jid in self.cache.idle_ids if jid in alloc]  # the snapshot's jobs without GPUs
        if len(alloc) != len(sizes) + len(new) or len(placement) != len(held) + len(new):
            return None  # a job not in the snapshot, or placed and not allocated
        if not all(map(placement.__contains__, new)):
            return None
        return set(new)

    def _start_only(self, plan: Plan, look: set[str], now: float) -> bool:
        """Apply ``plan`` if the only jobs whose GPUs change (``look``) are jobs
        without GPUs that start, on free GPUs, and every check of
        :meth:`_check` passes (most rounds); return False, having changed
        nothing, otherwise (the general path applies it, or names the error).
        The effects are those of :meth:`_move` for such jobs, in the same order."""
        alloc, placement, drop, active, owner = plan.allocation, plan.placement, plan.drop, self.active, self.owner
        if not alloc:
            return not look
        if drop and not alloc.keys().isdisjoint(drop):
            return False
        total, admit = self.cluster.num_gpus, plan.admit
        starts = []
        taken = 0
        for jid in sorted(look):
            job = active.get(jid)
            n = alloc.get(jid)
            if job is None or job.gpus or n is None or n <= 0 or job.state is not _PENDING:
                return False
            gpus = placement.get(jid)
            if gpus is None or len(gpus) != n or not (job.admitted or jid in admit):
                return False
            spec = job.spec
            if spec.constrained or not spec.can_run_at(n):
                return False
            starts.append((job, gpus))
            taken += n
        if not starts:
            return True
        every = [g for _, gpus in starts for g in gpus]
        if (len(set(every)) != taken or min(every) < 0 or max(every) >= total
                or any(map(owner.__contains__, every))):
            return False  # a GPU placed twice, outside the cluster, or held
        want = []
        rate = self._rate
        for job, gpus in starts:
            gpus = tuple(sorted(gpus))
            r = rate(job, gpus)
            if r <= 0:
                return False
            want.append((job, gpus, r))
        start, running, hold, schedule = self.overheads.start, self.running, self.cache.hold, self._schedule_completion
        add, tags = self.cache.rows.add, self.cache.tags
        for job, gpus, r in want:  # _move's second pass, for jobs without GPUs
            segs = start(now, r, resumed=job.start_time is not None)
            if job.start_time is None:
                job.start_time = now
            job.state = _RUNNING
            n = len(gpus)
            job.gpus = gpus  # _hold, its checks done above
            job.alloc.append((now, n))
            hold(job)
            if n > job.max_gpus:
                job.max_gpus = n
            jid = job.spec.job_id
            running[jid] = job
            job.segments = with_idle(segs, n, 0)
            job.last_t = now
            schedule(job)
            add(job, tags[jid])  # ViewCache.run for a job that did not run
        return True

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

    def _check(self, snap: Snapshot, plan: Plan, deltas: dict[str, JobDelta], look: set[str]) -> dict[str, float]:
        """:func:`validate_plan`, and every job that gets new GPUs must make
        progress on them (at the batch the plan gives it, else its current
        one). Returns those rates."""
        try:
            validate_plan(snap, plan, look)
        except PlanError as e:
            raise PolicyError(f"policy {self.policy.name}: {e}") from e
        rates = {}
        for jid, delta in deltas.items():
            if delta.want:
                rates[jid] = rate = self._rate(self.jobs[jid], delta.want, plan.batch.get(jid))
                if rate <= 0:
                    raise PolicyError(f"job {jid} has zero throughput at {len(delta.want)} GPUs")
        return rates

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

    def _move(self, plan: Plan, deltas: list[JobDelta], now: float, rates: dict[str, float]) -> None:
        """Start, grow, shrink and migrate jobs. Two passes, so that jobs may
        swap GPUs: release every changing job's old GPUs, then hold the new
        ones (checked against double use). ``rates``: each job's rate on its
        new GPUs at its batch before this plan, where known."""
        changes = []
        for d in deltas:
            job = self.jobs[d.job_id]
            changes.append((job, d.want, len(job.gpus), job.segments[-1][1] if job.segments else 0.0))
            if job.gpus:  # a job without GPUs has nothing to advance (last_t is set below)
                if d.job_id in self.running:
                    self.cache.rows.flush(job)
                self.progress.advance(job, now)
                self.cache.unhold(job)
                job.gpus = ()
            if d.job_id in plan.batch:
                job.batch = plan.batch[d.job_id]
                rates.pop(d.job_id, None)
        for job, gpus, old_n, old_rate in changes:
            new_rate = rates.get(job.spec.job_id)
            if new_rate is None:
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

