"""``--fidelity artifact``: the public ElasticFlow artifact's executor semantics.

The ElasticFlow artifact (github.com/pkusys/ElasticFlow, ``scheduler/``)
evaluates its policies (ASPLOS'23 §6, Fig. 8) with a simulator whose rules
differ from Tidal's own engine (:mod:`tidal.sim.engine`). This module runs
the *same* registry policies (Snapshot in, Plan out) under those rules, so
the artifact's deadline-satisfactory ratios can be reproduced:

- **rounds**: a round runs at every arrival and completion, but events less
  than a slot after the last round are merged into one round a slot later;
- **progress**: between rounds a job does ``(dt - overhead) * throughput``
  iterations (profiled power-of-two counts, global batch fixed); it ends at
  ``ceil(remaining / throughput)`` seconds after a round, and holds its GPUs
  until the next round;
- **overheads** (the artifact's ``estimate_overhead``): per round, each
  charged job loses ``2 s``, plus ``2 (log2 n + 1) s`` on a GPU set not
  used since the last restart, plus ``27 s`` every 60th round (a restart);
  which jobs are charged depends on the policy (:class:`ArtifactSemantics`).

Which registry policy, with which options, stands for each of the
artifact's schedulers (its ``--schedule`` names, accepted as aliases):

| artifact name    | registry policy | options                                  |
|------------------|-----------------|------------------------------------------|
| ``ef-accessctrl``| ``elasticflow`` | the artifact's own planner and loop       |
|                  |                 | (:mod:`tidal.sim.artifact_ef`)             |
| ``edf``          | ``edf``         | ``count_rule="largest"``                   |
| ``dlas-gpu``     | ``tiresias``    | queues at 3,250 and 7,200 GPU-s, no promotion |
| ``themis``       | ``themis``      | 60 s leases                               |
| ``gandiva``      | ``gandiva``     | node-set time-slicing executor            |
|                  |                 | (:mod:`tidal.sim.artifact_gandiva`)        |
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Iterable

from tidal.core.job import JobSpec, JobState
from tidal.core.profile import ThroughputProfile, load_profiles
from tidal.core.topology import Cluster
from tidal.scheduler.api import Plan, Policy, Snapshot
from tidal.scheduler.registry import canonical, get_policy_for_slot
from tidal.sim.artifact_ef import ArtifactElasticFlow
from tidal.sim.artifact_gandiva import GandivaNodeSetSimulator
from tidal.sim.engine import SimResult
from tidal.sim.progress import SimJob

_EPS = 1e-9


@dataclass(frozen=True)
class ArtifactSemantics:
    """Knobs of the artifact's executor (ElasticFlow ``scheduler/scheduler.py``).

    ``charge``: which jobs pay the per-round overhead — ``"all"`` (every
    running job), ``"started"`` (jobs started or
    resumed this round, plus every running job on a restart round: Tiresias),
    ``"none"`` (EDF, Themis). ``cache``: a GPU set used since the last restart
    costs only ``base_s`` (ElasticFlow's trainer cache); without it every
    charged round pays the launch term. ``completion_rounds``: completions
    trigger a round (Gandiva only notices them at the next arrival).
    ``lease_grid``: rounds only on the grid ``first arrival + k * slot``
    (Themis' leases: a job arriving between two leases waits for the next).
    ``last_overhead_counts``: the overhead charged in a job's last round
    delays the completion that decides its deadline."""

    slot: float = 60.0
    base_s: float = 2.0
    launch_s: float = 2.0  # x (log2 n + 1), on a new GPU set
    restart_s: float = 27.0
    restart_every: int = 60
    charge: str = "all"
    cache: bool = True
    completion_rounds: bool = True
    last_overhead_counts: bool = True
    merge_rounds: bool = True
    lease_grid: bool = False

    def overhead(self, n: int, new_set: bool, restart: bool) -> float:
        """Seconds of no progress for a job of ``n`` GPUs in one round."""
        if not new_set:
            return self.base_s
        extra = self.restart_s if restart else 0.0
        return self.base_s + extra + self.launch_s * (math.log2(n) + 1)


class ArtifactSimulator:
    """Run one policy over job specs with the artifact's round semantics."""

    def __init__(
        self,
        cluster: Cluster,
        policy: Policy,
        jobs: Iterable[JobSpec],
        profiles: ThroughputProfile,
        semantics: ArtifactSemantics,
    ) -> None:
        self.cluster, self.policy, self.profiles, self.sem = cluster, policy, profiles, semantics
        specs = sorted(jobs, key=lambda s: s.submit_time)  # ties keep trace order (the artifact sorts on submit time alone)
        self.jobs = {s.job_id: SimJob(spec=s, last_t=s.submit_time, batch=s.batch_size) for s in specs}
        for j in self.jobs.values():
            j.single_rate = profiles.throughput(j.spec.model, j.spec.batch_size, 1) or 1.0
        self.arrivals = [s.job_id for s in specs]
        self.next_arrival = 0
        self.active: dict[str, SimJob] = {}
        self.overhead: dict[str, float] = {}  # seconds lost in the interval after the last round
        self.ends: dict[str, float] = {}  # completion event if nothing changes
        self.reported: dict[str, float] = {}  # the completion time its deadline is checked against
        self.cache: set[tuple[int, ...]] = set()
        self.rounds = 0
        self.busy_gpu_s = 0.0
        self.useful = 0.0
        self.timeline: list[tuple[float, int]] = []
        self.now = specs[0].submit_time if specs else 0.0
        self.last = self.now
        self.t0 = self.now
        self._wake: float | None = None

    # -- progress ------------------------------------------------------------
    def rate(self, job: SimJob) -> float:
        return self.profiles.throughput(job.spec.model, job.spec.batch_size, len(job.gpus))

    def _advance(self, t: float) -> None:
        """Progress of every running job from the last round to ``t``;
        jobs whose end is at or before ``t`` complete at their end."""
        dt = t - self.last
        for jid in [j for j, job in self.active.items() if job.gpus]:
            job = self.active[jid]
            n = len(job.gpus)
            self.busy_gpu_s += n * dt
            end = self.ends.get(jid, math.inf)
            run = max(0.0, min(t, end) - self.last - self.overhead.get(jid, 0.0))
            r = self.rate(job)
            job.done = min(job.spec.iterations, job.done + run * r)
            job.executed += run
            job.attained += run * n
            job.gpu_seconds += n * dt
            self.useful += r / job.single_rate * run
            if end <= t + _EPS:
                self._complete(job, self.reported.get(jid, end))
        self.last = t

    def _complete(self, job: SimJob, t: float) -> None:
        job.done = job.spec.iterations
        job.gpus = ()
        job.alloc.append((t, 0))
        job.state = JobState.COMPLETED
        job.end_time = t
        del self.active[job.spec.job_id]
        self.ends.pop(job.spec.job_id, None)

    # -- the loop ----------------------------------------------------------------
    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        while self.next_arrival < len(self.arrivals) or self.active:
            t = self._next_round()
            if t is None:
                break
            self._advance(t)
            self.now = t
            arrived: list[str] = []
            while self.next_arrival < len(self.arrivals) and \
                    self.jobs[self.arrivals[self.next_arrival]].spec.submit_time <= t + _EPS:
                jid = self.arrivals[self.next_arrival]
                self.active[jid] = self.jobs[jid]
                self.next_arrival += 1
                arrived.append(jid)
            self._round(t, arrived)
        return SimResult(
            policy=self.policy.name, cluster=self.cluster, jobs=list(self.jobs.values()),
            timeline=self.timeline or [(self.now, 0)],
            start=min((j.spec.submit_time for j in self.jobs.values()), default=0.0), end=self.now,
            busy_gpu_s=self.busy_gpu_s, useful_norm_s=self.useful, rounds=self.rounds,
            wall_seconds=time.perf_counter() - wall0,
        )

    def _next_round(self) -> float | None:
        """Earliest pending event; merged into one round a slot after the
        last round if it falls within that slot (the artifact's event merge)."""
        cands = []
        if self.next_arrival < len(self.arrivals):
            cands.append(self.jobs[self.arrivals[self.next_arrival]].spec.submit_time)
        if self.sem.completion_rounds or not cands:
            cands.extend(self.ends.values())
        if self._wake is not None:
            cands.append(self._wake)
        if not cands:
            # nothing will ever change: the waiting jobs cannot run
            return None
        t = min(cands)
        if self.sem.lease_grid and self.rounds:
            k = math.ceil((t - self.t0) / self.sem.slot - _EPS)
            return max(self.t0 + k * self.sem.slot, self.now + self.sem.slot)
        if self.rounds and self.sem.merge_rounds and t - self.now <= self.sem.slot + _EPS:
            t = self.now + self.sem.slot
        return max(t, self.now)

    def _round(self, now: float, arrived: list[str]) -> None:
        restart = self.rounds > 0 and self.rounds % self.sem.restart_every == 0
        self.rounds += 1
        plan = self.policy.schedule(self._snapshot(now))
        started = self._apply(plan, now)
        if restart:
            self.cache.clear()
        self._charge(now, started, restart, bool(arrived))
        self._wake = plan.wake_at if plan.wake_at is not None and plan.wake_at > now else None
        used = sum(len(j.gpus) for j in self.active.values())
        if not self.timeline or self.timeline[-1][1] != used:
            self.timeline.append((now, used))

    def _snapshot(self, now: float) -> Snapshot:
        return Snapshot(now=now, cluster=self.cluster, jobs=tuple(j.view() for j in self.active.values()),
                        profiles=self.profiles)

    def _apply(self, plan: Plan, now: float) -> set[str]:
        """Drops, admissions, tags, preemptions and new GPU sets; returns the
        jobs that start or resume in this round."""
        for jid, reason in plan.drop.items():
            job = self.active.pop(jid)
            job.state, job.drop_reason, job.end_time = JobState.DROPPED, reason or "dropped", now
        for jid in plan.admit:
            job = self.active[jid]
            if job.state is JobState.SUBMITTED:
                job.state, job.admitted, job.waiting_since = JobState.PENDING, True, now
        for jid, tags in plan.tags.items():
            if jid in self.active:
                self.active[jid].tags.update(tags)
        started: set[str] = set()
        for jid, job in self.active.items():
            gpus = tuple(sorted(plan.placement.get(jid, ()))) if plan.allocation.get(jid, 0) > 0 else ()
            if not gpus:
                if job.gpus:
                    job.gpus, job.state, job.waiting_since = (), JobState.PENDING, now
                    job.preemptions += 1
                    job.alloc.append((now, 0))
                self.ends.pop(jid, None)
                continue
            if not job.gpus:
                started.add(jid)
                job.start_time = now if job.start_time is None else job.start_time
            elif len(gpus) != len(job.gpus):
                job.rescales += 1
            if job.state in (JobState.PENDING, JobState.ADMITTED, JobState.SUBMITTED):
                job.state = JobState.RUNNING
            if len(gpus) != len(job.gpus):
                job.alloc.append((now, len(gpus)))
            job.gpus = gpus
            job.max_gpus = max(job.max_gpus, len(gpus))
        return started

    def _charge(self, now: float, started: set[str], restart: bool, arrived: bool) -> None:
        """Per-round overheads (the artifact's ``estimate_overhead``) and the
        resulting completion times."""
        sem = self.sem
        self.overhead = {}
        for jid, job in self.active.items():
            if not job.gpus:
                continue
            n = len(job.gpus)
            if sem.charge == "all" and (arrived or sem.completion_rounds):
                new = not sem.cache or job.gpus not in self.cache
                ovh = sem.overhead(n, new, restart)
            elif sem.charge == "started" and (jid in started or restart):
                ovh = sem.overhead(n, True, restart)
            else:
                ovh = 0.0
            if sem.cache:
                self.cache.add(job.gpus)
            self.overhead[jid] = ovh
            r = self.rate(job)
            need = math.ceil(max(job.spec.iterations - job.done, 0.0) / r - _EPS) if r > 0 else math.inf
            self.ends[jid] = now + need + ovh
            self.reported[jid] = now + need + (ovh if sem.last_overhead_counts else 0.0)


def run_artifact(
    jobs: Iterable[JobSpec],
    cluster: Cluster,
    policy_name: str,
    profiles: ThroughputProfile | None = None,
    slot: float = 60.0,
) -> SimResult:
    """Simulate ``policy_name`` (a registry name or an artifact alias such as
    ``ef-accessctrl``) with the artifact's semantics and its policy options."""
    profiles = profiles or load_profiles()
    executor = EXECUTORS.get(canonical(policy_name))
    if executor is not None:
        result = executor(cluster, jobs, profiles, slot=slot).run()
        result.policy = policy_name
        return result
    policy, semantics = artifact_setup(policy_name, slot)
    return ArtifactSimulator(cluster, policy, jobs, profiles, semantics).run()


#: registry names whose artifact version is its own executor, not a Snapshot -> Plan
#: policy: Gandiva is a cluster mechanism (node sets, time-slicing), and the
#: artifact's ElasticFlow plans and admits differently from §4.2.
EXECUTORS = {"gandiva": GandivaNodeSetSimulator, "elasticflow": ArtifactElasticFlow}

#: registry name -> (policy options, semantics) of the artifact's version.
SETUPS: dict[str, tuple[dict[str, Any], ArtifactSemantics]] = {
    "edf": ({"count_rule": "largest"}, ArtifactSemantics(charge="none")),
    "tiresias": ({"thresholds": (3250.0, 7200.0), "promote_knob": math.inf},
                 ArtifactSemantics(charge="started", cache=False)),
    "themis": ({"lease": 60.0}, ArtifactSemantics(charge="none", lease_grid=True)),
}


def artifact_setup(name: str, slot: float = 60.0) -> tuple[Policy, ArtifactSemantics]:
    """The policy object and executor semantics for an artifact or registry name
    (not for those in :data:`EXECUTORS`, which have their own executor)."""
    reg = canonical(name)
    if reg in EXECUTORS:
        raise ValueError(f"{name!r} runs on its own artifact executor ({EXECUTORS[reg].__name__}), not a policy")
    options, sem = SETUPS.get(reg, ({}, ArtifactSemantics()))
    policy = get_policy_for_slot(reg, slot, **options) if options else get_policy_for_slot(reg, slot)
    policy.name = name
    return policy, replace(sem, slot=slot)


def simulate_fidelity(
    jobs: Iterable[JobSpec],
    cluster: Cluster,
    policy_name: str,
    profiles: ThroughputProfile | None = None,
    slot: float = 60.0,
    fidelity: str = "tidal",
    **engine_options: Any,
) -> SimResult:
    """``fidelity="tidal"``: Tidal's own engine (:class:`tidal.sim.engine.Simulator`,
    ``engine_options`` go to it); ``"artifact"``: :func:`run_artifact`."""
    if fidelity == "artifact":
        return run_artifact(jobs, cluster, policy_name, profiles, slot)
    if fidelity != "tidal":
        raise ValueError(f"fidelity must be 'tidal' or 'artifact', got {fidelity!r}")
    from tidal.sim.engine import Simulator

    policy = get_policy_for_slot(canonical(policy_name), slot)
    return Simulator(cluster, policy, jobs, profiles=profiles, slot=slot, **engine_options).run()

