"""Recovery from a failed generation (EDL §4.2: a forced scale-in).

When a worker dies, its peers' collective fails; each survivor reports the
failure to the master and waits. The survivors that report within a window
(or until every member not known dead has reported) form the next
generation. These are the pure steps; the master applies them.
:class:`LostWorkers` drops the workers lost before their first step, whom
no collective reports, and aborts a formed generation one of whose members
is cut off (silent, or known dead with no survivor reporting): a silent host
fails no collective, so the survivors are told to leave theirs.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from tidal.runtime.change import NEWCOMER_KINDS, Abandon, ChangeKind, Drop
from tidal.runtime.messages import SwitchPlan

if TYPE_CHECKING:
    from tidal.runtime.jobcore import JobCore

log = logging.getLogger(__name__)


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



class LostWorkers:
    """Workers lost before their first step — while starting, after
    registering, or before the process group they were assigned to formed —
    dropped like any lost worker (a forced scale-in): the first generation
    forms with the live ones, a generation that cannot form is formed again
    without them, and a scale-out or migration goes on without its lost
    newcomers (abandoned if none is left). ``records``: who, why, when."""

    DEAD_GRACE_S = 3.0  # a member known dead for this long with no survivor reporting: its host sent no reset

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.aborted: set[int] = set()  # formed generations aborted because a member was cut off
        self._dead_since: dict[str, float] = {}

    def note(self, workers: Iterable[str], what: str, dead: set[str], wall: float, gen: int = 0) -> None:
        """Record (and log) the drop of ``workers``; ``dead``: those whose process failed."""
        for w in workers:
            why = "its process failed" if w in dead else "no liveness beat for 3 s"
            rec = {"worker_id": w, "reason": f"{what} ({why})", "gen": int(gen), "at": wall}
            self.records.append(rec)
            log.warning("dropped worker %s: %s", w, rec["reason"])

    def sweep(self, core: "JobCore", dead: set[str], gone: set[str], wall: float) -> None:
        """Drop the lost workers ``gone`` (``dead``: those whose process
        failed) that have not taken a step yet; abort a formed generation
        with a member cut off (:meth:`cut_off`)."""
        self.cut_off(core, dead, wall)
        g = core.group
        if not gone or core.finished:
            return
        if g.gen is None:
            self._forming(core, dead, gone, wall)
            return
        members = g.gen.members
        if set(members) & gone and not g.is_committed(g.gen) and g.abort(g.gen):
            stay = [w for w in members if w not in gone]
            self.note([w for w in members if w in gone], f"died before generation {g.gen.gen} formed", dead, wall,
                      g.gen.gen)
            if stay:
                core.reform(stay, int(g.progress.get("step", 0)), wall, wall)
            return
        plan = g.plan
        if plan is not None and g.gated(plan) and set(plan.target.members) & gone:
            g.abort(plan.target)  # nobody builds it; too late if every member passed the gate already
        if core.change is not None and core.change.kind in NEWCOMER_KINDS and not set(members) & gone:
            self._newcomers(core, dead, gone, wall)

    def cut_off(self, core: "JobCore", dead: set[str], wall: float) -> None:
        """Abort the current generation (once) when it formed and a member is
        cut off: its beats stopped for the silent timeout while a peer
        beats (:meth:`HealthMonitor.cut_off`), or its process is known dead
        (``dead``; e.g. lost with the previous master's host) and no
        survivor reported a failure within :data:`DEAD_GRACE_S`. The
        survivors leave their collective and report it; the recovery then
        forms their generation without the cut-off member."""
        g, now = core.group, core.health.observed_at
        self._dead_since = {w: self._dead_since.get(w, wall) for w in dead}
        if g.gen is None or core.finished or core.recovery is not None or now is None \
                or g.gen.gen in self.aborted or not g.is_committed(g.gen):
            return
        leaving = set(g.plan.leavers) if g.plan is not None else set()
        why = {w: f"no liveness beat for {q:.1f}s"
               for w, q in core.health.cut_off(g.gen.members, leaving, now).items()}
        why.update({w: f"its process is gone ({wall - self._dead_since[w]:.1f}s ago) and no peer reported"
                    for w in g.gen.members if w in dead and wall - self._dead_since[w] > self.DEAD_GRACE_S})
        if not why:
            return
        self.aborted.add(g.gen.gen)
        reason = "; ".join(f"{w}: {r}" for w, r in sorted(why.items()))
        log.warning("generation %d: cut off (%s); aborting it so the others re-form without them",
                    g.gen.gen, reason)
        g.abort_formed(g.gen, reason)

    def _forming(self, core: "JobCore", dead: set[str], gone: set[str], wall: float) -> None:
        """Before the first generation: drop the lost ones and form it with
        the others once every worker started either registered or was lost."""
        g = core.group
        registered = [w for w in g.queue if w in gone]
        unseen = sorted(w for w in dead if w not in g.workers)
        if not registered and not unseen:
            return
        g.queue = [w for w in g.queue if w not in gone]
        self.note(registered, "died after registering, before the first generation formed", dead, wall)
        self.note(unseen, "died before it registered", dead, wall)
        for w in unseen:
            g.workers[w] = {"state": "failed", "pid": 0, "host": ""}
        g.mark(registered, "failed")
        g.form_initial()
        core.save()

    def _newcomers(self, core: "JobCore", dead: set[str], gone: set[str], wall: float) -> None:
        """A scale-out or migration lost newcomers: drop them (a published
        plan whose target did not form is withdrawn, and the change waits
        again); none left, or a migration: abandon it."""
        g, c = core.group, core.change
        assert c is not None
        lost = [w for w in c.expect if w in gone]
        if not lost or (g.plan is not None and not g.is_aborted(g.plan.target)):
            return  # nothing lost, or the target formed already: a failure of the new group follows
        target = g.plan.target.gen if g.plan is not None else 0
        g.cancel_plan()
        what = f"newcomer of a {c.kind.value}: died "
        self.note([w for w in lost if w not in g.workers], what + "before it registered", dead, wall)
        self.note([w for w in lost if w in g.workers], what + "after registering, before it joined"
                  + (f" generation {target}" if target else ""), dead, wall, target)
        for w in lost:
            g.workers.setdefault(w, {"pid": 0, "host": ""})["state"] = "failed"
        core.advance(Drop(tuple(lost)))
        c = core.change
        if c is not None and (not c.expect or c.kind is ChangeKind.MIGRATE):
            g.mark(c.joiners, "left")  # a half-done move is not a scale-out: its replacements exit
            core.advance(Abandon(f"newcomers {lost} were lost before they joined"))
        core.save()

    @staticmethod
    def replan(core: "JobCore", gone: set[str]) -> None:
        """Publish a change that waits with every newcomer registered (its
        last one was lost, or its published target could not form because a
        member was lost and no failure followed); not while members are lost."""
        g = core.group
        if core.change is None or core.recovery is not None or g.gen is None or set(g.gen.members) & gone:
            return
        if g.plan is not None and g.is_aborted(g.plan.target):
            g.cancel_plan()
            core.advance(Drop(()))
        if core.change is not None and core.change.ready:
            core.publish()
            core.save()
