"""A job's workers, its current generation and the published plan, on the
job's rendezvous store (a torch ``TCPStore``; generation ``g`` rendezvouses
under the prefix ``tidal/<job>/g<g>/``, EDL §3.1).

Per-step traffic goes through the store (C++), not HTTP: rank 0 writes its
progress under ``tidal/<job>/progress`` and reads the published plan from
``tidal/<job>/plan`` (empty when none); every worker beats under
``tidal/<job>/alive/<worker>``; generation ``g``'s members start once
``<prefix>go`` says ``go`` (``cancel``: the plan was dropped). Before they
build the process group they pass a gate: each adds itself to
``<prefix>arrived`` and the last one sets ``<prefix>state`` to ``commit``,
unless the master set it to ``abort`` first because a member died before it
arrived (one atomic compare-and-set decides, so every member sees the same).
After it formed, ``<prefix>abort`` (the reason) tells its members to leave
their collectives: a member went silent.

:class:`Generations` is not thread-safe: the job master calls it under its lock.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import time
from typing import Any, Sequence

from tidal import settings
from tidal.runtime.change import Change
from tidal.runtime.messages import Generation, SwitchPlan
from tidal.runtime.replication import Location, assign_sources
from tidal.runtime.sealed import Forged, SealedStore, listen_fd, store_key

log = logging.getLogger(__name__)


class Generations:
    """Workers (by id: state, pid, host, switch), the queue of registered
    workers in no generation yet, the current generation, and the plan of
    the next one with its switch step ``t_cur + k``, ``k = ceil(T_a /
    T_step)`` (EDL §4.2); plus the last progress rank 0 reported."""

    def __init__(self, job: str, size: int, *, store_host: str, store_port: int, switch_lead_s: float,
                 replication: str, key: bytes | None = None) -> None:
        import torch.distributed as dist  # heavy import, only where needed

        self.job, self.size = job, int(size)
        self.switch_lead_s = float(switch_lead_s)  # T_a of EDL §4.2
        self.replication = replication  # how newcomers get the state (Elan §IV)
        # bound to the advertised address only, and every value sealed with the job's key (runtime.sealed)
        self._server = dist.TCPStore(store_host, store_port, is_master=True, wait_for_workers=False,
                                     timeout=datetime.timedelta(seconds=60),
                                     master_listen_fd=listen_fd(store_host, store_port))
        self.store = SealedStore(self._server, store_key() if key is None else key)
        self.store_host, self.store_port = store_host, int(self._server.port)
        self.plan_key, self.progress_key = f"tidal/{job}/plan", f"tidal/{job}/progress"
        self.store.set(self.plan_key, "")
        self.workers: dict[str, dict[str, Any]] = {}
        self.queue: list[str] = []
        self.gen: Generation | None = None
        self.last_gen = 0  # generation numbers (and store prefixes) are never reused
        self.plan: SwitchPlan | None = None
        self.plans: dict[int, dict[str, Any]] = {}  # every published plan, by target generation
        self.committed: set[int] = set()  # generations whose members all passed the gate (cache)
        self.aborted: set[int] = set()  # generations the master stopped at the gate
        self.progress: dict[str, Any] = {"step": 0, "cursor": 0, "epoch": 0, "step_time_s": 0.0, "gen": 0}

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> dict[str, Any]:
        return {"workers": self.workers, "queue": self.queue, "gen": self.gen.to_json() if self.gen else None,
                "plan": self.plan.to_json() if self.plan else None, "progress": self.progress,
                "plans": {str(k): v for k, v in list(self.plans.items())[-16:]}, "last_gen": self.last_gen}

    def restore(self, s: dict[str, Any]) -> None:
        """Adopt a snapshot's membership; a pending plan and the current
        generation now rendezvous on this store."""
        self.workers, self.queue, self.progress = s["workers"], s["queue"], s["progress"]
        self.gen = Generation.from_json(s["gen"]) if s.get("gen") else None
        self.plan = SwitchPlan.from_json(s["plan"]) if s.get("plan") else None
        self.plans = {int(k): v for k, v in s.get("plans", {}).items()}
        self.last_gen = int(s.get("last_gen", 0))
        if self.plan is not None:
            t = self.plan.target
            self.plan = dataclasses.replace(self.plan, target=self._here(t))
            self.plans[t.gen] = self.plan.to_json()
            self.store.set(self.plan_key, json.dumps(self.plan.to_json()))
        if self.gen is not None:  # a member that had not seen its go yet finds it on this store
            self.gen = self._here(self.gen)
            self.store.set(self.gen.prefix + "go", "go")
            self.store.set(self.gen.prefix + "state", "commit")

    def _here(self, g: Generation) -> Generation:
        return dataclasses.replace(g, store_host=self.store_host, store_port=self.store_port)

    # ------------------------------------------------------------------ reads
    def store_info(self) -> dict[str, Any]:
        """Where workers rendezvous and exchange per-step progress and plans."""
        return {"status": "ok", "job": self.job, "store_host": self.store_host, "store_port": self.store_port,
                "plan_key": self.plan_key, "progress_key": self.progress_key}

    def assignment(self, worker_id: str, after_gen: int = 0) -> dict[str, Any]:
        """A worker's generation: assigned (joining a plan's target, or a
        member), wait, or finished (declared dead, or told to leave)."""
        if after_gen and (self.gen is None or self.gen.gen <= after_gen):
            return {"status": "wait"}  # a survivor waits for the recovery generation
        if after_gen and self.gen is not None and worker_id not in self.gen.members:
            return {"status": "finished"}  # declared dead: do not come back
        if (self.workers.get(worker_id) or {}).get("state") in ("left", "failed"):
            return {"status": "finished"}  # e.g. the replacement of an abandoned migration, or dropped as lost
        if self.plan is not None and worker_id in self.plan.joiners and self.plan.target.gen not in self.aborted:
            return {"status": "assigned", "generation": self.plan.target.to_json(), "joining": True,
                    "plan": self.plan.to_json()}
        if self.gen is not None and worker_id in self.gen.members and self.gen.gen not in self.aborted:
            return {"status": "assigned", "generation": self.gen.to_json(), "joining": False}
        return {"status": "wait"}  # e.g. its generation was aborted: the master plans again

    def at_ranks(self, ranks: Sequence[int]) -> list[str] | None:
        """The current members at ``ranks`` (rank order), or None if one is out of range."""
        members = self.gen.members if self.gen is not None else ()
        if any(r < 0 or r >= len(members) for r in ranks):
            return None
        return [members[r] for r in sorted(set(ranks))]

    def beats(self, others: Sequence[str] = ()) -> dict[str, bytes | None]:
        """The raw liveness beats (None: never beat) of the current members,
        the queue, the plan's target and ``others``."""
        ws = [*(self.gen.members if self.gen else ()), *self.queue, *(self.plan.target.members if self.plan else ()),
              *others]
        keys = {w: f"tidal/{self.job}/alive/{w}" for w in ws}
        return {w: self.store.peek(k) for w, k in keys.items()}

    # ------------------------------------------------------------------ the gate before a process group
    def is_committed(self, g: Generation) -> bool:
        """Every member of ``g`` passed its gate (its process group is being built or exists)."""
        if g.gen not in self.committed and self.store.peek(g.prefix + "state") == b"commit":
            self.committed.add(g.gen)
        return g.gen in self.committed

    def abort(self, g: Generation) -> bool:
        """Stop ``g`` from forming (a member died before its gate); False if
        every member had passed it already (too late: a normal failure)."""
        try:
            if bytes(self.store.compare_set(g.prefix + "state", "", "abort")) == b"commit":
                self.committed.add(g.gen)
                return False
        except Forged as e:  # a co-tenant wrote the gate's key: this job's word replaces it
            log.warning("%s", e)
            self.store.set(g.prefix + "state", "abort")
        self.aborted.add(g.gen)
        return True

    def abort_formed(self, g: Generation, reason: str) -> None:
        """Abort ``g`` after it formed (a member went silent): its members'
        beat threads read ``<prefix>abort`` and leave their collectives
        (:mod:`tidal.runtime.abortable`), then report the failure as usual."""
        self.store.set(g.prefix + "abort", reason)

    def is_aborted(self, g: Generation) -> bool:
        return g.gen in self.aborted

    def gated(self, plan: SwitchPlan) -> bool:
        """Whether ``plan``'s members build a new process group (and pass the gate)."""
        return self.gen is None or plan.target.members != self.gen.members

    # ------------------------------------------------------------------ progress
    def read_progress(self) -> None:
        """Pick up the progress rank 0 wrote to the store."""
        raw = self.store.peek(self.progress_key) if self.gen is not None else None
        if raw is None:
            return
        p = json.loads(raw)
        if int(p.get("gen", -1)) == self.gen.gen and int(p["step"]) >= int(self.progress.get("step", 0)):
            self.progress.update(step=int(p["step"]), cursor=int(p["cursor"]), epoch=int(p["epoch"]),
                                 gen=int(p["gen"]), step_time_s=float(p["step_time_s"]),
                                 last_step=list(p.get("last_step") or []), goodput=dict(p.get("goodput") or {}))

    def heartbeat(self, p: dict[str, Any]) -> None:
        """Progress rank 0 posted over HTTP (the same as the store's)."""
        if self.gen is not None and int(p.get("gen", -1)) == self.gen.gen:
            self.progress.update(step=int(p["step"]), cursor=int(p["cursor"]), epoch=int(p["epoch"]),
                                 gen=int(p["gen"]), step_time_s=float(p.get("step_time_s") or 0.0),
                                 **({"goodput": dict(p["goodput"])} if p.get("goodput") else {}))

    # ------------------------------------------------------------------ generations and plans
    def mark(self, workers: Sequence[str], state: str) -> None:
        for w in workers:
            self.workers[w]["state"] = state

    def new_gen(self, members: Sequence[str], shares: dict[str, float] | None = None) -> Generation:
        """The next generation; a member keeps its batch share (if any) unless
        ``shares`` sets it; all-equal shares collapse to the even split."""
        g = max(self.last_gen, self.gen.gen if self.gen else 0) + 1  # even after an abandoned plan
        self.last_gen = g
        old = dict(zip(self.gen.members, self.gen.shares)) if self.gen is not None and self.gen.shares else {}
        old.update(shares or {})
        sh = tuple(float(old.get(m, 1.0)) for m in members)
        return Generation(g, tuple(members), self.store_host, self.store_port, f"tidal/{self.job}/g{g}/",
                          () if all(x == 1.0 for x in sh) else sh)

    def form(self, members: Sequence[str]) -> Generation:
        """Make ``members`` the current generation and let them start."""
        self.gen = self.new_gen(members)
        self.store.set(self.gen.prefix + "go", "go")
        return self.gen

    def form_initial(self) -> bool:
        """The first generation, once ``size`` workers registered, less those
        lost before it formed (marked failed)."""
        lost = sum(1 for w in self.workers.values() if w.get("state") == "failed")
        if self.gen is not None or not self.queue or len(self.queue) < self.size - lost:
            return False
        members, self.queue = self.queue[: self.size], self.queue[self.size :]
        self.form(members)
        self.mark(members, "active")
        log.info("formed gen 1 with %s", members)
        return True

    def publish(self, change: Change, shares: dict[str, float] | None = None) -> SwitchPlan:
        """Publish the plan of ``change`` (its leavers leave, its joiners
        join; ``shares``: new batch shares) at step ``t_cur + k``; each
        joiner gets its state from its nearest staying worker (Elan §IV)."""
        assert self.gen is not None
        self.read_progress()
        self.mark(change.leavers, "leaving")
        stay = [w for w in self.gen.members if w not in change.leavers]
        target = self.new_gen(stay + list(change.joiners), shares)
        st = float(self.progress.get("step_time_s") or 0.0)
        k = max(1, math.ceil(self.switch_lead_s / st)) if st > 0 else 1
        src = assign_sources(stay, change.joiners, {w: self._where(w) for w in target.members},
                             self.replication) if change.joiners else {}
        self.plan = SwitchPlan(target, int(self.progress["step"]) + k, k, change.joiners, change.leavers,
                               change.kind.value, tuple(src.items()))
        self.plans[target.gen] = self.plan.to_json()
        self.store.set(self.plan_key, json.dumps(self.plan.to_json()))
        log.info("plan gen %d (%s) switch at step %d (k=%d)", target.gen, change.kind.value, self.plan.switch_step, k)
        return self.plan

    def _where(self, worker_id: str) -> Location:
        w = self.workers.get(worker_id) or {}
        return Location(str(w.get("host") or ""), str(w.get("switch") or ""))

    def cancel_plan(self) -> None:
        """Drop the published plan: its target's members stop waiting for the go."""
        if self.plan is not None:
            self.store.set(self.plan.target.prefix + "go", "cancel")
        self.clear_plan()

    def clear_plan(self) -> None:
        self.plan = None
        self.store.set(self.plan_key, "")

    def switch(self, plan: SwitchPlan, step: int) -> Generation | None:
        """The plan's target generation formed at ``step``; the old one."""
        old, self.gen = self.gen, plan.target
        if old is not None and old.members == plan.target.members:
            self.committed.add(plan.target.gen)  # new shares only: the group stays, no gate
        self.clear_plan()
        self.mark(plan.leavers, "left")
        self.mark(plan.joiners, "active")
        self.progress.update(step=int(step), gen=plan.target.gen)
        return old

    def moved(self, url: str) -> None:
        """Tell the workers (they poll the plan key) that the master moved to ``url``."""
        self.store.set(self.plan_key, json.dumps({"moved": url}))

    def registered(self, worker_id: str, pid: int, host: str, switch: str, checkpoints: bool,
                   checkpoint_local: str = "") -> None:
        w = self.workers.setdefault(worker_id, {"state": "registered", "pid": pid, "host": host,
                                                "registered_at": time.time()})
        w.update(pid=pid, host=host, switch=switch, checkpoints=bool(checkpoints), checkpoint_local=checkpoint_local)

    def checkpoint_conflict(self, worker_id: str, host: str, local: str) -> str | None:
        """Why ``worker_id`` on ``host`` may not join: the job would span
        hosts while some worker checkpoints to a node-local directory (each
        host would keep its own checkpoints; a resume could load a stale
        one). None: no conflict."""
        live = {w: r for w, r in self.workers.items() if w != worker_id and r.get("state") not in ("left", "failed")}
        if not ({str(r.get("host", "")) for r in live.values()} - {host}):
            return None
        where = [f"{w} on {r.get('host')}: {r['checkpoint_local']}" for w, r in live.items() if r.get("checkpoint_local")]
        where += [f"{worker_id} on {host}: {local}"] if local else []
        if not where:
            return None
        return (f"the job would span hosts but its checkpoint directory is node-local ({'; '.join(where)}); "
                f"put ${settings.CHECKPOINT_DIR.name} on storage every host shares (NFS, CephFS, Lustre, ...), "
                f"or set {settings.CHECKPOINT_SHARED.name}=1 if this directory is shared")
