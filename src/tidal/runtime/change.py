"""The state machine of one change of a job's workers (EDL §3.1, §4.2).

A change is requested (``waiting``: its newcomers start and register while
the others keep training), its plan is published on the store
(``published``), rank 0 agrees on the switch step with the group
(``agreed``) and the target generation forms (``switched``); a change whose
newcomers do not come, or that the job's end or a failure makes moot, is
``abandoned``. A failure during a change does not lose it: it goes back to
``waiting`` for the survivors' generation (:class:`Restart`); a newcomer lost
before it joined is dropped from it (:class:`Drop`), and the change waits
again for the others.

:func:`advance` is the pure transition function; the job master applies its
results and persists them (:meth:`Change.to_json`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any, Union


class ChangeKind(str, Enum):
    """What a change does to the job's workers."""

    SCALE_OUT = "scale_out"  # newcomers join
    SCALE_IN = "scale_in"  # members leave
    MIGRATE = "migrate"  # members leave as as many newcomers join, in one switch (EDL §5.2)
    RESHARE = "reshare"  # the members' batch shares change (EDL §5.2)
    SUSPEND = "suspend"  # a checkpoint at the switch step, then every member leaves


class ChangeStatus(str, Enum):
    """Where a change is: waiting -> published -> agreed -> switched, or abandoned."""

    WAITING = "waiting"
    PUBLISHED = "published"
    AGREED = "agreed"
    SWITCHED = "switched"
    ABANDONED = "abandoned"


NEWCOMER_KINDS = frozenset({ChangeKind.SCALE_OUT, ChangeKind.MIGRATE})
# kinds a failure does not cancel: their newcomers (or the suspension) carry over
RESTARTABLE_KINDS = frozenset({ChangeKind.SCALE_OUT, ChangeKind.MIGRATE, ChangeKind.SUSPEND})
TERMINAL = frozenset({ChangeStatus.SWITCHED, ChangeStatus.ABANDONED})


@dataclass(frozen=True)
class Change:
    """One change: ``expect`` are the newcomers' worker ids, ``joiners`` those
    of them that registered, ``leavers`` the members that leave;
    ``requested_at``/``published_at`` are wall-clock times."""

    kind: ChangeKind
    requested_at: float
    status: ChangeStatus = ChangeStatus.WAITING
    expect: tuple[str, ...] = ()
    joiners: tuple[str, ...] = ()
    leavers: tuple[str, ...] = ()
    published_at: float | None = None
    agreed_step: int | None = None
    reason: str = ""  # why it was abandoned

    @property
    def ready(self) -> bool:
        """Every expected newcomer registered: the plan can be published."""
        return self.status is ChangeStatus.WAITING and set(self.joiners) == set(self.expect)

    @property
    def pending(self) -> str:
        """``kind:status``, as :class:`~tidal.runtime.messages.Status` shows it."""
        return f"{self.kind.value}:{self.status.value}"

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(kind=self.kind.value, status=self.status.value, expect=list(self.expect),
                 joiners=list(self.joiners), leavers=list(self.leavers))
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Change":
        return cls(kind=ChangeKind(d["kind"]), requested_at=float(d["requested_at"]),
                   status=ChangeStatus(d.get("status", "waiting")), expect=tuple(d.get("expect") or ()),
                   joiners=tuple(d.get("joiners") or ()), leavers=tuple(d.get("leavers") or ()),
                   published_at=d.get("published_at"), agreed_step=d.get("agreed_step"),
                   reason=str(d.get("reason", "")))


@dataclass(frozen=True)
class Join:
    """An expected newcomer registered."""

    worker_id: str


@dataclass(frozen=True)
class Publish:
    """The plan is on the store (at wall time ``at``)."""

    at: float


@dataclass(frozen=True)
class Agree:
    """Rank 0 agreed on the switch step with the group."""

    step: int


@dataclass(frozen=True)
class Switch:
    """The target generation formed (or the suspension checkpoint was written)."""


@dataclass(frozen=True)
class Abandon:
    """The change is dropped: its newcomers did not come, could not be
    started, or the job ended or failed under it."""

    reason: str


@dataclass(frozen=True)
class Restart:
    """The current generation failed; ``survivors`` form the next one and
    the change starts over from it."""

    survivors: tuple[str, ...]


@dataclass(frozen=True)
class Drop:
    """Newcomers ``workers`` died before they joined (or a member of the
    published target did): the change waits again, without them."""

    workers: tuple[str, ...]


Event = Union[Join, Publish, Agree, Switch, Abandon, Restart, Drop]


class IllegalTransition(ValueError):
    """``event`` does not apply to ``change`` in its status."""

    def __init__(self, change: Change, event: Event, why: str) -> None:
        super().__init__(f"{type(event).__name__} on {change.pending}: {why}")
        self.change, self.event = change, event


def advance(change: Change, event: Event) -> Change:
    """The change after ``event``; raises :class:`IllegalTransition` if the
    event is not legal in the change's status."""

    def bad(why: str) -> IllegalTransition:
        return IllegalTransition(change, event, why)

    st = change.status
    if st in TERMINAL:
        raise bad("the change is over")
    if isinstance(event, Join):
        if st is not ChangeStatus.WAITING or change.kind not in NEWCOMER_KINDS:
            raise bad("only a waiting scale-out or migration takes newcomers")
        if event.worker_id not in change.expect or event.worker_id in change.joiners:
            raise bad(f"{event.worker_id} is not an expected newcomer still to come")
        return dataclasses.replace(change, joiners=(*change.joiners, event.worker_id))
    if isinstance(event, Publish):
        if not change.ready:
            raise bad(f"newcomers {sorted(set(change.expect) - set(change.joiners))} did not register")
        return dataclasses.replace(change, status=ChangeStatus.PUBLISHED, published_at=float(event.at))
    if isinstance(event, Agree):
        if st not in (ChangeStatus.PUBLISHED, ChangeStatus.AGREED):
            raise bad("no published plan to agree on")
        return dataclasses.replace(change, status=ChangeStatus.AGREED, agreed_step=int(event.step))
    if isinstance(event, Switch):
        if st not in (ChangeStatus.PUBLISHED, ChangeStatus.AGREED):
            raise bad("no published plan to switch to")
        return dataclasses.replace(change, status=ChangeStatus.SWITCHED)
    if isinstance(event, Abandon):
        return dataclasses.replace(change, status=ChangeStatus.ABANDONED, reason=event.reason)
    if isinstance(event, Restart):
        if change.kind not in RESTARTABLE_KINDS:
            raise bad("a scale-in or reshare planned for the failed generation is dropped")
        return _restart(change, event.survivors)
    if isinstance(event, Drop):
        lost = set(event.workers)
        return dataclasses.replace(change, status=ChangeStatus.WAITING, published_at=None, agreed_step=None,
                                   expect=tuple(w for w in change.expect if w not in lost),
                                   joiners=tuple(w for w in change.joiners if w not in lost))
    raise bad("unknown event")


def _restart(change: Change, survivors: tuple[str, ...]) -> Change:
    """The change planned again from the survivors' generation: a suspension
    suspends the survivors; a migration whose workers to move died is a
    plain scale-out of their replacements, and so is one that would move
    every survivor (a live worker must stay to send the state)."""
    fresh = dataclasses.replace(change, status=ChangeStatus.WAITING, published_at=None, agreed_step=None)
    if change.kind is ChangeKind.SUSPEND:
        return dataclasses.replace(fresh, leavers=tuple(survivors))
    leavers = tuple(w for w in change.leavers if w in survivors)
    if change.kind is ChangeKind.MIGRATE and (not leavers or len(leavers) >= len(survivors)):
        return dataclasses.replace(fresh, kind=ChangeKind.SCALE_OUT, leavers=())
    return dataclasses.replace(fresh, leavers=leavers)
