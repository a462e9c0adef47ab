"""The scheduler loop of the live cluster: a level-triggered reconciler.

Every round (a periodic tick, sooner when woken by a submission, a finish, a
node joining or leaving, or at the plan's ``wake_at``) the loop builds a
Snapshot from the store, calls the configured policy — the same code the
simulator runs — validates its plan and diffs it against the GPUs jobs hold
(:mod:`tidal.scheduler.diff`). The plan is the desired state; the store (the
process rows agents report, the progress job masters report) is the observed
one. Each round then moves every job one step through its phase machine
(:mod:`tidal.control.phases`, :mod:`tidal.control.reconcile`), SideCar §III-B:
donors give GPUs back first (reshaping down), newcomers take them after, and a
job that gets a donor's GPUs starts its processes early, gated, so they warm
up meanwhile (SideCar §III-C). No round waits for a remote change: a change in
flight is recorded with the job and judged again next round, which comes
sooner while one is in flight.

Beside the rounds, a small timer runs the registered watches every
:data:`WATCH_S` (:func:`register_watch`): the API's judge of nodes that
stopped heart-beating is one, so a dead agent is found on any cluster size.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from sqlalchemy import func, select, update

from tidal import settings
from tidal.control.autoconf import AutoConf, apply_autoconf
from tidal.control.db import GPU, Job, Store
from tidal.control.effects import Context, set_phase
from tidal.control.phases import PENDING, SUBMITTED, advance
from tidal.control.promstats import DecisionLog
from tidal.control.reconcile import Reconciler
from tidal.control.snapshot import GpuMap, build_snapshot
from tidal.core.overhead import OverheadModel
from tidal.scheduler.api import Plan, Policy, Snapshot
from tidal.scheduler.constraints import strip_breaks
from tidal.scheduler.diff import JobDelta, PlanError, diff_plan, validate_plan
from tidal.scheduler.registry import get_policy

log = logging.getLogger(__name__)

#: the shortest pause of the loop (a plan whose ``wake_at`` has passed)
MIN_WAIT_S = 0.05
#: the period of the watches (see :func:`register_watch`)
WATCH_S = 1.0

#: a check of the store, run by the coordinator's timer: ``watch(store, now)``,
#: True when it changed something (a round follows at once)
Watch = Callable[[Store, float], bool]
_WATCHES: list[Callable[[], Watch]] = []


def register_watch(factory: Callable[[], Watch]) -> None:
    """Every coordinator started from now on runs ``factory()`` every
    :data:`WATCH_S`, beside its rounds. A watch reads and writes the store
    only, never waits on a remote process. The modules that own a check
    register it (they import this one; this one cannot import them)."""
    if factory not in _WATCHES:
        _WATCHES.append(factory)


class Coordinator:
    """The loop thread around :meth:`round`. ``tick_s``: the period when
    nothing happens; ``busy_tick_s``: the period while a change is in flight."""

    def __init__(
        self,
        store: Store,
        policy: str | Policy = "edf",
        *,
        server_url: str = "",
        tick_s: float = 2.0,
        overheads: OverheadModel | None = None,
        change_timeout_s: float | None = None,
        home: Path | None = None,
        busy_tick_s: float = 0.5,
        leading: Callable[[], bool] | None = None,
    ) -> None:
        self.store = store
        self.policy = get_policy(policy) if isinstance(policy, str) else policy
        self.tick_s = tick_s
        self.busy_tick_s = min(busy_tick_s, tick_s)
        self.overheads = overheads or OverheadModel(mode="stop-free", pause_s=0.5, warmup_s=3.0)
        self.cx = Context(store, server_url=server_url)
        if home is not None:
            self.cx.home = Path(home)
        self.reconciler = Reconciler(self.cx, settings.CHANGE_TIMEOUT_S.get() if change_timeout_s is None
                                     else change_timeout_s)
        self.autoconf = AutoConf(store)  # sizes jobs submitted without a GPU count (docs/autoconf.md)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch_thread: threading.Thread | None = None
        self.rounds = 0
        self.decisions = DecisionLog()  # recent decisions and their latency (dashboard, /metrics)
        # whether this server replica schedules now (the leader among replicas; tidal.control.leader)
        self.leading: Callable[[], bool] = leading or (lambda: True)
        self.in_flight = 0  # jobs with a change in flight after the last round
        self._waiting: set[str] = set()  # jobs the last plan left waiting for GPUs of their types
        self.wake_at: float | None = None  # the last plan's
        self.draining = False  # stopping: every job holding GPUs is suspended, nothing starts (drain())
        self._last_account = time.time()

    @property
    def decision_latencies(self):
        """Submit -> start, seconds, of the latest starts (bounded)."""
        return self.cx.latencies

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> "Coordinator":
        self._thread = threading.Thread(target=self._run, name="tidal-coordinator", daemon=True)
        self._thread.start()
        watches = [factory() for factory in _WATCHES]
        if watches:
            self._watch_thread = threading.Thread(target=self._watch, args=(watches,), name="tidal-watch",
                                                  daemon=True)
            self._watch_thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for t in (self._thread, self._watch_thread):
            if t:
                t.join(timeout=10)

    def wake(self) -> None:
        self._wake.set()

    def drain(self) -> None:
        """Stop gracefully (``tidal up`` on Ctrl-C): from now on every round
        suspends every job holding GPUs, with a checkpoint, instead of asking
        the policy, and starts nothing; suspended jobs wait as ``pending`` in
        the store, so the next server resumes them."""
        self.draining = True
        self.wake()

    def draining_left(self) -> list[str]:
        """Jobs not settled yet while draining: still holding GPUs or on their
        way to give them back (a job whose master refuses to suspend stays here)."""
        live = ("running", "resizing", "suspending", "restarting")
        with self.store.session(write=False) as s:
            return list(s.scalars(select(Job.id).where(Job.state.in_(live)).order_by(Job.id)))

    def next_wait(self, now: float) -> float:
        """Seconds until the next round unless woken."""
        wait = self.busy_tick_s if self.in_flight else self.tick_s
        if self.wake_at is not None:
            wait = min(wait, self.wake_at - now)
        return max(MIN_WAIT_S, wait)

    def _run(self) -> None:
        # the job-master client lives in tidal.runtime, whose import pulls in
        # torch (1-3 s): pay it now, not in the first reshaping
        import tidal.runtime.client  # noqa: F401

        while not self._stop.is_set():
            self._wake.wait(self.next_wait(time.time()))
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                if not self.leading():
                    continue  # a follower serves the API; the leader schedules
                self.round()
            except Exception:  # noqa: BLE001 - the loop must survive any bad round
                log.exception("scheduling round failed")

    def _watch(self, watches: list[Watch]) -> None:
        """The timer of the watches; one that changed something wakes the loop."""
        while not self._stop.wait(WATCH_S):
            if not self.leading():
                continue
            for watch in watches:
                try:
                    if watch(self.store, time.time()):
                        self.wake()
                except Exception:  # noqa: BLE001 - the timer must survive any bad check
                    log.exception("watch %s failed", watch)

    # -- one round ----------------------------------------------------------------
    def round(self) -> Plan | None:
        """Plan, then move every job one step; the plan (None without jobs or
        when the policy's plan was invalid)."""
        now = time.time()
        self.rounds += 1
        self._account(now)
        self.autoconf.tick(now)
        plan, deltas = self._plan(now)
        self.wake_at = plan.wake_at if plan is not None else None
        self.in_flight = self.reconciler.tick(deltas, now)
        return plan

    def _plan(self, now: float) -> tuple[Plan | None, dict[str, JobDelta]]:
        with self.store.session(write=False) as s:
            snap, gmap, jobs = build_snapshot(s, now, self.overheads)
            snap = apply_pins(apply_autoconf(snap, jobs), jobs)
        if not snap.jobs or not gmap.to_gid:
            return None, {}  # no node is up (yet): jobs wait, none is judged against a cluster of nothing
        if self.draining:
            return None, {v.job_id: to_gids(JobDelta(v.job_id, v.gpus, ()), gmap) for v in snap.jobs if v.gpus}
        t0 = time.perf_counter()
        plan = self.policy.schedule(snap)
        self.decisions.record(self.policy.name, snap, plan, time.perf_counter() - t0, now)
        for jid, g in strip_breaks(snap, plan).items():
            log.warning("policy %s placed job %s on GPU %d of type %r, which it does not allow: not applied",
                        self.policy.name, jid, gmap.gid(g), snap.cluster.gpu_type_of(g))
        try:
            validate_plan(snap, plan)
        except PlanError as e:
            log.error("policy %s made an invalid plan, not executed: %s", self.policy.name, e)
            return None, {}
        self._decide(plan, now)
        return plan, {jid: to_gids(d, gmap) for jid, d in diff_plan(snap, plan).items()}

    def _decide(self, plan: Plan, now: float) -> None:
        """The plan's decisions that need no GPU: drops, admissions, the
        policy's per-job memory (tags) and global batch."""
        with self.store.session() as s:
            for jid, reason in plan.drop.items():
                j = s.get(Job, jid)
                if j is not None and j.phase in (SUBMITTED, PENDING) and j.state in ("submitted", "pending"):
                    set_phase(j, advance(j.phase, "drop"))
                    j.drop_reason, j.end_time = reason, now
                    self.store.log(s, "job.dropped", jid, reason=reason)
            for jid in plan.admit:
                j = s.get(Job, jid)
                if j is not None and j.phase == SUBMITTED and j.state == "submitted":
                    set_phase(j, advance(j.phase, "admit"))
                    j.admitted, j.waiting_since = True, now
                    why = {k: v for k, v in plan.tags.get(jid, {}).items() if k in ("ef_class", "ef_share")}
                    self.store.log(s, "job.admitted", jid, policy=self.policy.name, **why)
            for jid, tags in plan.tags.items():
                j = s.get(Job, jid)
                if j is not None:
                    j.tags = {**(j.tags or {}), **tags}
            for jid, batch in plan.batch.items():
                j = s.get(Job, jid)
                if j is not None:
                    j.batch = int(batch)
            # why a job waits for GPUs of its types, shown as its reason until it no longer does
            for jid in (self._waiting | plan.waiting.keys()):
                j = s.get(Job, jid)
                if j is not None and (j.tags or {}).get("_waiting") != plan.waiting.get(jid):
                    j.tags = {k: v for k, v in (j.tags or {}).items() if k != "_waiting"}
                    if jid in plan.waiting:
                        j.tags = {**j.tags, "_waiting": plan.waiting[jid]}
            self._waiting = set(plan.waiting)

    def _account(self, now: float) -> None:
        """Attained service (GPU-seconds) and running time of running jobs."""
        dt = max(0.0, now - self._last_account)
        self._last_account = now
        # one statement, no job row loaded (their JSON columns are costly); the progress
        # (``done``) is written by the masters' status reports
        held = select(func.count()).select_from(GPU).where(GPU.job_id == Job.id).scalar_subquery()
        with self.store.session() as s:
            s.execute(update(Job).where(Job.state.in_(("running", "resizing")))
                      .values(executed=Job.executed + dt, attained=Job.attained + held * dt)
                      .execution_options(synchronize_session=False))


def to_gids(d: JobDelta, gmap: GpuMap) -> JobDelta:
    """A delta in the policy's GPU indices as one in the store's GPU ids."""
    return JobDelta(d.job_id, tuple(sorted(gmap.gid(i) for i in d.have)), tuple(sorted(gmap.gid(i) for i in d.want)))


def apply_pins(snap: Snapshot, jobs: dict[str, Any]) -> Snapshot:
    """A user's ``tidal scale ID N`` pins the job at N GPUs."""
    views = []
    changed = False
    for v in snap.jobs:
        pin = (jobs[v.job_id].spec or {}).get("pinned")
        if pin:
            views.append(v._replace(spec=replace(v.spec, elastic=True, allowed_gpus=(int(pin),),
                                                 min_gpus=None, max_gpus=None, requested_gpus=int(pin))))
            changed = True
        else:
            views.append(v)
    return replace(snap, jobs=tuple(views)) if changed else snap
