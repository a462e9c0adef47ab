"""The job master (EDL's leader, Elan's application master), one per job.

It owns membership, the rendezvous store (a torch ``TCPStore``; generation
``g`` rendezvouses under the prefix ``tidal/<job>/g<g>/``), the last reported
data cursor and step-time statistics, and the plan of the next change.
Scaling requests are serialised: while a change is in progress every request
gets a *retry* answer (EDL §3.1). The state is saved through a pluggable
:class:`~tidal.runtime.persistence.StateBackend` after every transition so a
restarted master resumes.

The HTTP protocol that exposes it is in :mod:`tidal.runtime.server`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from typing import Any, Callable

from tidal.runtime.data import ShardManager
from tidal.runtime.messages import ChangeRecord, Generation, SwitchPlan, ScaleAnswer, Status
from tidal.runtime.persistence import StateBackend
from tidal.runtime.replication import MODES, Location, assign_sources

log = logging.getLogger(__name__)

STRAGGLER_POLICIES = ("report", "remove", "replace", "share")

Spawner = Callable[[list[str], "list[str] | None"], None]
"""Starts worker processes with the given ids (optionally on given hosts)."""


def _is_worker(pid: int, worker_id: str) -> bool:
    """Whether process ``pid`` still is worker ``worker_id`` (its environment
    names it), so a reused pid is never killed. Linux ``/proc`` only."""
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return False
    return f"TIDAL_WORKER_ID={worker_id}".encode() in env


class JobMaster:
    """Membership, generations and the plan of the next change.

    ``spawner(ids, hosts)`` starts new workers for ``scale_out`` (the local
    launcher passes one); without it, ``scale_out`` waits for workers started
    elsewhere to register.
    """

    def __init__(
        self,
        job: str,
        initial_workers: int,
        *,
        store_host: str = "127.0.0.1",
        store_port: int = 0,
        backend: StateBackend | None = None,
        spawner: Spawner | None = None,
        switch_lead_s: float = 0.5,
        join_timeout_s: float = 120.0,
        resume: bool = False,
        shard_manager: ShardManager | None = None,
        max_workers: int | None = None,
        recovery_window_s: float = 20.0,
        straggler_policy: str = "report",
        replication: str = "topology",
        hang_timeout_s: float = 30.0,
    ) -> None:
        import torch.distributed as dist  # heavy import, only where needed

        self.job = job
        self.initial_workers = int(initial_workers)
        self.backend = backend
        self.spawner = spawner
        self.switch_lead_s = float(switch_lead_s)  # T_a of EDL §4.2
        self.join_timeout_s = float(join_timeout_s)
        self.shards = shard_manager
        self.max_workers = max_workers
        self.recovery_window_s = float(recovery_window_s)
        self.recovery: dict[str, Any] | None = None  # survivors of a failed generation reporting in
        if straggler_policy not in STRAGGLER_POLICIES:
            raise ValueError(f"straggler_policy must be one of {list(STRAGGLER_POLICIES)}, not {straggler_policy!r}")
        # EDL §5.2: report only, remove by scale-in, replace (migrate), or a smaller batch share
        self.straggler_policy = straggler_policy
        if replication not in MODES:
            raise ValueError(f"replication must be one of {list(MODES)}, not {replication!r}")
        self.replication = replication  # how newcomers get the state (Elan §IV)
        # a member that stops beating (or is stuck in compute while its peers
        # wait) for this long is killed, so the others recover (0: never)
        self.hang_timeout_s = float(hang_timeout_s)
        self._alive: dict[str, dict[str, Any]] = {}  # liveness beats, on the monotonic clock
        self._last_health: float | None = None
        self.hung: list[dict[str, Any]] = []
        self.stragglers: list[dict[str, Any]] = []
        self._lock = threading.RLock()
        self.store = dist.TCPStore(
            store_host, store_port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
        )
        self.store_host, self.store_port = store_host, int(self.store.port)
        # per-step traffic goes through the store (C++), not HTTP: rank 0 writes
        # its progress and reads the published plan (empty when none)
        self.plan_key, self.progress_key = f"tidal/{job}/plan", f"tidal/{job}/progress"
        self.store.set(self.plan_key, "")
        self.url = ""
        self.moved_to: str | None = None
        # membership and progress
        self.workers: dict[str, dict[str, Any]] = {}
        self.queue: list[str] = []  # registered, not yet in any generation
        self.gen: Generation | None = None
        self.plan: SwitchPlan | None = None
        self.change: dict[str, Any] | None = None
        self.progress: dict[str, Any] = {"step": 0, "cursor": 0, "epoch": 0, "step_time_s": 0.0, "gen": 0}
        self.changes: list[dict[str, Any]] = []
        self.plans: dict[int, dict[str, Any]] = {}  # every published plan, by target generation
        self.last_gen = 0
        self.finished = False
        self.suspended: dict[str, Any] | None = None  # where a suspended job's checkpoint is (step, cursor, path)
        self.spawned = 0
        # answers to accepted scaling requests by request id: a client retrying a
        # request whose answer was lost (e.g. the master died) gets the same answer
        # instead of a second change (Elan §V-D); persisted with the snapshot
        self.answers: dict[str, dict[str, Any]] = {}
        self.started_at = time.time()
        if resume and backend is not None:
            snap = backend.load()
            if snap:
                self._restore(snap)

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any], **kw: Any) -> "JobMaster":
        """A master that continues from another's snapshot (restart or handover)."""
        m = cls(snap["job"], snap["initial_workers"], **kw)
        m._restore(snap)
        return m

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "job": self.job,
                "initial_workers": self.initial_workers,
                "workers": self.workers,
                "queue": self.queue,
                "gen": self.gen.to_json() if self.gen else None,
                "plan": self.plan.to_json() if self.plan else None,
                "change": self.change,
                "progress": self.progress,
                "changes": self.changes,
                "plans": {str(k): v for k, v in list(self.plans.items())[-16:]},
                "finished": self.finished,
                "suspended": self.suspended,
                "spawned": self.spawned,
                "last_gen": self.last_gen,
                "shards": self.shards.snapshot() if self.shards else None,
                "answers": dict(list(self.answers.items())[-64:]),
                "stragglers": self.stragglers[-64:],
                "hung": self.hung[-64:],
            }

    def restore(self, snap: dict[str, Any]) -> None:
        """Adopt a snapshot (from a handover or a saved state) and persist it."""
        with self._lock:
            self._restore(snap)
            self._save()

    def _restore(self, s: dict[str, Any]) -> None:
        self.initial_workers = s["initial_workers"]
        self.workers = s["workers"]
        self.queue = s["queue"]
        self.gen = Generation.from_json(s["gen"]) if s.get("gen") else None
        self.plan = SwitchPlan.from_json(s["plan"]) if s.get("plan") else None
        self.change = s.get("change")
        self.progress = s["progress"]
        self.changes = s["changes"]
        self.plans = {int(k): v for k, v in s.get("plans", {}).items()}
        self.finished = s["finished"]
        self.suspended = s.get("suspended")
        self.spawned = s.get("spawned", 0)
        self.last_gen = int(s.get("last_gen", 0))
        self.answers = dict(s.get("answers") or {})
        self.stragglers = list(s.get("stragglers") or [])
        self.hung = list(s.get("hung") or [])
        if s.get("shards"):
            self.shards = ShardManager.from_snapshot(s["shards"])
        if self.plan is not None:  # a pending switch now rendezvouses on this master's store
            t = self.plan.target
            self.plan = dataclasses.replace(
                self.plan, target=dataclasses.replace(t, store_host=self.store_host, store_port=self.store_port))
            self.plans[t.gen] = self.plan.to_json()
            self.store.set(self.plan_key, json.dumps(self.plan.to_json()))
        if self.gen is not None:  # a member that had not seen its go yet finds it on this store
            self.gen = dataclasses.replace(self.gen, store_host=self.store_host, store_port=self.store_port)
            self.store.set(self.gen.prefix + "go", "go")
        log.info("master resumed at gen %s step %s", self.gen and self.gen.gen, self.progress.get("step"))

    def _save(self) -> None:
        if self.backend is not None:
            self.backend.save(self.snapshot())

    # ------------------------------------------------------------------ helpers
    def _new_gen(self, members: list[str], shares: dict[str, float] | None = None) -> Generation:
        """The next generation; a member keeps its batch share (if any) unless
        ``shares`` sets it; all-equal shares collapse to the even split."""
        # generation numbers (and store prefixes) are never reused, even for an abandoned plan
        g = max(self.last_gen, self.gen.gen if self.gen else 0) + 1
        self.last_gen = g
        old = dict(zip(self.gen.members, self.gen.shares)) if self.gen is not None and self.gen.shares else {}
        old.update(shares or {})
        sh = tuple(float(old.get(m, 1.0)) for m in members)
        if all(x == 1.0 for x in sh):
            sh = ()
        return Generation(g, tuple(members), self.store_host, self.store_port, f"tidal/{self.job}/g{g}/", sh)

    def _k(self) -> int:
        st = float(self.progress.get("step_time_s") or 0.0)
        return max(1, math.ceil(self.switch_lead_s / st)) if st > 0 else 1

    def _where(self, worker_id: str) -> Location:
        w = self.workers.get(worker_id) or {}
        return Location(str(w.get("host") or ""), str(w.get("switch") or ""))

    def _publish(self, target: Generation, joiners: list[str], leavers: list[str], kind: str) -> None:
        self._read_progress()
        k = self._k()
        stay = [w for w in target.members if w not in joiners]
        src = assign_sources(stay, joiners, {w: self._where(w) for w in target.members}, self.replication) if joiners else {}
        self.plan = SwitchPlan(target, int(self.progress["step"]) + k, k, tuple(joiners), tuple(leavers), kind,
                         tuple(src.items()))
        self.plans[target.gen] = self.plan.to_json()
        self.store.set(self.plan_key, json.dumps(self.plan.to_json()))
        assert self.change is not None
        self.change["status"] = "published"
        self.change["published_at"] = time.time()
        log.info("plan gen %d (%s) switch at step %d (k=%d)", target.gen, kind, self.plan.switch_step, k)

    def _read_progress(self) -> None:
        """Pick up the progress rank 0 wrote to the store."""
        if self.gen is None or not self.store.check([self.progress_key]):
            return
        p = json.loads(self.store.get(self.progress_key))
        if int(p.get("gen", -1)) == self.gen.gen and int(p["step"]) >= int(self.progress.get("step", 0)):
            self.progress.update(step=int(p["step"]), cursor=int(p["cursor"]), epoch=int(p["epoch"]),
                                 gen=int(p["gen"]), step_time_s=float(p["step_time_s"]),
                                 last_step=list(p.get("last_step") or []))

    def _form_initial(self) -> None:
        members = self.queue[: self.initial_workers]
        self.queue = self.queue[self.initial_workers :]
        self.gen = self._new_gen(members)
        for w in members:
            self.workers[w]["state"] = "active"
        self.store.set(self.gen.prefix + "go", "go")
        log.info("formed gen 1 with %s", members)

    def _start_queued_change(self) -> None:
        """Workers that registered on their own while no change was active
        trigger a scale-out for themselves."""
        if self.change is None and self.queue and self.gen is not None and not self.finished:
            joiners, self.queue = list(self.queue), []
            self.change = {"kind": "scale_out", "status": "waiting", "requested_at": time.time(), "expect": joiners, "joiners": joiners}
            self._publish(self._new_gen(list(self.gen.members) + joiners), joiners, [], "scale_out")

    def _check_timeout(self) -> None:
        c = self.change
        if c and c["status"] == "waiting" and time.time() - c["requested_at"] > self.join_timeout_s:
            log.warning("%s abandoned: joiners %s did not register in time", c["kind"], set(c["expect"]) - set(c["joiners"]))
            for w in c["joiners"]:
                if c["kind"] == "migrate":  # a half-done move is not a scale-out: its replacements exit
                    self.workers[w]["state"] = "left"
                else:
                    self.queue.append(w)
            self.change = None
            self._save()

    # ------------------------------------------------------------------ scheduler API
    def _busy(self) -> ScaleAnswer | None:
        self._check_timeout()
        if self.finished:
            return ScaleAnswer("error", "job finished")
        if self.suspended is not None:
            return ScaleAnswer("error", "job suspended")
        if self.gen is None:
            return ScaleAnswer("retry", "job is forming", retry_after_s=0.5)
        if self.change is not None:
            return ScaleAnswer("retry", f"a {self.change['kind']} is in progress", retry_after_s=0.5)
        if self.recovery is not None:
            return ScaleAnswer("retry", "recovering from a failed worker", retry_after_s=0.5)
        return None

    def _replay(self, request_id: str | None) -> ScaleAnswer | None:
        if request_id and request_id in self.answers:
            return ScaleAnswer.from_json(self.answers[request_id])
        return None

    def _remember(self, request_id: str | None, ans: ScaleAnswer) -> ScaleAnswer:
        if request_id and ans.status == "accepted":
            self.answers[request_id] = ans.to_json()
            while len(self.answers) > 64:
                self.answers.pop(next(iter(self.answers)))
            self._save()
        return ans

    def scale_out(self, n: int | None = None, hosts: list[str] | None = None, request_id: str | None = None) -> ScaleAnswer:
        """Add ``n`` workers (or one per host). New workers start and build
        their model while the others keep training (EDL §4.2). A repeated
        ``request_id`` gets the first answer again (idempotent retry)."""
        with self._lock:
            early = self._replay(request_id) or self._busy()
            if early:
                return early
            count = len(hosts) if hosts else int(n or 0)
            if count <= 0:
                return ScaleAnswer("error", "scale_out needs n > 0 or hosts")
            assert self.gen is not None
            if self.max_workers is not None and self.gen.world_size + count > self.max_workers:
                return ScaleAnswer("error", f"would exceed max workers {self.max_workers}")
            ids = [f"w{self.spawned + i}" for i in range(count)]
            self.spawned += count
            self.change = {"kind": "scale_out", "status": "waiting", "requested_at": time.time(), "expect": ids, "joiners": []}
            target = self.gen.world_size + count
            self._save()
        return self._spawn_then_answer(ids, hosts, request_id, ScaleAnswer("accepted", f"starting {ids}", size=target))

    def _spawn_then_answer(self, ids: list[str], hosts: list[str] | None, request_id: str | None,
                           ans: ScaleAnswer) -> ScaleAnswer:
        """Start the newcomers of the change just recorded (outside the lock:
        a spawner may be slow); a failed spawn drops the change."""
        if self.spawner is not None:
            try:
                self.spawner(ids, hosts)
            except Exception as e:  # noqa: BLE001
                with self._lock:
                    self.change = None
                    self._save()
                return ScaleAnswer("error", f"spawn failed: {e}")
        with self._lock:
            return self._remember(request_id, ans)

    def _at_ranks(self, ranks: list[int]) -> list[str] | None:
        """The current members at ``ranks`` (rank order), or None if one is out of range."""
        assert self.gen is not None
        members = self.gen.members
        if any(r < 0 or r >= len(members) for r in ranks):
            return None
        return [members[r] for r in sorted(set(ranks))]

    def scale_in(self, n: int | None = None, ranks: list[int] | None = None, request_id: str | None = None) -> ScaleAnswer:
        """Remove ``n`` workers (the highest ranks) or the given ranks; they
        leave after the agreed switch step, the others do not stop. A repeated
        ``request_id`` gets the first answer again (idempotent retry)."""
        with self._lock:
            early = self._replay(request_id) or self._busy()
            if early:
                return early
            assert self.gen is not None
            members = list(self.gen.members)
            if ranks:
                leavers = self._at_ranks(ranks)
                if leavers is None:
                    return ScaleAnswer("error", f"ranks {ranks} out of range for world size {len(members)}")
            else:
                count = int(n or 0)
                if count <= 0:
                    return ScaleAnswer("error", "scale_in needs n > 0 or ranks")
                leavers = members[len(members) - count :]
            stay = [w for w in members if w not in leavers]
            if not stay:
                return ScaleAnswer("error", "cannot remove every worker")
            self.change = {"kind": "scale_in", "status": "waiting", "requested_at": time.time(), "expect": [], "joiners": []}
            for w in leavers:
                self.workers[w]["state"] = "leaving"
            self._publish(self._new_gen(stay), [], leavers, "scale_in")
            self._save()
            return self._remember(request_id, ScaleAnswer("accepted", f"removing {leavers}", size=len(stay)))

    def migrate(self, ranks: list[int], hosts: list[str] | None = None, request_id: str | None = None) -> ScaleAnswer:
        """Move the workers at ``ranks`` (to ``hosts`` if given) as one change
        (EDL §5.2): as many newcomers start and warm up while everyone trains;
        then, at one agreed step, the old ones leave and the new ones join in a
        single group switch, receiving the state from their nearest live
        worker. The size does not change."""
        with self._lock:
            early = self._replay(request_id) or self._busy()
            if early:
                return early
            assert self.gen is not None
            members = list(self.gen.members)
            leavers = self._at_ranks(ranks) if ranks else None
            if leavers is None:
                return ScaleAnswer("error", f"migrate needs ranks in [0, {len(members)}), got {ranks}")
            if hosts is not None and len(hosts) != len(leavers):
                return ScaleAnswer("error", f"{len(leavers)} workers to move but {len(hosts)} hosts")
            if len(leavers) == len(members):
                return ScaleAnswer("error", "cannot move every worker at once: no live worker would hold the state")
            if self.spawner is None:
                return ScaleAnswer("error", "migrate needs a spawner to start the replacements")
            ids = [f"w{self.spawned + i}" for i in range(len(leavers))]
            self.spawned += len(ids)
            self.change = {"kind": "migrate", "status": "waiting", "requested_at": time.time(), "expect": ids,
                           "joiners": [], "leavers": leavers}
            self._save()
        return self._spawn_then_answer(ids, hosts, request_id,
                                       ScaleAnswer("accepted", f"moving {leavers} to {ids}", size=len(members)))

    def reshare(self, shares: dict[str, float], request_id: str | None = None) -> ScaleAnswer:
        """Give workers a different share of the global batch (relative
        weights; 1.0 is an even share) from an agreed step on, e.g. a smaller
        one to a straggler (EDL §5.2). The weighted all-reduce keeps the update
        the fixed-size one; the data stay exactly once per epoch."""
        with self._lock:
            early = self._replay(request_id) or self._busy()
            if early:
                return early
            assert self.gen is not None
            bad = [w for w, x in shares.items() if w not in self.gen.members or not (float(x) > 0)]
            if bad:
                return ScaleAnswer("error", f"shares need current members and positive weights: {bad}")
            self.change = {"kind": "reshare", "status": "waiting", "requested_at": time.time(), "expect": [], "joiners": []}
            self._publish(self._new_gen(list(self.gen.members), {w: float(x) for w, x in shares.items()}), [], [], "reshare")
            self._save()
            return self._remember(request_id, ScaleAnswer("accepted", f"shares {shares}", size=self.gen.world_size))

    def suspend(self, request_id: str | None = None) -> ScaleAnswer:
        """Suspend the whole job (preemption by the scheduler): at an agreed
        step rank 0 writes a checkpoint of exactly the state the next step
        starts from, and every worker leaves. Started again with the same
        checkpoint directory, the job resumes there (docs/runtime.md). Needs
        workers with a checkpoint directory."""
        with self._lock:
            early = self._replay(request_id) or self._busy()
            if early:
                return early
            assert self.gen is not None
            members = list(self.gen.members)
            if not all((self.workers.get(w) or {}).get("checkpoints") for w in members):
                return ScaleAnswer("error", "the job's workers have no checkpoint directory (TIDAL_CHECKPOINT_DIR)")
            self.change = {"kind": "suspend", "status": "waiting", "requested_at": time.time(), "expect": [], "joiners": []}
            for w in members:
                self.workers[w]["state"] = "leaving"
            self._publish(self._new_gen([]), [], members, "suspend")
            self._save()
            return self._remember(request_id, ScaleAnswer("accepted", "suspending", size=0))

    def suspended_at(self, step: int, cursor: int, path: str) -> dict[str, Any]:
        """Rank 0 wrote the suspension checkpoint; the job is suspended."""
        with self._lock:
            if self.suspended is None:
                self.suspended = {"step": int(step), "cursor": int(cursor), "path": str(path), "at": time.time()}
                self.progress.update(step=int(step), cursor=int(cursor))
                if self.plan is not None and self.change is not None:
                    self.changes.append(ChangeRecord(
                        gen=self.plan.target.gen, kind="suspend", from_size=self.gen.world_size if self.gen else 0,
                        to_size=0, switch_step=int(step), requested_at=float(self.change["requested_at"]),
                        switched_at=time.time()).__dict__)
                self.plan, self.change = None, None
                self.store.set(self.plan_key, "")
                log.info("job suspended at step %d (checkpoint %s)", step, path)
                self._save()
            return {"status": "ok"}

    def status(self) -> Status:
        with self._lock:
            self._check_timeout()
            if not self.finished:
                self._read_progress()
            if self.finished:
                state = "finished"
            elif self.suspended is not None:
                state = "suspended"
            elif self.gen is None:
                state = "forming"
            elif self.change is not None:
                state = "changing"
            else:
                state = "running"
            return Status(
                job=self.job,
                state=state,
                gen=self.gen.gen if self.gen else 0,
                world_size=self.gen.world_size if self.gen else 0,
                members=self.gen.members if self.gen else (),
                step=int(self.progress["step"]),
                cursor=int(self.progress["cursor"]),
                epoch=int(self.progress["epoch"]),
                step_time_s=float(self.progress["step_time_s"]),
                changing=self.change is not None,
                pending=None if self.change is None else f"{self.change['kind']}:{self.change['status']}",
                changes=tuple(self.changes),
                master_url=self.url,
                stragglers=tuple(self.stragglers),
                hung=tuple(self.hung),
                last_step=tuple(self.progress.get("last_step") or ()),
            )

    def handover(self, url: str) -> dict[str, Any]:
        """Hand the state to a master at ``url`` (e.g. because this host is
        leaving); afterwards this master redirects every request there."""
        with self._lock:
            snap = self.snapshot()
            self.moved_to = url
            self.store.set(self.plan_key, json.dumps({"moved": url}))  # workers poll this key
            self._save()
            return snap

    # ------------------------------------------------------------------ worker API
    def register(self, worker_id: str, pid: int = 0, host: str = "", switch: str = "",
                 checkpoints: bool = False) -> dict[str, Any]:
        with self._lock:
            w = self.workers.setdefault(worker_id, {"state": "registered", "pid": pid, "host": host, "registered_at": time.time()})
            w.update(pid=pid, host=host, switch=switch, checkpoints=bool(checkpoints))
            in_gen = self.gen is not None and worker_id in self.gen.members
            if not in_gen and worker_id not in self.queue:
                c = self.change
                if c and c["kind"] in ("scale_out", "migrate") and c["status"] == "waiting" and worker_id in c["expect"]:
                    c["joiners"].append(worker_id)
                    # during a recovery the plan waits for the survivors' generation
                    if len(c["joiners"]) == len(c["expect"]) and self.recovery is None:
                        self._publish_waiting()
                else:
                    self.queue.append(worker_id)
                    if self.gen is None and len(self.queue) >= self.initial_workers:
                        self._form_initial()
                    else:
                        self._start_queued_change()
            self._save()
            return self.store_info()

    def store_info(self) -> dict[str, Any]:
        """Where workers rendezvous and exchange per-step progress and plans."""
        return {"status": "ok", "job": self.job, "store_host": self.store_host, "store_port": self.store_port,
                "plan_key": self.plan_key, "progress_key": self.progress_key}

    def assignment(self, worker_id: str, after_gen: int = 0) -> dict[str, Any]:
        with self._lock:
            if self.finished:
                return {"status": "finished"}
            self._check_recovery()
            if after_gen and (self.gen is None or self.gen.gen <= after_gen):
                return {"status": "wait"}  # a survivor waits for the recovery generation
            if after_gen and self.gen is not None and worker_id not in self.gen.members:
                return {"status": "finished"}  # declared dead: do not come back
            if (self.workers.get(worker_id) or {}).get("state") == "left":
                return {"status": "finished"}  # e.g. the replacement of an abandoned migration
            if self.plan is not None and worker_id in self.plan.joiners:
                return {"status": "assigned", "generation": self.plan.target.to_json(), "joining": True,
                        "plan": self.plan.to_json()}
            if self.gen is not None and worker_id in self.gen.members:
                return {"status": "assigned", "generation": self.gen.to_json(), "joining": False}
            return {"status": "wait"}

    def heartbeat(self, p: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self.gen is not None and int(p.get("gen", -1)) == self.gen.gen:
                st = float(p.get("step_time_s") or 0.0)
                self.progress.update(
                    step=int(p["step"]), cursor=int(p["cursor"]), epoch=int(p["epoch"]), gen=int(p["gen"]), step_time_s=st
                )
            self._check_timeout()
            return {
                "plan": self.plan.to_json() if self.plan is not None else None,
                "finished": self.finished,
            }

    def agreed(self, gen: int, switch_step: int) -> dict[str, Any]:
        with self._lock:
            if self.change is not None and self.plan is not None and self.plan.target.gen == gen:
                self.change["status"] = "agreed"
                self.change["agreed_step"] = int(switch_step)
                self._save()
            return {"status": "ok"}

    def switched(self, gen: int, step: int, pause_s: float = 0.0) -> dict[str, Any]:
        with self._lock:
            if self.plan is None or self.plan.target.gen != gen:
                return {"status": "ok"}
            old = self.gen
            plan = self.plan
            self.gen, self.plan = plan.target, None
            self.store.set(self.plan_key, "")
            for w in plan.leavers:
                self.workers[w]["state"] = "left"
                if self.shards:
                    self.shards.release(w)
            for w in plan.joiners:
                self.workers[w]["state"] = "active"
            assert self.change is not None
            rec = ChangeRecord(
                gen=gen,
                kind=plan.kind,
                from_size=old.world_size if old else 0,
                to_size=plan.target.world_size,
                switch_step=int(step),
                requested_at=float(self.change["requested_at"]),
                switched_at=time.time(),
                pause_s=float(pause_s),
                sources=plan.sources,
                shares=plan.target.shares,
            )
            self.changes.append(dict(rec.__dict__, sources=[list(p) for p in rec.sources], shares=list(rec.shares)))
            self.change = None
            self.progress.update(step=int(step), gen=gen)
            log.info("switched to gen %d (%d workers) at step %d, pause %.1f ms", gen, plan.target.world_size, step, 1e3 * pause_s)
            self._start_queued_change()
            self._save()
            return {"status": "ok"}

    def failed(self, worker_id: str, gen: int, step: int) -> dict[str, Any]:
        """A survivor's collective failed in generation ``gen`` (a peer died).
        Survivors that report within ``recovery_window_s`` (or until every
        member not known dead has reported) form the next generation."""
        with self._lock:
            if self.plan is not None and gen == self.plan.target.gen and not self.finished:
                # it failed in the generation being switched to (e.g. a newcomer died while
                # receiving its state): that group was formed, so the switch happened
                self.switched(gen, step)
            if self.gen is None or gen != self.gen.gen or self.finished:
                return {"status": "ok"}
            if self.recovery is None or self.recovery["gen"] != gen:
                self.recovery = {"gen": gen, "reporters": [], "started": time.time(), "step": int(step)}
                log.warning("generation %d failed at step %d (reported by %s)", gen, step, worker_id)
            if worker_id not in self.recovery["reporters"]:
                self.recovery["reporters"].append(worker_id)
            self._check_recovery()
            return {"status": "ok"}

    def _check_recovery(self) -> None:
        r = self.recovery
        if r is None or self.gen is None or r["gen"] != self.gen.gen:
            return
        dead = set(self.spawner.dead()) if self.spawner is not None and hasattr(self.spawner, "dead") else set()
        dead |= self._silent()  # no liveness beat for a while: do not wait for its report
        expected = [w for w in self.gen.members if w not in dead]
        if set(r["reporters"]) < set(expected) and time.time() - r["started"] < self.recovery_window_s:
            return
        old = self.gen
        survivors = [w for w in old.members if w in r["reporters"]]
        if not survivors:
            return
        # a change in flight is not lost: its newcomers (warming up, or waiting
        # for the abandoned plan's go, which is cancelled so they ask again)
        # join the survivors' generation by a new plan right after it formed
        carry: dict[str, Any] | None = None
        if self.change is not None and self.change["kind"] in ("scale_out", "migrate", "suspend"):
            carry = dict(self.change, status="waiting")
        if self.plan is not None:
            self.store.set(self.plan.target.prefix + "go", "cancel")
            self.store.set(self.plan_key, "")
            for w in self.plan.leavers:
                if w in survivors and self.plan.kind not in ("migrate", "suspend"):
                    survivors.remove(w)  # it was leaving anyway
        self.plan = None
        self.change = None
        self.gen = self._new_gen(survivors)
        for w in old.members:
            if w not in survivors:
                self.workers[w]["state"] = "failed"
        self.store.set(self.gen.prefix + "go", "go")
        self.changes.append(ChangeRecord(
            gen=self.gen.gen, kind="recover", from_size=old.world_size, to_size=self.gen.world_size,
            switch_step=int(r["step"]), requested_at=float(r["started"]), switched_at=time.time()).__dict__)
        self.recovery = None
        log.warning("recovered: gen %d with %s", self.gen.gen, survivors)
        if carry is not None and carry["kind"] == "suspend":  # suspend the survivors instead
            self.change = carry
            for w in survivors:
                self.workers[w]["state"] = "leaving"
            self._publish(self._new_gen([]), [], list(survivors), "suspend")
        elif carry is not None:
            carry["leavers"] = [w for w in carry.get("leavers") or [] if w in survivors]
            if carry["kind"] == "migrate" and not carry["leavers"]:
                carry["kind"] = "scale_out"  # the workers to move died: their replacements simply join
            if carry["kind"] == "migrate" and len(carry["leavers"]) >= len(survivors):
                carry["kind"], carry["leavers"] = "scale_out", []  # keep a live worker to send the state
            self.change = carry
            if len(carry["joiners"]) == len(carry["expect"]):
                self._publish_waiting()
        self._save()

    def _publish_waiting(self) -> None:
        """Every newcomer of the waiting scale-out/migration registered: publish its plan."""
        c = self.change
        assert c is not None and self.gen is not None
        leavers = list(c.get("leavers") or [])
        for w in leavers:
            self.workers[w]["state"] = "leaving"
        stay = [m for m in self.gen.members if m not in leavers]
        self._publish(self._new_gen(stay + c["joiners"]), c["joiners"], leavers, c["kind"])

    def straggler(self, worker_id: str, gen: int, step: int, ratio: float, detected_at: float | None = None) -> dict[str, Any]:
        """Rank 0 found ``worker_id`` slower than 1.2x the median compute time
        for 10 consecutive steps (EDL §5.2, DLRover §5.4). Recorded, then the
        policy: ``report`` only; ``remove`` (scale-in); ``replace`` (migrate
        it: a fresh worker takes its place); ``share`` (a smaller share of the
        global batch) — if no change is running and it is not the last worker."""
        with self._lock:
            if any(s["worker_id"] == worker_id and s["gen"] == gen for s in self.stragglers):
                return {"status": "ok"}  # a retried report
            rec: dict[str, Any] = {"worker_id": worker_id, "gen": int(gen), "step": int(step), "ratio": float(ratio),
                                   "detected_at": float(detected_at or time.time()), "reported_at": time.time(),
                                   "action": "reported"}
            self.stragglers.append(rec)
            log.warning("straggler %s in gen %d at step %d (%.2fx the median)", worker_id, gen, step, ratio)
            act = self.straggler_policy != "report" and self.gen is not None and gen == self.gen.gen \
                and worker_id in self.gen.members
            r = self.gen.rank_of(worker_id) if act and self.gen is not None else -1
            if act and self.straggler_policy == "remove":
                ans, done = self.scale_in(ranks=[r]), "removed"
            elif act and self.straggler_policy == "share":  # compute time ~ local batch: divide its share by the slowdown
                cur = self.gen.shares[r] if self.gen is not None and self.gen.shares else 1.0
                ans, done = self.reshare({worker_id: cur / max(float(ratio), 1.0)}), "smaller share"
            if act and self.straggler_policy != "replace":
                rec["action"] = done if ans.accepted else f"not {done}: {ans.message}"
            self._save()
            if not (act and self.straggler_policy == "replace"):
                return {"status": "ok", "action": rec["action"]}
        # replace: migrate() starts a worker through the spawner, which may take a
        # while (an HTTP call to the control plane): not under the master's lock
        ans = self.migrate(ranks=[r])
        with self._lock:
            rec["action"] = "replaced" if ans.accepted else f"not replaced: {ans.message}"
            self._save()
            return {"status": "ok", "action": rec["action"]}

    # ------------------------------------------------------------------ hung workers
    def check_health(self, now: float | None = None) -> list[str]:
        """Find hung members (issue 5, "missed heartbeat") and kill them, so
        that their peers' collective fails at once and the usual recovery
        (a forced scale-in, EDL §4.2) runs instead of waiting for the process
        group timeout. A member is hung if its liveness beat did not change
        for ``hang_timeout_s`` (e.g. a stopped process), or if it has been in
        the compute phase of a step for that long while a peer waits in the
        all-reduce of the same step. Called periodically by the host process
        (``now``: the master's clock, passed in for tests). Returns the
        workers found hung in this call."""
        with self._lock:
            if self.gen is None or self.finished or self.moved_to:
                return []
            now = time.monotonic() if now is None else now
            if self._last_health is not None and now - self._last_health > self.hang_timeout_s / 2:
                # this check itself did not run for a while (the host stalled, the lock was
                # held): what looks like silence may be ours, so start the clocks again
                for rec in self._alive.values():
                    rec["changed"] = rec["since"] = now
            self._last_health = now
            self._refresh_beats(now)
            if self.hang_timeout_s <= 0 or self.recovery is not None:
                return []
            members = list(self.gen.members)
            # a peer waiting in the all-reduce of step t since when (the earliest)
            waiting: dict[int, float] = {}
            for w in members:
                st = self._alive[w]["state"]
                if st is not None and st[1] == "sync":
                    waiting[st[0]] = min(waiting.get(st[0], now), self._alive[w]["since"])
            found: list[tuple[str, str]] = []
            gone = {h["worker_id"] for h in self.hung if h["gen"] == self.gen.gen}  # killed already
            leaving = set(self.plan.leavers) if self.plan is not None else set()
            for w in members:
                rec = self._alive[w]
                if w in gone or w in leaving or rec["raw"] is None:
                    continue  # never beat (e.g. a newcomer still receiving its state): not judged
                if now - rec["changed"] > self.hang_timeout_s:
                    found.append((w, f"no liveness beat for {now - rec['changed']:.1f}s"))
                elif rec["state"] is not None and rec["state"][1] == "compute" and rec["state"][0] in waiting \
                        and now - waiting[rec["state"][0]] > self.hang_timeout_s:
                    found.append((w, f"in compute of step {rec['state'][0]} while a peer waited "
                                     f"{now - waiting[rec['state'][0]]:.1f}s in the all-reduce"))
            if len(found) == len([w for w in members if w not in gone]):
                return []  # everyone silent at once: the master's view is stale (e.g. it just restarted), not a hang
            recs = []
            for w, why in found:
                rec = {"worker_id": w, "gen": self.gen.gen, "reason": why, "detected_at": time.time(), "action": "killing"}
                self.hung.append(rec)
                recs.append(rec)
        # killing may be an HTTP call to the control plane: not under the master's lock
        for rec in recs:
            action = self._kill(rec["worker_id"])
            log.warning("worker %s is hung (%s): %s", rec["worker_id"], rec["reason"], action)
            with self._lock:
                rec["action"] = action
        if recs:
            with self._lock:
                self._save()
        return [r["worker_id"] for r in recs]

    def _refresh_beats(self, now: float) -> None:
        """Read the members' liveness beats; note on the master's clock when
        each last changed (and when its (step, phase) last changed)."""
        assert self.gen is not None
        for w in self.gen.members:
            key = f"tidal/{self.job}/alive/{w}"
            raw = self.store.get(key) if self.store.check([key]) else None
            rec = self._alive.get(w)
            if rec is None:
                rec = self._alive[w] = {"raw": raw, "changed": now, "state": None, "since": now}
            if raw != rec["raw"]:
                rec["raw"], rec["changed"] = raw, now
            if raw is not None:
                beat = json.loads(raw)
                state = (int(beat[1]), str(beat[2]))
                if state != rec["state"]:
                    rec["state"], rec["since"] = state, now

    def _silent(self, quiet_s: float = 3.0) -> set[str]:
        """Members that have beaten before but not in the last ``quiet_s``
        seconds (as last seen by :meth:`check_health`): during a recovery
        the master does not wait for their report."""
        now = time.monotonic()
        return {w for w, r in self._alive.items() if r["raw"] is not None and now - r["changed"] > quiet_s}

    def _kill(self, worker_id: str) -> str:
        """Stop a hung worker for good: through the spawner if it can, else by
        pid when the worker runs on this host."""
        kill = getattr(self.spawner, "kill", None)
        try:
            if kill is not None:
                kill(worker_id)
                return "killed"
            w = self.workers.get(worker_id) or {}
            if w.get("pid") and w.get("host") in (socket.gethostname(), "localhost", "127.0.0.1") \
                    and _is_worker(int(w["pid"]), worker_id):
                os.kill(int(w["pid"]), signal.SIGKILL)
                return "killed"
        except (OSError, RuntimeError) as e:
            return f"kill failed: {e}"
        return "reported (cannot kill it from here)"

    def left(self, worker_id: str) -> dict[str, Any]:
        with self._lock:
            if worker_id in self.workers:
                self.workers[worker_id]["state"] = "left"
            if self.shards:
                self.shards.release(worker_id)
            self._save()
            return {"status": "ok"}

    def done(self, step: int, cursor: int, epoch: int | None = None) -> dict[str, Any]:
        with self._lock:
            if not self.finished:
                self.finished = True
                self.progress.update(step=int(step), cursor=int(cursor))
                if epoch is not None:
                    self.progress["epoch"] = int(epoch)
                if self.plan is not None:  # the job ended before the switch step
                    self.store.set(self.plan.target.prefix + "go", "cancel")
                self.plan, self.change = None, None
                self.store.set(self.plan_key, "")
                log.info("job finished at step %d", step)
                self._save()
            return {"status": "ok"}

    # ------------------------------------------------------------------ shard mode
    def shard_call(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.shards is None:
            return {"status": "error", "message": "shard mode not enabled"}
        if op == "next":
            sh = self.shards.next(body["worker_id"])
            with self._lock:
                self._save()
            return {"status": "ok", "shard": sh.to_json() if sh else None}
        if op == "progress":
            self.shards.progress(int(body["shard_id"]), int(body["offset"]))
        elif op == "complete":
            self.shards.complete(int(body["shard_id"]))
        elif op == "release":
            self.shards.release(body["worker_id"])
        else:
            return {"status": "error", "message": f"unknown shard op {op}"}
        with self._lock:
            self._save()  # shard offsets survive a master restart
        return {"status": "ok"}
