"""The job model shared by the simulator, the policies and the control plane."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tidal.core.errors import InputError


class JobState(str, enum.Enum):
    """Life cycle: submitted -> admitted | dropped -> pending -> running <-> resizing
    -> completed | failed | cancelled (a running job may also go back to pending
    when it is preempted)."""

    SUBMITTED = "submitted"
    ADMITTED = "admitted"
    DROPPED = "dropped"
    PENDING = "pending"
    RUNNING = "running"
    RESIZING = "resizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = {JobState.DROPPED, JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED}
for _s in JobState:
    # a plain attribute, so that JobView.running is a C-level getter
    setattr(_s, "holds_gpus", _s in (JobState.RUNNING, JobState.RESIZING))

#: Allowed transitions; anything else is a bug in an executor.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.SUBMITTED: frozenset({JobState.ADMITTED, JobState.DROPPED, JobState.CANCELLED}),
    JobState.ADMITTED: frozenset({JobState.PENDING, JobState.CANCELLED}),
    JobState.PENDING: frozenset(
        {JobState.RUNNING, JobState.DROPPED, JobState.CANCELLED, JobState.FAILED}
    ),
    JobState.RUNNING: frozenset(
        {
            JobState.RESIZING,
            JobState.PENDING,
            JobState.COMPLETED,
            JobState.FAILED,
            JobState.CANCELLED,
        }
    ),
    JobState.RESIZING: frozenset(
        {JobState.RUNNING, JobState.PENDING, JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.DROPPED: frozenset(),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


def check_transition(old: JobState, new: JobState) -> None:
    if new not in TRANSITIONS[old]:
        raise ValueError(f"illegal job state transition {old.value} -> {new.value}")


@dataclass(frozen=True)
class JobSpec:
    """What a user submits. Immutable; the executor tracks progress separately.

    ``requested_gpus`` is the count a rigid job runs at (and an elastic job's
    preferred count). An elastic job may run at any count in
    ``[min_gpus, max_gpus]``, or, if ``allowed_gpus`` is given, only at those
    counts (the SideCar paper's "optional numbers of GPUs"). ``iterations`` is
    the work; ``batch_size`` the global batch. ``gpu_types`` (if given) lists
    the GPU types the job may run on and ``exclude_gpu_types`` those it must
    not (a node selector and an anti-affinity, as in Kubernetes or Slurm's
    ``--constraint``); see :meth:`allows_type`.
    """

    job_id: str
    submit_time: float
    model: str
    batch_size: int
    iterations: float
    requested_gpus: int = 1
    user: str = "default"
    min_gpus: int | None = None
    max_gpus: int | None = None
    allowed_gpus: tuple[int, ...] | None = None
    deadline: float | None = None
    priority: int = 0
    elastic: bool = False
    gpu_types: tuple[str, ...] | None = None  # the job runs only on GPUs of these types (None: any)
    exclude_gpu_types: tuple[str, ...] = ()  # ... and never on these
    meta: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.iterations <= 0:
            raise InputError(f"must be > 0, got {self.iterations}", field="iterations")
        if self.batch_size <= 0:
            raise InputError(f"must be > 0, got {self.batch_size}", field="batch_size")
        if self.requested_gpus < 0:
            raise InputError(f"must be >= 0, got {self.requested_gpus}", field="requested_gpus")
        if self.allowed_gpus is not None:
            allowed = tuple(sorted(set(self.allowed_gpus)))
            if not allowed or allowed[0] < 1:
                raise InputError("must be a non-empty set of counts >= 1", field="allowed_gpus")
            object.__setattr__(self, "allowed_gpus", allowed)
        if self.gpu_types is not None:
            types = tuple(sorted(set(self.gpu_types)))
            if not types or not all(isinstance(t, str) and t for t in types):
                raise InputError("must be a non-empty list of GPU type names", field="gpu_types")
            object.__setattr__(self, "gpu_types", types)
            if set(types) <= set(self.exclude_gpu_types):
                raise InputError(
                    f"every allowed GPU type ({', '.join(types)}) is also excluded", field="exclude_gpu_types"
                )
        if self.exclude_gpu_types:
            object.__setattr__(self, "exclude_gpu_types", tuple(sorted(set(self.exclude_gpu_types))))
        lo = self.min_gpus if self.min_gpus is not None else (1 if self.elastic else self.requested_gpus)
        hi = self.max_gpus if self.max_gpus is not None else (None if self.elastic else self.requested_gpus)
        if hi is not None and lo > hi:
            raise InputError(f"min_gpus {lo} > max_gpus {hi}", field="min_gpus")
        if self.deadline is not None and self.deadline < self.submit_time:
            raise InputError(
                f"deadline {self.deadline} is before submit time {self.submit_time}", field="deadline"
            )

    @property
    def constrained(self) -> bool:
        """Whether the job restricts the GPU types it runs on."""
        return self.gpu_types is not None or bool(self.exclude_gpu_types)

    def allows_type(self, gpu_type: str) -> bool:
        """Whether the job may run on a GPU of ``gpu_type``."""
        if gpu_type in self.exclude_gpu_types:
            return False
        return self.gpu_types is None or gpu_type in self.gpu_types

    # -- the GPU counts this job may run at ---------------------------------
    @property
    def lo(self) -> int:
        """Smallest GPU count the job can run at."""
        if self.allowed_gpus is not None:
            return self.allowed_gpus[0]
        if self.min_gpus is not None:
            return self.min_gpus
        return 1 if self.elastic else max(1, self.requested_gpus)

    def hi(self, cap: int) -> int:
        """Largest GPU count the job can run at, at most ``cap``."""
        if self.allowed_gpus is not None:
            fit = [a for a in self.allowed_gpus if a <= cap]
            return fit[-1] if fit else 0
        if self.max_gpus is not None:
            return min(self.max_gpus, cap)
        return cap if self.elastic else min(max(1, self.requested_gpus), cap)

    def can_run_at(self, n: int) -> bool:
        if n < 1:
            return False
        if not self.elastic:
            return n == max(1, self.requested_gpus)
        if self.allowed_gpus is not None:
            return n in self.allowed_gpus
        return self.lo <= n <= self.hi(n)

    def fits(self, cap: int) -> bool:
        """Whether the job may run at some count <= ``cap`` (``counts(cap)`` is not empty)."""
        if not self.elastic:
            return max(1, self.requested_gpus) <= cap
        if self.allowed_gpus is not None:
            return self.allowed_gpus[0] <= cap
        return self.hi(cap) >= self.lo

    def counts(self, cap: int) -> list[int]:
        """Every GPU count the job may run at, up to ``cap``, ascending."""
        if not self.elastic:
            n = max(1, self.requested_gpus)
            return [n] if n <= cap else []
        if self.allowed_gpus is not None:
            return [a for a in self.allowed_gpus if a <= cap]
        return list(range(self.lo, self.hi(cap) + 1))
