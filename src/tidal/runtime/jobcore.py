"""The job master's state and its transitions, single-threaded.

:class:`JobCore` holds what the master knows about one job — the
:class:`~tidal.runtime.generations.Generations` (workers, generations, plans),
the change in progress (:mod:`tidal.runtime.change`), the recovery of a
failed generation (:mod:`tidal.runtime.recovery`), the liveness clocks
(:mod:`tidal.runtime.health`) and the records (finished changes, answered
requests, stragglers, hung workers) — and changes it. It takes no lock and
starts no process: :class:`~tidal.runtime.master.JobMaster` calls it under its
lock and talks to the spawner. Every transition is saved to the state backend.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from tidal.runtime.change import (NEWCOMER_KINDS, RESTARTABLE_KINDS, TERMINAL, Abandon, Agree, Change, ChangeKind,
                                  ChangeStatus, Drop, Event, Join, Publish, Restart, Switch, advance)
from tidal.runtime.data import ShardManager
from tidal.runtime.generations import Generations
from tidal.runtime.health import HealthMonitor
from tidal.runtime.messages import ChangeRecord, ScaleAnswer, Status
from tidal.runtime.persistence import StateBackend
from tidal.runtime.recovery import LostWorkers, Recovery, is_due, report, survivors

log = logging.getLogger(__name__)


class JobCore:
    """State and transitions of one job's master (not thread-safe)."""

    def __init__(self, group: Generations, *, backend: StateBackend | None, shards: ShardManager | None,
                 join_timeout_s: float, recovery_window_s: float, hang_timeout_s: float, first_worker: int) -> None:
        self.group, self.backend, self.shards = group, backend, shards
        self.join_timeout_s = float(join_timeout_s)
        self.recovery_window_s = float(recovery_window_s)
        # a member that stops beating (or is stuck in compute while its peers wait) this long is killed
        self.health = HealthMonitor(hang_timeout_s)
        self.change: Change | None = None
        self.recovery: Recovery | None = None  # survivors of a failed generation reporting in
        self.changes: list[dict[str, Any]] = []  # finished changes (ChangeRecord)
        self.finished = False
        self.suspended: dict[str, Any] | None = None  # where a suspended job's checkpoint is (step, cursor, path)
        self.spawned = int(first_worker)  # number of the next worker id the master allocates
        # answers to accepted scaling requests by request id: a client retrying a
        # request whose answer was lost (e.g. the master died) gets the same answer
        # instead of a second change (Elan §V-D); persisted with the snapshot
        self.answers: dict[str, dict[str, Any]] = {}
        self.stragglers: list[dict[str, Any]] = []
        self.hung: list[dict[str, Any]] = []
        self.lost = LostWorkers()  # workers dropped before their first step
        self.saved_step = 0  # the progress step of the last saved snapshot

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> dict[str, Any]:
        g = self.group
        return {"job": g.job, "initial_workers": g.size, **g.to_json(),
                "change": self.change.to_json() if self.change else None, "changes": self.changes,
                "finished": self.finished, "suspended": self.suspended, "spawned": self.spawned,
                "shards": self.shards.snapshot() if self.shards else None,
                "answers": dict(list(self.answers.items())[-64:]), "stragglers": self.stragglers[-64:],
                "hung": self.hung[-64:], "dropped": self.lost.records[-64:]}

    def restore(self, s: dict[str, Any]) -> None:
        self.group.size = int(s["initial_workers"])
        self.group.restore(s)
        self.change = Change.from_json(s["change"]) if s.get("change") else None
        self.changes, self.finished, self.suspended = s["changes"], s["finished"], s.get("suspended")
        self.spawned = int(s.get("spawned", 0))
        self.answers = dict(s.get("answers") or {})
        self.stragglers, self.hung = list(s.get("stragglers") or []), list(s.get("hung") or [])
        self.lost.records = list(s.get("dropped") or [])
        if s.get("shards"):
            self.shards = ShardManager.from_snapshot(s["shards"])
        self.saved_step = int(self.group.progress.get("step", 0))
        log.info("master resumed at gen %s step %s", self.group.gen and self.group.gen.gen,
                 self.group.progress.get("step"))

    def save(self) -> None:
        if self.backend is not None:
            self.backend.save(self.to_json())
            self.saved_step = int(self.group.progress.get("step", 0))

    # ------------------------------------------------------------------ the change in progress
    def advance(self, event: Event) -> None:
        """Apply ``event`` to the change in progress; a finished one is dropped."""
        assert self.change is not None
        c = advance(self.change, event)
        self.change = None if c.status in TERMINAL else c

    def begin(self, change: Change, shares: dict[str, float] | None = None) -> None:
        """Make ``change`` the one in progress; publish its plan if no newcomer is awaited."""
        self.change = change
        queued = [w for w in change.expect if w in self.group.queue]  # started elsewhere, registered already
        self.group.queue = [w for w in self.group.queue if w not in queued]
        for w in queued:
            self.advance(Join(w))
        if self.change.ready:
            self.publish(shares)

    def publish(self, shares: dict[str, float] | None = None) -> None:
        """Publish the plan of the change in progress (every newcomer registered)."""
        assert self.change is not None
        self.group.publish(self.change, shares)
        self.advance(Publish(time.time()))

    def start_queued_change(self) -> None:
        """Workers that registered on their own while no change was active
        trigger a scale-out for themselves."""
        g = self.group
        if self.change is None and g.queue and g.gen is not None and not self.finished:
            joiners, g.queue = tuple(g.queue), []
            self.begin(Change(ChangeKind.SCALE_OUT, time.time(), expect=joiners, joiners=joiners))

    def expire(self, wall: float) -> None:
        """Abandon a change whose newcomers did not register within ``join_timeout_s``."""
        c = self.change
        if c is None or c.status is not ChangeStatus.WAITING or wall - c.requested_at <= self.join_timeout_s:
            return
        log.warning("%s abandoned: joiners %s did not register in time", c.kind.value, set(c.expect) - set(c.joiners))
        if c.kind is ChangeKind.MIGRATE:  # a half-done move is not a scale-out: its replacements exit
            self.group.mark(c.joiners, "left")
        else:
            self.group.queue += c.joiners
        self.advance(Abandon("newcomers did not register in time"))
        self.save()

    # ------------------------------------------------------------------ scaling requests
    def busy(self, request_id: str | None) -> ScaleAnswer | None:
        """The first answer to a repeated request id (idempotent retry), or
        why no change can start now (*retry* while one runs, EDL §3.1)."""
        if request_id and request_id in self.answers:
            return ScaleAnswer.from_json(self.answers[request_id])
        if self.finished:
            return ScaleAnswer("error", "job finished")
        if self.suspended is not None:
            return ScaleAnswer("error", "job suspended")
        if self.group.gen is None:
            return ScaleAnswer("retry", "job is forming", retry_after_s=0.5)
        if self.change is not None:
            return ScaleAnswer("retry", f"a {self.change.kind.value} is in progress", retry_after_s=0.5)
        if self.recovery is not None:
            return ScaleAnswer("retry", "recovering from a failed worker", retry_after_s=0.5)
        return None

    def remember(self, request_id: str | None, ans: ScaleAnswer) -> ScaleAnswer:
        if request_id and ans.status == "accepted":
            self.answers[request_id] = ans.to_json()
            while len(self.answers) > 64:
                self.answers.pop(next(iter(self.answers)))
            self.save()
        return ans

    def allocate(self, count: int, workers: Sequence[str] | None = None) -> list[str]:
        """Ids of ``count`` newcomers this master starts, or the given
        ``workers``; later ids continue after the highest ``w<N>`` seen."""
        ids = list(workers) if workers else [f"w{self.spawned + i}" for i in range(count)]
        nums = [int(w[1:]) for w in ids if w[:1] == "w" and w[1:].isdigit()]
        self.spawned = max([self.spawned - 1, *nums]) + 1
        return ids

    # ------------------------------------------------------------------ worker events
    def register(self, worker_id: str) -> None:
        """A registered worker joins the waiting change that expects it, the
        first generation, or a scale-out of its own."""
        g = self.group
        c = self.change
        if (g.gen is not None and worker_id in g.gen.members) or worker_id in g.queue \
                or (c is not None and worker_id in c.joiners):
            return  # registered again (e.g. its first answer was lost with a restarting master)
        if c is not None and c.kind in NEWCOMER_KINDS and c.status is ChangeStatus.WAITING and worker_id in c.expect:
            self.advance(Join(worker_id))
            # during a recovery the plan waits for the survivors' generation
            if self.change is not None and self.change.ready and self.recovery is None:
                self.publish()
            return
        g.queue.append(worker_id)
        if not g.form_initial():
            self.start_queued_change()

    def switched(self, gen: int, step: int, pause_s: float = 0.0) -> None:
        """Generation ``gen`` (the plan's target) formed at ``step``; for a
        recovery generation (formed by the master), rank 0's measured pause."""
        plan = self.group.plan
        if plan is None or plan.target.gen != gen:
            for c in self.changes:
                if c["gen"] == gen and c["kind"] == "recover":
                    c["pause_s"] = float(pause_s)
            return
        assert self.change is not None
        requested_at = self.change.requested_at
        old = self.group.switch(plan, step)
        if self.shards:
            for w in plan.leavers:
                self.shards.release(w)
        rec = ChangeRecord(gen=gen, kind=plan.kind, from_size=old.world_size if old else 0,
                           to_size=plan.target.world_size, switch_step=int(step), requested_at=float(requested_at),
                           switched_at=time.time(), pause_s=float(pause_s), sources=plan.sources,
                           shares=plan.target.shares, published_at=self.change.published_at)
        self.changes.append(dict(rec.__dict__, sources=[list(p) for p in rec.sources], shares=list(rec.shares)))
        self.advance(Switch())
        log.info("switched to gen %d (%d workers) at step %d, pause %.1f ms", gen, plan.target.world_size, step,
                 1e3 * pause_s)
        self.start_queued_change()
        self.save()

    def agreed(self, gen: int, switch_step: int) -> None:
        if self.change is not None and self.group.plan is not None and self.group.plan.target.gen == gen:
            self.advance(Agree(switch_step))
            self.save()

    def failed(self, worker_id: str, gen: int, step: int, dead: set[str], now: float, wall: float) -> None:
        """A survivor's collective failed in generation ``gen`` (a peer died).
        Survivors that report within ``recovery_window_s`` (or until every
        member not known ``dead`` has reported) form the next generation."""
        plan = self.group.plan
        if plan is not None and gen == plan.target.gen and not self.finished:
            # it failed in the generation being switched to (e.g. a newcomer died while
            # receiving its state): that group was formed, so the switch happened
            self.switched(gen, step)
        g = self.group.gen
        if g is None or gen != g.gen or self.finished:
            return
        if self.recovery is None or self.recovery.gen != gen:
            log.warning("generation %d failed at step %d (reported by %s)", gen, step, worker_id)
        self.recovery = report(self.recovery, gen, worker_id, step, wall)
        self.check_recovery(dead, now, wall)

    def check_recovery(self, dead: set[str], now: float, wall: float) -> None:
        """Form the survivors' generation once every live member reported or the window is over."""
        r, g = self.recovery, self.group.gen
        if r is None or g is None or r.gen != g.gen:
            return
        dead = dead | self.health.silent(now)  # no liveness beat for a while: do not wait for its report
        left = {w for w, info in self.group.workers.items() if info.get("state") == "left"}  # leavers that went
        if is_due(r, g.members, dead | left, wall, self.recovery_window_s) and any(w in r.reporters for w in g.members):
            self.recovery = None
            self.reform(survivors(r, g.members, self.group.plan), r.step, r.started, wall)

    def reform(self, stay: list[str], step: int, started: float, wall: float) -> None:
        """A forced scale-in to ``stay`` (EDL §4.2): after a failed generation,
        or one that could not form. A change in flight is not lost: its
        newcomers (warming up, or waiting for the cancelled plan's go, so they
        ask again) join the survivors' generation by a new plan right after
        it formed; a suspension suspends the survivors."""
        old = self.group.gen
        assert old is not None
        carry = self.change if self.change is not None and self.change.kind in RESTARTABLE_KINDS else None
        if self.change is not None and carry is None:
            self.advance(Abandon("the generation failed"))  # a scale-in or reshare of the failed generation
        self.change = None
        self.group.cancel_plan()
        new = self.group.form(stay)
        self.group.mark([w for w in old.members if w not in stay], "failed")
        self.changes.append(ChangeRecord(gen=new.gen, kind="recover", from_size=old.world_size,
                                         to_size=new.world_size, switch_step=step, requested_at=started,
                                         switched_at=wall).__dict__)
        log.warning("recovered: gen %d with %s", new.gen, stay)
        if carry is not None:
            self.change = advance(carry, Restart(tuple(stay)))
            if self.change.ready:
                self.publish()
        self.save()

    def left(self, worker_id: str) -> None:
        if worker_id in self.group.workers:
            self.group.mark([worker_id], "left")
        if self.shards:
            self.shards.release(worker_id)
        self.save()

    def done(self, step: int, cursor: int, epoch: int | None) -> None:
        """The job finished (a pending switch is cancelled)."""
        if self.finished:
            return
        self.finished = True
        self.group.progress.update(step=int(step), cursor=int(cursor))
        if epoch is not None:
            self.group.progress["epoch"] = int(epoch)
        self.group.cancel_plan()
        if self.change is not None:
            self.advance(Abandon("the job finished"))
        log.info("job finished at step %d", step)
        self.save()

    def suspended_at(self, step: int, cursor: int, path: str) -> None:
        """Rank 0 wrote the suspension checkpoint; the job is suspended."""
        if self.suspended is not None:
            return
        self.suspended = {"step": int(step), "cursor": int(cursor), "path": str(path), "at": time.time()}
        g = self.group
        g.progress.update(step=int(step), cursor=int(cursor))
        if g.plan is not None and self.change is not None:
            self.changes.append(ChangeRecord(
                gen=g.plan.target.gen, kind="suspend", from_size=g.gen.world_size if g.gen else 0, to_size=0,
                switch_step=int(step), requested_at=self.change.requested_at, switched_at=time.time()).__dict__)
            self.advance(Switch())
        elif self.change is not None:
            self.advance(Abandon("suspended"))
        g.clear_plan()
        log.info("job suspended at step %d (checkpoint %s)", step, path)
        self.save()

    # ------------------------------------------------------------------ the periodic step
    def tick(self, dead: set[str], now: float, wall: float) -> list[dict[str, Any]]:
        """Pick up rank 0's progress and the liveness beats, drop workers lost
        before their first step (:class:`LostWorkers`), abandon a change
        whose newcomers did not come, end a recovery whose window is over
        (``dead``: workers whose process failed); returns the records of
        newly found hung members (none during a recovery: its survivors wait)."""
        g = self.group
        g.read_progress()
        self.health.observe(g.beats(self.change.expect if self.change else ()), now)
        gone = dead | self.health.silent(now, phase="join")  # lost: process failed, or silent while joining
        self.lost.sweep(self, dead, gone, wall)
        self.lost.replan(self, gone)
        self.expire(wall)
        self.check_recovery(dead, now, wall)
        if self.recovery is not None or g.gen is None:
            return []
        gone = {h["worker_id"] for h in self.hung if h["gen"] == g.gen.gen}  # killed already
        leaving = set(g.plan.leavers) if g.plan is not None else set()
        recs = [{"worker_id": w, "gen": g.gen.gen, "reason": why, "detected_at": wall, "action": "killing"}
                for w, why in self.health.hung(g.gen.members, gone, leaving, now)]
        self.hung += recs
        return recs


def save_progress(core: JobCore) -> None:
    """Save the snapshot before a step beyond the saved one is reported, so
    a master restarted from it (``--resume``, or on another host) never
    reports less than this one did: rank 0's progress reaches the master
    through the store and is not a transition that saves by itself."""
    if core.backend is not None and int(core.group.progress.get("step", 0)) > core.saved_step:
        core.save()


def job_status(core: JobCore, url: str) -> Status:
    """What :meth:`JobMaster.status` answers (reads only)."""
    g, c, p = core.group.gen, core.change, core.group.progress
    if core.finished:
        state = "finished"
    elif core.suspended is not None:
        state = "suspended"
    elif g is None:
        state = "forming"
    else:
        state = "running" if c is None else "changing"
    return Status(job=core.group.job, state=state, gen=g.gen if g else 0, world_size=g.world_size if g else 0,
                  members=g.members if g else (), step=int(p["step"]), cursor=int(p["cursor"]),
                  epoch=int(p["epoch"]), step_time_s=float(p["step_time_s"]), changing=c is not None,
                  pending=None if c is None else c.pending, changes=tuple(core.changes), master_url=url,
                  stragglers=tuple(core.stragglers), hung=tuple(core.hung), last_step=tuple(p.get("last_step") or ()),
                  dropped=tuple(core.lost.records), goodput=dict(p.get("goodput") or {}),
                  hosts={w: str(core.group.workers.get(w, {}).get("host") or "") for w in (g.members if g else ())})


def refuse(core: JobCore, worker_id: str, host: str, checkpoint_local: str) -> str | None:
    """Why ``worker_id`` may not register (see
    :meth:`Generations.checkpoint_conflict`); a waiting change that expects
    it is abandoned at once rather than after the join timeout."""
    why = core.group.checkpoint_conflict(worker_id, host, checkpoint_local)
    c = core.change
    if why and c is not None and c.status is ChangeStatus.WAITING and worker_id in c.expect:
        if c.kind is ChangeKind.MIGRATE:  # a half-done move is not a scale-out: its replacements exit
            core.group.mark(c.joiners, "left")
        else:
            core.group.queue += c.joiners
        core.advance(Abandon(f"worker {worker_id} refused: {why}"))
        core.save()
    return why
