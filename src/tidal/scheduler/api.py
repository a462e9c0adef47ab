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
import functools
from dataclasses import dataclass, field
from functools import cached_property
from itertools import compress
from operator import and_, attrgetter, not_, or_, truth
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
from tidal.core.job import JobSpec, JobState
from tidal.core.overhead import OverheadModel
from tidal.core.profile import ThroughputProfile
from tidal.core.topology import Cluster, Node
from tidal.scheduler.constraints import enforce_types
from tidal.scheduler.placement import place_consolidated

EMPTY: Mapping[str, Any] = MappingProxyType({})


class FrozenDict(dict):  # type: ignore[type-arg]
    """A dict whose mutating methods raise: the snapshot's indexes. Lookups
    stay C-level (a mapping proxy's ``get`` is several times slower); an
    executor fills one with the ``dict`` methods themselves."""

    def _read_only(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a snapshot index is read-only")

    __setitem__ = __delitem__ = __ior__ = _read_only  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _read_only  # type: ignore[assignment]


_JOB_ID = attrgetter("spec.job_id")
_ADMITTED = attrgetter("admitted")


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

    # C-level getters: policies read these hundreds of times per round
    job_id = property(_JOB_ID, doc="The spec's job id.")
    running = property(attrgetter("state.holds_gpus"), doc="Running or resizing (holding GPUs).")

    @property
    def size(self) -> int:
        """GPUs held now (one per worker)."""
        return len(self.gpus)

    @property
    def remaining(self) -> float:
        return max(0.0, self.spec.iterations - self.done)


@dataclass(frozen=True)
class Snapshot:
    """What a policy sees. The indexes below (``held``, ``sizes``, ``owners``,
    ``ids``, ``idle``...) are derived from ``jobs`` on first use; an executor
    that already has them may hand them in with :meth:`indexed`. ``jobs`` is a
    sequence of views (a tuple, or an executor's equal sequence that builds
    its views on first use)."""

    now: float
    cluster: Cluster
    jobs: Sequence[JobView]  # active jobs: submitted, pending, running, resizing (a tuple, or equal to one)
    profiles: ThroughputProfile
    overheads: OverheadModel = field(default_factory=OverheadModel)
    # registered nodes not up now (a live cluster's down or unreachable agents): not
    # the policy's to use, but a job whose GPU types only they have waits for them
    away: tuple[Node, ...] = ()

    def indexed(self, **indexes: Any) -> Snapshot:
        """Set indexes (``held``, ``sizes``, ``free``, ``by_free``, ``submitted``...) the
        executor maintains; they must match ``jobs`` and never change afterwards.
        Returns ``self``."""
        self.__dict__.update(indexes)
        return self

    @cached_property
    def held(self) -> FrozenDict:
        """Job id -> GPUs it holds, for the jobs holding any (order unspecified)."""
        return FrozenDict({v.spec.job_id: v.gpus for v in self.jobs if v.gpus})

    @cached_property
    def sizes(self) -> FrozenDict:
        """Job id -> number of GPUs held, for the jobs holding any."""
        return FrozenDict({jid: len(g) for jid, g in self.held.items()})

    @cached_property
    def owners(self) -> FrozenDict:
        """GPU -> the job holding it."""
        return FrozenDict({g: jid for jid, gpus in self.held.items() for g in gpus})

    @cached_property
    def free(self) -> tuple[tuple[int, ...], ...]:
        """Per node, its free GPUs (ascending)."""
        c, owners = self.cluster, self.owners
        return tuple(tuple(g for g in c.gpus_of_node(node) if g not in owners) for node in range(c.num_nodes))

    @cached_property
    def by_free(self) -> tuple[tuple[int, ...], ...]:
        """Per count ``k`` (0 .. GPUs of the largest node), the nodes with exactly ``k`` free GPUs (ascending)."""
        out: list[list[int]] = [[] for _ in range(self.cluster.max_gpus_per_node + 1)]
        for node, gpus in enumerate(self.free):
            out[len(gpus)].append(node)
        return tuple(map(tuple, out))

    @cached_property
    def submitted(self) -> tuple[JobView, ...]:
        """The jobs in state submitted, in snapshot order."""
        return tuple(j for j in self.jobs if j.state is JobState.SUBMITTED)

    @cached_property
    def ids(self) -> tuple[str, ...]:
        """The job ids of ``jobs``, in order."""
        return tuple(map(_JOB_ID, self.jobs))

    @cached_property
    def idle(self) -> tuple[JobView, ...]:
        """The jobs holding no GPUs, in snapshot order."""
        return tuple(j for j in self.jobs if not j.gpus)

    @cached_property
    def used_mask(self) -> np.ndarray:
        """Per GPU of the cluster, whether a job holds it (a read-only bool array)."""
        mask = np.zeros(self.cluster.num_gpus, dtype=bool)
        held = [g for gpus in self.held.values() for g in gpus]
        if held:
            mask[held] = True
        mask.flags.writeable = False
        return mask

    @cached_property
    def holders_running(self) -> bool:
        """Every job holding GPUs is admitted and running or resizing (always
        so in the simulator; a store read mid-transition may break it)."""
        return all(j.admitted and j.state.holds_gpus for j in self.jobs if j.gpus)

    @cached_property
    def view_of(self) -> Mapping[str, JobView]:
        """Job id -> its view."""
        return dict(zip(self.ids, self.jobs))

    @cached_property
    def positions(self) -> Mapping[str, int]:
        """Job id -> a number that increases along ``jobs`` (by default its index)."""
        return dict(zip(self.ids, range(len(self.ids))))

    def in_order(self, job_ids: set[str] | frozenset[str]) -> list[JobView]:
        """The views of ``job_ids`` (those in the snapshot), in snapshot order.
        A few are looked up by id, so that an executor's lazily built ``jobs``
        stays unbuilt."""
        if not job_ids:
            return []
        ids = self.ids
        if 8 * len(job_ids) > len(ids):
            return list(compress(self.jobs, map(job_ids.__contains__, ids)))
        pos = self.positions
        found = sorted(filter(pos.__contains__, job_ids), key=pos.__getitem__)
        return list(map(self.view_of.__getitem__, found))

    def throughput(self, job: JobView | JobSpec, n: float) -> float:
        """Iterations/s at the job's submitted global batch on ``n`` GPUs."""
        spec = job.spec if isinstance(job, JobView) else job
        return self.profiles.throughput(spec.model, spec.batch_size, n)

    def progress_rate(self, job: JobView | JobSpec, n: float, batch: int | None = None) -> float:
        """Progress in the spec's iterations per second at global ``batch``
        (default: the spec's): a batch twice as large does an iteration's
        worth of samples twice per step (Elan §VI, hybrid scaling). A goodput
        job on a :class:`~tidal.scheduler.goodput.GoodputProfile` progresses
        in steps at its initial batch, at its goodput (Pollux §3)."""
        spec = job.spec if isinstance(job, JobView) else job
        b = batch or spec.batch_size
        # -- goodput jobs (Pollux): progress in statistical-efficiency units, scheduler.goodput
        owns = getattr(self.profiles, "owns", None)
        if owns is not None and owns(spec):
            done = job.done if isinstance(job, JobView) else 0.0
            return self.profiles.job_rate(spec, int(n), b, done)  # type: ignore[attr-defined]
        # -- end goodput
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
    waiting: dict[str, str] = field(default_factory=dict)  # job id -> why it cannot be placed now (GPU types)


class Policy(abc.ABC):
    """Base class: admission -> allocation -> placement.

    Every ``schedule`` (this one, and any a subclass defines) ends with
    :func:`~tidal.scheduler.constraints.enforce_types`, so that no policy
    places a job on a GPU type it does not allow."""

    name: str = "?"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("schedule")
        if own is not None and not getattr(own, "enforces_types", False):
            cls.schedule = _enforcing(own)  # type: ignore[method-assign]

    def schedule(self, snap: Snapshot) -> Plan:
        plan = Plan()
        self.admission(snap, plan)
        self.allocation(snap, plan)
        self.placement(snap, plan)
        return enforce_types(snap, plan)

    def admission(self, snap: Snapshot, plan: Plan) -> None:
        """Default: admit every submitted job that could ever fit the cluster."""
        total = snap.cluster.num_gpus
        for j in snap.submitted:
            if j.spec.lo > total or not j.spec.fits(total):
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

    def settled(self, snap: Snapshot, plan: Plan) -> bool:
        """Whether ``plan`` (this policy's answer to ``snap``), once applied, stays
        the answer until a job arrives: a later round whose snapshot differs
        only in time passed and running jobs completed would return a plan that
        changes nothing (every job keeps its GPUs; no admit, drop, tag, batch or
        wake). An executor may then skip such rounds without calling the policy.
        Default: ``False`` (always call)."""
        return False


def _enforcing(schedule: Callable[[Policy, Snapshot], Plan]) -> Callable[[Policy, Snapshot], Plan]:
    """``schedule`` followed by :func:`~tidal.scheduler.constraints.enforce_types`."""

    @functools.wraps(schedule)
    def wrapped(self: Policy, snap: Snapshot) -> Plan:
        return enforce_types(snap, schedule(self, snap))

    wrapped.enforces_types = True  # type: ignore[attr-defined]
    return wrapped


def schedulable(snap: Snapshot, plan: Plan) -> list[JobView]:
    """Jobs that may get GPUs in this plan: admitted before or now, not dropped
    (in snapshot order)."""
    jobs, drop, admit = snap.jobs, plan.drop, plan.admit
    ok = map(truth, map(_ADMITTED, jobs))
    if admit:
        ok = map(or_, ok, map(admit.__contains__, snap.ids))
    if drop:
        ok = map(and_, ok, map(not_, map(drop.__contains__, snap.ids)))
    return list(compress(jobs, ok))
