"""One tick of the level-triggered reconciler: each live job moves one step
through its phase machine (:mod:`tidal.control.phases`). Observed events come
first (a process exited, GPUs became free, a change timed out); otherwise the
plan's change for the job may start one. A step is one short transaction, plus
at most one short request to the job's master outside it; nothing waits for a
remote change."""

from __future__ import annotations

import dataclasses
import logging
from typing import Mapping

from sqlalchemy import select, update

from tidal import settings
from tidal.control import effects, intents
from tidal.control.db import GPU, Job, Process
from tidal.control.effects import Context, release_dead_workers, release_idle, set_phase
from tidal.control.observe import gpu_availability, observe, quiet_jobs
from tidal.control.phases import (
    DONOR, ENDING, IN_FLIGHT, RUNNING, STARTING, TERMINAL, WARMING, JOINING, SHRINKING, Bounds, advance, answer_event,
    intent, judge,
)
from tidal.scheduler.diff import JobDelta

log = logging.getLogger(__name__)

#: phases whose dead workers give their GPUs back at once
_RELEASES_DEAD = frozenset({STARTING, RUNNING, WARMING, JOINING, SHRINKING})
#: phases that may free GPUs this tick: stepped first, so a taker sees them free
_FIRST = DONOR | {"ending", "cancelling", "restarting"}
#: job states that hold no GPU once their processes are gone
_HOLD_NONE = (*TERMINAL, "submitted", "pending")


def bounds_from_settings(change_timeout_s: float) -> Bounds:
    """The liveness bounds from :mod:`tidal.settings` (read when a coordinator starts)."""
    return Bounds(change_s=change_timeout_s, start_s=settings.START_TIMEOUT_S.get(),
                  stall_s=settings.STALL_TIMEOUT_S.get(), restarts=settings.RESTART_LIMIT.get())


def _gids(delta: JobDelta | None) -> list[int]:
    """The GPUs a job's change takes (start, grow) or gives back (shrink, move)."""
    if delta is None:
        return []
    if delta.kind == "start":
        return list(delta.want)
    if delta.kind == "grow":
        return list(delta.added)
    return list(delta.removed)


class Reconciler:
    """Moves every live job one step per :meth:`tick`."""

    def __init__(self, cx: Context, change_timeout_s: float = 120.0) -> None:
        self.cx = cx
        self.change_timeout_s = change_timeout_s
        cx.bounds = bounds_from_settings(change_timeout_s)
        cx.crash_limit, cx.backoff_s = settings.CRASH_LIMIT.get(), settings.CRASH_BACKOFF_S.get()

    @property
    def store(self):
        return self.cx.store

    def tick(self, deltas: Mapping[str, JobDelta], now: float) -> int:
        """Step every live job; the number left with a change in flight."""
        self.sweep()
        with self.store.session(write=False) as s:
            jobs = s.execute(select(Job.id, Job.phase, Job.tags).where(Job.state.notin_(TERMINAL))
                             .order_by(Job.submit_time, Job.id)).all()
            # a job to fail for running out of memory is never quiet (observe() does not see that)
            quiet = quiet_jobs(s, deltas, now, self.change_timeout_s, self.cx.bounds) - {
                r.id for r in jobs if (r.tags or {}).get("_oom_failed")}

        def rank(row) -> int:
            d = deltas.get(row.id)
            return 0 if row.phase in _FIRST else (1 if d is not None and d.kind in ("stop", "shrink", "move") else 2)

        in_flight = 0
        for row in sorted(jobs, key=rank):
            if row.id in quiet:  # nothing to do: no transaction
                in_flight += row.phase in IN_FLIGHT
                continue
            try:
                phase = self.step(row.id, deltas.get(row.id), now)
            except Exception as e:  # noqa: BLE001 - one job's failure must not stop the others
                log.exception("step of %s failed", row.id)
                with self.store.session() as s:
                    self.store.log(s, "action.failed", row.id, phase=row.phase, error=str(e))
                phase = row.phase
            in_flight += phase in IN_FLIGHT
        return in_flight

    def sweep(self) -> None:
        """Finished jobs keep nothing: their phase follows a state the API set
        (cancelled, or completed by hand), leftover processes stop, reservations go."""
        with self.store.session() as s:
            ended = select(Job.id).where(Job.state.in_(TERMINAL))
            s.execute(update(Job).where(Job.state.in_(TERMINAL), Job.phase != Job.state).values(phase=Job.state)
                      .execution_options(synchronize_session=False))
            s.execute(update(Process).where(Process.job_id.in_(ended), Process.state.in_(("pending", "running")),
                                            Process.desired == "run").values(desired="stop")
                      .execution_options(synchronize_session=False))
            s.execute(update(GPU).where(GPU.reserved_for.in_(ended)).values(reserved_for=None)
                      .execution_options(synchronize_session=False))
            # GPUs left with jobs that hold none (a cancellation past its bound, a restart while a
            # node was away) go back once no process of the job may use them
            stale = s.scalars(select(Job).where(Job.state.in_(_HOLD_NONE),
                                                Job.id.in_(select(GPU.job_id).where(GPU.job_id.is_not(None))))).all()
            for j in stale:
                release_idle(self.cx, s, j, unreserve=False)

    def step(self, job_id: str, delta: JobDelta | None, now: float) -> str:
        """Move one job one step; its phase afterwards."""
        with self.store.session() as s:
            j = s.get(Job, job_id)
            if j is None:
                return "gone"
            if j.state in TERMINAL or j.phase in TERMINAL:  # e.g. cancelled by the API before it started
                return j.phase
            obs, current = observe(s, j)
            if j.phase in _RELEASES_DEAD and not obs.master_gone:
                # may raise the memory limit, count a crash, or give up on the job
                if release_dead_workers(self.cx, s, j, current, now):
                    obs, current = observe(s, j)
            elif j.phase == ENDING:
                release_idle(self.cx, s, j)  # a finished job's GPUs go back as its processes end
            tags = j.tags or {}
            obs = dataclasses.replace(obs, oom_failed=str(tags.get("_oom_failed", "")),
                                      backoff=now < float(tags.get("_backoff_until") or 0.0))
            ev = judge(obs, now, self.change_timeout_s, self.cx.bounds)
            if ev is not None:
                effects.observed_effect(j.phase, ev)(self.cx, s, j, obs, now)
                set_phase(j, advance(j.phase, ev))
                return j.phase
            set_phase(j, j.phase)  # a state reset by someone else follows the phase
            gids = _gids(delta)
            kind = delta.kind if delta is not None else None
            avail = gpu_availability(s, job_id, gids) if kind in ("start", "grow") else ""
            it = intent(obs, kind, avail)
            if it is None:
                return j.phase
            if it in ("start", "prestart"):
                intents.start(self.cx, s, j, it == "prestart", gids, now)
                set_phase(j, advance(j.phase, it))
                return j.phase
            prepared = intents.prepare(s, j, it, gids, now)
        return self._request(job_id, prepared)

    def _request(self, job_id: str, prepared: intents.Prepared) -> str:
        """One request to the job's master, outside any transaction; the store
        changes only if it accepted."""
        ans = None
        if prepared.intent == "shrink" and not prepared.workers:
            ev: str | None = "released"  # no live worker on those GPUs: nothing to ask
        else:
            ans = intents.ask(dataclasses.replace(prepared, token=self.cx.credentials.job_token(job_id)))
            ev = answer_event(prepared.intent, ans.status) if ans is not None else None
        if ev is None:
            return RUNNING  # busy or unreachable: ask again next tick
        with self.store.session() as s:
            j = s.get(Job, job_id)
            if j is None:
                return "gone"
            intents.apply(self.cx, s, j, prepared, ev, ans)
            set_phase(j, advance(j.phase, ev))
            return j.phase
