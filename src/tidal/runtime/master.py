"""The job master (EDL's leader, Elan's application master), one per job.

:class:`JobMaster` is the thread-safe face of the job's
:class:`~tidal.runtime.jobcore.JobCore`: it serves the scheduler's requests
(scale out/in, migrate, reshare, suspend) and the workers' (register,
assignment, agreed, switched, failed, left, done, stragglers, shards), runs
the periodic step (:meth:`JobMaster.check_health`) and starts and kills
workers through its :class:`~tidal.runtime.spawner.Spawner`. The HTTP
protocol that exposes it is in :mod:`tidal.runtime.server`.

Threads: the HTTP server calls the request methods from one thread per
connection, and the hosting loop (:func:`tidal.runtime.host.host_master`)
calls :meth:`JobMaster.check_health` every 0.1 s. All state lives in the
core and is guarded by one non-re-entrant lock, which each public method
takes once (the core never locks); the spawner (maybe an HTTP call to the
control plane) is called outside it. Reads (``status``, ``assignment``,
``store_info``, ``snapshot``) never change state (``status`` saves the
progress it is about to report, so a restarted master never reports less):
picking up rank 0's progress, abandoning a change whose newcomers did not
come and ending a recovery's window happen in the periodic step; requests from workers
(register, failed, switched, left) advance what they must themselves.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

from tidal import settings
from tidal.runtime.change import Abandon, Change, ChangeKind
from tidal.runtime.data import ShardManager
from tidal.runtime.generations import Generations
from tidal.runtime.health import kill_worker
from tidal.runtime.jobcore import JobCore, job_status, refuse, save_progress
from tidal.runtime.messages import Generation, ScaleAnswer, Status
from tidal.runtime.persistence import StateBackend
from tidal.runtime.replication import MODES
from tidal.runtime.sealed import store_key
from tidal.runtime.spawner import Spawner, WorkerLaunch, failed_workers
from tidal.runtime.stragglers import STRAGGLER_POLICIES, check_policy, decide, record_straggler
from tidal.net import LOOPBACK

__all__ = ["JobMaster", "STRAGGLER_POLICIES"]

log = logging.getLogger(__name__)


def _leavers(members: Sequence[str], count: int | None, ranks: Sequence[int] | None,
             workers: Sequence[str] | None) -> list[str] | str:
    """The members a scale-in removes (rank order): the given worker ids, the
    given ranks, or the ``count`` highest ranks; or why the request is wrong."""
    if workers:
        if any(w not in members for w in workers):
            return f"workers {sorted(set(workers) - set(members))} are not members"
        leavers = [w for w in members if w in workers]
    elif ranks:
        if any(r < 0 or r >= len(members) for r in ranks):
            return f"ranks {list(ranks)} out of range for world size {len(members)}"
        leavers = [members[r] for r in sorted(set(ranks))]
    elif int(count or 0) > 0:
        leavers = list(members[max(0, len(members) - int(count or 0)):])
    else:
        return "scale_in needs count > 0, ranks or workers"
    return "cannot remove every worker" if len(leavers) == len(members) else leavers


def _newcomers(gen: Generation, count: int | None, hosts: Sequence[str] | None, workers: Sequence[str] | None,
               max_size: int | None) -> int | str:
    """How many workers a scale-out adds, or why the request is wrong."""
    n = len(workers) if workers else len(hosts) if hosts else int(count or 0)
    if n <= 0:
        return "scale_out needs count > 0, hosts or workers"
    if workers and set(workers) & set(gen.members):
        return f"workers {sorted(set(workers) & set(gen.members))} are members already"
    if max_size is not None and gen.world_size + n > max_size:
        return f"would exceed the largest size {max_size}"
    return n


def _movers(members: Sequence[str], ranks: Sequence[int], hosts: Sequence[str] | None,
            can_spawn: bool, workers: Sequence[str] | None = None) -> list[str] | str:
    """The members a migration moves, or why the request is wrong;
    ``workers``: the replacements' ids when someone else starts them."""
    if not ranks or any(r < 0 or r >= len(members) for r in ranks):
        return f"migrate needs ranks in [0, {len(members)}), got {list(ranks)}"
    movers = [members[r] for r in sorted(set(ranks))]
    if hosts is not None and len(hosts) != len(movers):
        return f"{len(movers)} workers to move but {len(hosts)} hosts"
    if len(movers) == len(members):
        return "cannot move every worker at once: no live worker would hold the state"
    if workers:
        if len(workers) != len(movers) or set(workers) & set(members):
            return f"{len(movers)} workers to move need as many new worker ids, not {list(workers)}"
        return movers
    if not can_spawn:
        return "migrate needs a spawner to start the replacements"
    return movers


def _shard_op(shards: ShardManager, op: str, body: dict[str, Any]) -> dict[str, Any]:
    """One shard-mode request: hand out, advance, complete or release a data shard."""
    if op == "next":
        sh = shards.next(body["worker_id"])
        return {"status": "ok", "shard": sh.to_json() if sh else None}
    if op == "progress":
        shards.progress(int(body["shard_id"]), int(body["offset"]))
    elif op == "complete":
        shards.complete(int(body["shard_id"]))
    elif op == "release":
        shards.release(body["worker_id"])
    else:
        return {"status": "error", "message": f"unknown shard op {op}"}
    return {"status": "ok"}


class JobMaster:
    """The master of one job of ``size`` workers (at most ``max_size``).
    ``spawner`` starts the newcomers of ``scale_out(count)`` and ``migrate``,
    with ids from ``w<first_worker>`` on; without it, ``scale_out`` waits
    for workers started elsewhere to register."""

    def __init__(self, job: str, size: int, *, store_host: str = LOOPBACK, store_port: int = 0,
                 backend: StateBackend | None = None, spawner: Spawner | None = None, switch_lead_s: float = 0.0,
                 join_timeout_s: float = 120.0, resume: bool = False, shard_manager: ShardManager | None = None,
                 max_size: int | None = None, first_worker: int = 0, recovery_window_s: float = 20.0,
                 straggler_policy: str = "report", replication: str = "topology",
                 hang_timeout_s: float = 30.0, token: str | None = None) -> None:
        if replication not in MODES:
            raise ValueError(f"replication must be one of {list(MODES)}, not {replication!r}")
        self.job = job
        # EDL §5.2: report only, remove by scale-in, replace (migrate), or a smaller batch share
        self.straggler_policy = check_policy(straggler_policy)
        self.spawner, self.max_size = spawner, max_size
        self.group = Generations(job, size, store_host=store_host, store_port=store_port,
                                 switch_lead_s=switch_lead_s, replication=replication, key=store_key(token))
        self.store_port = self.group.store_port  # where the workers rendezvous (fixed)
        self.core = JobCore(self.group, backend=backend, shards=shard_manager, join_timeout_s=join_timeout_s,
                            recovery_window_s=recovery_window_s, hang_timeout_s=hang_timeout_s,
                            first_worker=first_worker)
        self.url = ""
        self.moved_to: str | None = None
        self._lock = threading.Lock()
        if resume and backend is not None and (snap := backend.load()):
            self.core.restore(snap)

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any], **kw: Any) -> "JobMaster":
        """A master that continues from another's snapshot (restart or handover)."""
        m = cls(snap["job"], snap["initial_workers"], **kw)
        m.core.restore(snap)
        return m

    @property
    def suspended(self) -> dict[str, Any] | None:
        """Where a suspended job's checkpoint is (step, cursor, path), else None."""
        return self.core.suspended

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self.core.to_json()

    def restore(self, snap: dict[str, Any]) -> None:
        """Adopt a snapshot (from a handover or a saved state) and persist it."""
        with self._lock:
            self.core.restore(snap)
            self.core.save()

    def handover(self, url: str) -> dict[str, Any]:
        """Hand the state to a master at ``url`` (e.g. because this host is
        leaving); afterwards this master redirects every request there."""
        with self._lock:
            snap = self.core.to_json()
            self.moved_to = url
            self.group.moved(url)
            self.core.save()
            return snap

    # ------------------------------------------------------------------ the periodic step
    def check_health(self, now: float | None = None, wall: float | None = None) -> list[str]:
        """The periodic step its hosting loop runs (:meth:`JobCore.tick`), then
        kill the hung members so their peers' collective fails at once and the
        usual recovery runs. ``now``: the monotonic clock (liveness beats);
        ``wall``: the wall clock (request and failure times, which persist).
        Returns the workers found hung."""
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        dead = failed_workers(self.spawner)
        with self._lock:
            if self.core.finished or self.moved_to:
                return []
            recs = self.core.tick(dead, now, wall)
            infos = [dict(self.group.workers.get(r["worker_id"]) or {}) for r in recs]
        for rec, info in zip(recs, infos):  # maybe an HTTP call to the control plane: not under the lock
            action = kill_worker(self.spawner, rec["worker_id"], info)
            log.warning("worker %s is hung (%s): %s", rec["worker_id"], rec["reason"], action)
            with self._lock:
                rec["action"] = action
        if recs:
            with self._lock:
                self.core.save()
        return [r["worker_id"] for r in recs]

    # ------------------------------------------------------------------ scheduler API
    def _begin(self, request_id: str | None, change: Change, ans: ScaleAnswer,
               shares: dict[str, float] | None = None) -> ScaleAnswer:
        self.core.begin(change, shares)
        self.core.save()
        return self.core.remember(request_id, ans)

    def _start(self, ids: list[str], hosts: Sequence[str] | None, request_id: str | None,
               ans: ScaleAnswer) -> ScaleAnswer:
        """Start the newcomers of the change just begun through the spawner
        (without the lock: it may be slow); a failed start drops the change."""
        try:
            if self.spawner is not None:
                self.spawner.spawn([WorkerLaunch(w, hosts[i] if hosts else None) for i, w in enumerate(ids)])
        except Exception as e:  # noqa: BLE001 - any spawner failure refuses the change
            with self._lock:
                if self.core.change is not None:
                    self.core.advance(Abandon(f"spawn failed: {e}"))
                self.core.save()
            return ScaleAnswer("error", f"spawn failed: {e}")
        with self._lock:
            return self.core.remember(request_id, ans)

    def scale_out(self, count: int | None = None, hosts: list[str] | None = None, workers: list[str] | None = None,
                  request_id: str | None = None) -> ScaleAnswer:
        """Add ``count`` workers (or one per host in ``hosts``) that the spawner
        starts, or expect ``workers`` (ids) started by someone else (the control
        plane's coordinator); they warm up while the others train (EDL §4.2).
        A repeated ``request_id`` gets the first answer again."""
        with self._lock:
            if early := self.core.busy(request_id):
                return early
            gen = self.group.gen
            assert gen is not None
            n = _newcomers(gen, count, hosts, workers, self.max_size)
            if isinstance(n, str):
                return ScaleAnswer("error", n)
            ids = self.core.allocate(n, workers)
            ans = ScaleAnswer("accepted", f"{'expecting' if workers else 'starting'} {ids}", size=gen.world_size + n)
            change = Change(ChangeKind.SCALE_OUT, time.time(), expect=tuple(ids))
            ans = self._begin(request_id if workers else None, change, ans)
        return ans if workers else self._start(ids, hosts, request_id, ans)

    def scale_in(self, count: int | None = None, ranks: list[int] | None = None, workers: list[str] | None = None,
                 request_id: str | None = None) -> ScaleAnswer:
        """Remove ``count`` workers (the highest ranks), the given ranks or
        the given worker ids; they leave after the agreed switch step, the
        others do not stop."""
        with self._lock:
            if early := self.core.busy(request_id):
                return early
            assert self.group.gen is not None
            members = self.group.gen.members
            leavers = _leavers(members, count, ranks, workers)
            if isinstance(leavers, str):
                return ScaleAnswer("error", leavers)
            return self._begin(request_id, Change(ChangeKind.SCALE_IN, time.time(), leavers=tuple(leavers)),
                               ScaleAnswer("accepted", f"removing {leavers}", size=len(members) - len(leavers)))

    def migrate(self, ranks: list[int], hosts: list[str] | None = None, request_id: str | None = None,
                workers: list[str] | None = None) -> ScaleAnswer:
        """Move the workers at ``ranks`` (to ``hosts`` if given) as one change
        (EDL §5.2): as many newcomers warm up while everyone trains, then at one
        agreed step the old ones leave and the new ones join, receiving the
        state from their nearest live worker. The size does not change.
        ``workers``: newcomers started by someone else, as in :meth:`scale_out`."""
        with self._lock:
            if early := self.core.busy(request_id):
                return early
            assert self.group.gen is not None
            members = self.group.gen.members
            movers = _movers(members, ranks, hosts, self.spawner is not None, workers)
            if isinstance(movers, str):
                return ScaleAnswer("error", movers)
            ids = self.core.allocate(len(movers), workers)
            ans = ScaleAnswer("accepted", f"moving {movers} to {ids}", size=len(members))
            change = Change(ChangeKind.MIGRATE, time.time(), expect=tuple(ids), leavers=tuple(movers))
            ans = self._begin(request_id if workers else None, change, ans)
        return ans if workers else self._start(ids, hosts, request_id, ans)

    def reshare(self, shares: dict[str, float], request_id: str | None = None) -> ScaleAnswer:
        """Give workers a different share of the global batch (relative
        weights; 1.0 is an even share) from an agreed step on, e.g. a smaller
        one to a straggler (EDL §5.2). The weighted all-reduce keeps the update
        the fixed-size one; the data stay exactly once per epoch."""
        with self._lock:
            if early := self.core.busy(request_id):
                return early
            assert self.group.gen is not None
            bad = [w for w, x in shares.items() if w not in self.group.gen.members or not (float(x) > 0)]
            if bad:
                return ScaleAnswer("error", f"shares need current members and positive weights: {bad}")
            return self._begin(request_id, Change(ChangeKind.RESHARE, time.time()),
                               ScaleAnswer("accepted", f"shares {shares}", size=self.group.gen.world_size),
                               {w: float(x) for w, x in shares.items()})

    def suspend(self, request_id: str | None = None) -> ScaleAnswer:
        """Suspend the whole job (preemption by the scheduler): at an agreed
        step rank 0 writes a checkpoint of exactly the state the next step
        starts from, and every worker leaves. Started again with the same
        checkpoint directory, the job resumes there (docs/runtime.md)."""
        with self._lock:
            if early := self.core.busy(request_id):
                return early
            assert self.group.gen is not None
            members = self.group.gen.members
            if not all((self.group.workers.get(w) or {}).get("checkpoints") for w in members):
                return ScaleAnswer("error", "the job's workers have no checkpoint directory "
                                            f"(${settings.CHECKPOINT_DIR.name})")
            return self._begin(request_id, Change(ChangeKind.SUSPEND, time.time(), leavers=members),
                               ScaleAnswer("accepted", "suspending", size=0))

    def straggler(self, worker_id: str, gen: int, step: int, ratio: float,
                  detected_at: float | None = None) -> dict[str, Any]:
        """Rank 0 found ``worker_id`` slower than 1.2x the median compute time
        for 10 consecutive steps (EDL §5.2, DLRover §5.4): recorded once, then
        the policy acts on it (:func:`tidal.runtime.stragglers.decide`) if no
        change is running and it is not the last worker."""
        with self._lock:
            rec = record_straggler(self.core.stragglers, worker_id, gen, step, ratio, detected_at)
            if rec is None:
                return {"status": "ok"}  # a retried report
            act = decide(self.straggler_policy, worker_id, gen, ratio, self.group.gen)
            self.core.save()
        if act.policy != "report":  # a replacement starts through the spawner: not under the lock
            ans = (self.scale_in(workers=[worker_id]) if act.policy == "remove" else
                   self.reshare({worker_id: act.share}) if act.policy == "share" else self.migrate([act.rank]))
            with self._lock:
                rec["action"] = act.outcome(ans)
                self.core.save()
        return {"status": "ok", "action": rec["action"]}

    # ------------------------------------------------------------------ reads
    def status(self) -> Status:
        """The job's status; progress it reports was saved first (:func:`save_progress`)."""
        with self._lock:
            save_progress(self.core)
            return job_status(self.core, self.url)

    def store_info(self) -> dict[str, Any]:
        """Where workers rendezvous and exchange per-step progress and plans."""
        return self.group.store_info()

    def published_plan(self, gen: int) -> dict[str, Any] | None:
        """The plan published for generation ``gen`` (recent ones), if any."""
        with self._lock:
            return self.group.plans.get(gen)

    def assignment(self, worker_id: str, after_gen: int = 0) -> dict[str, Any]:
        with self._lock:
            return {"status": "finished"} if self.core.finished else self.group.assignment(worker_id, after_gen)

    # ------------------------------------------------------------------ worker API
    def register(self, worker_id: str, pid: int = 0, host: str = "", switch: str = "",
                 checkpoints: bool = False, checkpoint_local: str = "") -> dict[str, Any]:
        with self._lock:
            if why := refuse(self.core, worker_id, host, checkpoint_local):
                return {"status": "error", "message": why}
            self.group.registered(worker_id, pid, host, switch, checkpoints, checkpoint_local)
            self.core.register(worker_id)
            self.core.save()
            return self.group.store_info()

    def heartbeat(self, p: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.group.heartbeat(p)
            return {"plan": self.group.plan.to_json() if self.group.plan else None, "finished": self.core.finished}

    def agreed(self, gen: int, switch_step: int) -> dict[str, Any]:
        with self._lock:
            self.core.agreed(gen, switch_step)
            return {"status": "ok"}

    def switched(self, gen: int, step: int, pause_s: float = 0.0) -> dict[str, Any]:
        with self._lock:
            self.core.switched(gen, step, pause_s)
            return {"status": "ok"}

    def failed(self, worker_id: str, gen: int, step: int) -> dict[str, Any]:
        """A survivor's collective failed in generation ``gen`` (a peer died)."""
        dead = failed_workers(self.spawner)
        with self._lock:
            self.core.failed(worker_id, gen, step, dead, time.monotonic(), time.time())
            return {"status": "ok"}

    def suspended_at(self, step: int, cursor: int, path: str) -> dict[str, Any]:
        """Rank 0 wrote the suspension checkpoint; the job is suspended."""
        with self._lock:
            self.core.suspended_at(step, cursor, path)
            return {"status": "ok"}

    def left(self, worker_id: str) -> dict[str, Any]:
        with self._lock:
            self.core.left(worker_id)
            return {"status": "ok"}

    def done(self, step: int, cursor: int, epoch: int | None = None) -> dict[str, Any]:
        with self._lock:
            self.core.done(step, cursor, epoch)
            return {"status": "ok"}

    # ------------------------------------------------------------------ shard mode
    def shard_call(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """Shard mode (EDL §4.3); shard offsets survive a master restart."""
        shards = self.core.shards
        if shards is None:
            return {"status": "error", "message": "shard mode not enabled"}
        ans = _shard_op(shards, op, body)
        if ans["status"] == "ok":
            with self._lock:
                self.core.save()
        return ans
