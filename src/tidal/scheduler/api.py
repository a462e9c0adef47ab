"""The one policy interface both worlds call: simulator and control plane.

A policy sees a frozen :class:`Snapshot` (cluster, jobs, profiles, overheads,
now) and returns a :class:`Plan`. It never does I/O, sleeps or reads a clock.
Scheduling is split the Blox way: ``admission`` -> ``allocation`` ->
``placement``; :meth:`Policy.schedule` chains them.

Per-job policy memory (Tiresias' promotion, ElasticFlow's guarantees) lives
in the snapshot as ``JobView.tags`` and comes back through ``Plan.tags``: the
executor stores it, the policy object stays stateless.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

from tidal.core.job import JobSpec, JobState
from tidal.core.overhead import OverheadModel
from tidal.core.profile import ThroughputProfile
from tidal.core.topology import Cluster
from tidal.scheduler.placement import place_consolidated

EMPTY: Mapping[str, Any] = MappingProxyType({})
_RUNNING = frozenset({JobState.RUNNING, JobState.RESIZING})


class JobView(NamedTuple):
    """One job as the policy sees it at ``Snapshot.now`` (immutable; a named
    tuple because the simulator builds hundreds of thousands of them)."""

    spec: JobSpec
    state: JobState
    gpus: tuple[int, ...] = ()  # GPUs held now (running / resizing)
    done: float = 0.0  # iterations completed
    attained: float = 0.0  # GPU-seconds received so far (Tiresias' attained service)
    executed: float = 0.0  # wall seconds spent running
    waiting_since: float = 0.0  # when it last became pending
    admitted: bool = False
    tags: Mapping[str, Any] = EMPTY
    batch: int = 0  # current global batch (0: the spec's); hybrid scaling changes it

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def size(self) -> int:
        """GPUs held now (one per worker)."""
        return len(self.gpus)

    @property
    def remaining(self) -> float:
        return max(0.0, self.spec.iterations - self.done)

    @property
    def running(self) -> bool:
        return self.state in _RUNNING


@dataclass(frozen=True)
class Snapshot:
    now: float
    cluster: Cluster
    jobs: tuple[JobView, ...]  # active jobs: submitted, pending, running, resizing
    profiles: ThroughputProfile
    overheads: OverheadModel = field(default_factory=OverheadModel)

    def throughput(self, job: JobView | JobSpec, n: float) -> float:
        """Iterations/s at the job's submitted global batch on ``n`` GPUs."""
        spec = job.spec if isinstance(job, JobView) else job
        return self.profiles.throughput(spec.model, spec.batch_size, n)

    def progress_rate(self, job: JobView | JobSpec, n: float, batch: int | None = None) -> float:
        """Progress in the spec's iterations per second at global ``batch``
        (default: the spec's): a batch twice as large does an iteration's
        worth of samples twice per step (Elan §VI, hybrid scaling)."""
        spec = job.spec if isinstance(job, JobView) else job
        b = batch or spec.batch_size
        return self.profiles.throughput(spec.model, b, n) * b / spec.batch_size


@dataclass
class Plan:
    """What a policy wants. ``allocation`` lists every job that should hold GPUs
    after this plan (count); jobs left out are pending (preempted if running).
    ``placement`` gives the GPU ids for each allocated job. ``drop`` maps job id
    to a reason. ``batch`` changes a job's global batch (progress is counted in
    the spec's iterations, see :meth:`Snapshot.progress_rate`). ``wake_at`` asks the executor to call again at that time even
    if nothing happens (e.g. a Tiresias queue threshold is crossed)."""

    admit: set[str] = field(default_factory=set)
    drop: dict[str, str] = field(default_factory=dict)
    allocation: dict[str, int] = field(default_factory=dict)
    placement: dict[str, tuple[int, ...]] = field(default_factory=dict)
    tags: dict[str, dict[str, Any]] = field(default_factory=dict)
    wake_at: float | None = None
    batch: dict[str, int] = field(default_factory=dict)  # new global batch per job (hybrid scaling)


class Policy(abc.ABC):
    """Base class: admission -> allocation -> placement."""

    name: str = "?"

    def schedule(self, snap: Snapshot) -> Plan:
        plan = Plan()
        self.admission(snap, plan)
        self.allocation(snap, plan)
        self.placement(snap, plan)
        return plan

    def admission(self, snap: Snapshot, plan: Plan) -> None:
        """Default: admit every submitted job that could ever fit the cluster."""
        total = snap.cluster.num_gpus
        for j in snap.jobs:
            if j.state is not JobState.SUBMITTED:
                continue
            if j.spec.lo > total or not j.spec.counts(total):
                plan.drop[j.job_id] = f"needs {j.spec.lo} GPUs, cluster has {total}"
            elif snap.throughput(j, j.spec.lo) <= 0:
                plan.drop[j.job_id] = f"model {j.spec.model} does not run at {j.spec.lo} GPUs"
            else:
                plan.admit.add(j.job_id)

    @abc.abstractmethod
    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        """Fill ``plan.allocation`` (GPU count per job that should run)."""

    def placement(self, snap: Snapshot, plan: Plan) -> None:
        """Default: :func:`~tidal.scheduler.placement.place_consolidated`."""
        plan.placement = place_consolidated(snap, plan.allocation)


def schedulable(snap: Snapshot, plan: Plan) -> list[JobView]:
    """Jobs that may get GPUs in this plan: admitted before or now, not dropped."""
    return [
        j
        for j in snap.jobs
        if j.job_id not in plan.drop and (j.admitted or j.job_id in plan.admit)
    ]
