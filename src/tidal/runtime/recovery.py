"""Recovery from a failed generation (EDL §4.2: a forced scale-in).

When a worker dies, its peers' collective fails; each survivor reports the
failure to the master and waits. The survivors that report within a window
(or until every member not known dead has reported) form the next
generation. These are the pure steps; the master applies them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Sequence

from tidal.runtime.messages import SwitchPlan


@dataclass(frozen=True)
class Recovery:
    """Survivors of generation ``gen`` reporting in since ``started`` (wall
    clock); ``step`` is the first reporter's step."""

    gen: int
    started: float
    step: int
    reporters: tuple[str, ...] = ()


def report(rec: Recovery | None, gen: int, worker_id: str, step: int, now: float) -> Recovery:
    """The recovery after ``worker_id`` reported that generation ``gen``
    failed at ``step`` (a report on another generation starts a new one)."""
    if rec is None or rec.gen != gen:
        rec = Recovery(gen, now, int(step))
    if worker_id in rec.reporters:
        return rec
    return dataclasses.replace(rec, reporters=(*rec.reporters, worker_id))


def is_due(rec: Recovery, members: Sequence[str], dead: Iterable[str], now: float, window_s: float) -> bool:
    """Every member not known ``dead`` reported, or the window is over."""
    expected = set(members) - set(dead)
    return not (set(rec.reporters) < expected and now - rec.started < window_s)


def survivors(rec: Recovery, members: Sequence[str], plan: SwitchPlan | None) -> list[str]:
    """The next generation's members (rank order kept): the reporters, less
    the leavers of a pending scale-in (they were leaving anyway; those of a
    migration or suspension stay until that change is planned again)."""
    out = [w for w in members if w in rec.reporters]
    if plan is not None and plan.kind not in ("migrate", "suspend"):
        out = [w for w in out if w not in plan.leavers]
    return out
