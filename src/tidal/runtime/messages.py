"""Frozen messages exchanged between the job master and its workers.

All messages are plain JSON on the wire (see :mod:`tidal.runtime.server` for the
protocol); these dataclasses are the typed Python view of them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


def _clean(d: dict[str, Any], cls: type) -> dict[str, Any]:
    names = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    return {k: v for k, v in d.items() if k in names}


@dataclass(frozen=True)
class Generation:
    """One process-group generation: its members (worker ids in rank order) and
    the store prefix its rendezvous uses (one TCPStore prefix per generation)."""

    gen: int
    members: tuple[str, ...]
    store_host: str
    store_port: int
    prefix: str
    # relative share of the global batch per rank (empty: even); a straggler
    # may get a smaller one (EDL §5.2)
    shares: tuple[float, ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, worker_id: str) -> int:
        return self.members.index(worker_id)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["members"] = list(self.members)
        d["shares"] = list(self.shares)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Generation":
        d = _clean(d, cls)
        d["members"] = tuple(d["members"])
        d["shares"] = tuple(float(x) for x in d.get("shares", ()))
        return cls(**d)


@dataclass(frozen=True)
class SwitchPlan:
    """The next change (EDL §4.2): the target generation and the switch step
    ``t_cur + k`` with ``k = ceil(T_a / T_step)``. ``joiners``/``leavers`` are
    worker ids relative to the current generation."""

    target: Generation
    switch_step: int
    k: int
    joiners: tuple[str, ...] = ()
    leavers: tuple[str, ...] = ()
    kind: str = "scale_out"
    # (joiner, source worker) pairs: who sends each newcomer its state (Elan §IV);
    # empty: a broadcast over the new group
    sources: tuple[tuple[str, str], ...] = ()

    def source_ranks(self) -> dict[int, int]:
        """Destination rank -> source rank in the target generation."""
        t = self.target
        return {t.rank_of(j): t.rank_of(s) for j, s in self.sources}

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target.to_json(),
            "switch_step": self.switch_step,
            "k": self.k,
            "joiners": list(self.joiners),
            "leavers": list(self.leavers),
            "kind": self.kind,
            "sources": [list(p) for p in self.sources],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SwitchPlan":
        return cls(
            target=Generation.from_json(d["target"]),
            switch_step=int(d["switch_step"]),
            k=int(d["k"]),
            joiners=tuple(d.get("joiners", ())),
            leavers=tuple(d.get("leavers", ())),
            kind=str(d.get("kind", "scale_out")),
            sources=tuple((str(a), str(b)) for a, b in d.get("sources", ())),
        )


@dataclass(frozen=True)
class Progress:
    """What rank 0 reports on its (asynchronous) heartbeat."""

    gen: int
    step: int
    cursor: int
    epoch: int
    step_time_s: float
    world_size: int


@dataclass(frozen=True)
class ChangeRecord:
    """A finished change, for ``status()`` and the run summary."""

    gen: int
    kind: str
    from_size: int
    to_size: int
    switch_step: int
    requested_at: float
    switched_at: float
    pause_s: float = 0.0
    sources: tuple[tuple[str, str], ...] = ()  # (newcomer, worker that sent it the state)
    shares: tuple[float, ...] = ()  # batch shares of the new generation (empty: even)
    published_at: float | None = None  # when its plan was published (wall clock)


@dataclass(frozen=True)
class Status:
    """Snapshot returned by ``status()``."""

    job: str
    state: str  # "forming" | "running" | "changing" | "finished"
    gen: int
    world_size: int
    members: tuple[str, ...]
    step: int
    cursor: int
    epoch: int
    step_time_s: float
    changing: bool
    pending: str | None
    changes: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    master_url: str = ""
    stragglers: tuple[dict[str, Any], ...] = field(default_factory=tuple)  # detected stragglers (EDL §5.2)
    # rank 0's latest step: (step, wall time at its end, world size), or () (used by profile())
    last_step: tuple[Any, ...] = field(default_factory=tuple)
    hung: tuple[dict[str, Any], ...] = field(default_factory=tuple)  # hung workers found and killed
    # workers lost before their first step and dropped: worker_id, reason, gen, at
    dropped: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    # each member's host, as the worker registered it (tidal scale --remove-host)
    hosts: dict[str, str] = field(default_factory=dict)
    # the batch policy's numbers when it measures the noise scale (job.goodput): batch, lr_factor, noise_scale...
    goodput: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["members"] = list(self.members)
        d["changes"] = list(self.changes)
        d["stragglers"] = list(self.stragglers)
        d["last_step"] = list(self.last_step)
        d["hung"] = list(self.hung)
        d["dropped"] = list(self.dropped)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Status":
        d = _clean(d, cls)
        d["members"] = tuple(d.get("members", ()))
        d["changes"] = tuple(d.get("changes", ()))
        d["stragglers"] = tuple(d.get("stragglers", ()))
        d["last_step"] = tuple(d.get("last_step", ()))
        d["hung"] = tuple(d.get("hung", ()))
        d["dropped"] = tuple(d.get("dropped", ()))
        d["hosts"] = dict(d.get("hosts") or {})
        return cls(**d)


@dataclass(frozen=True)
class ScaleAnswer:
    """Answer to ``scale_out``/``scale_in``: ``accepted``, ``retry`` (a change
    is in progress, EDL §3.1) or ``error``."""

    status: str
    message: str = ""
    retry_after_s: float = 0.0
    size: int = 0

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ScaleAnswer":
        return cls(**_clean(d, cls))
