"""The scheduler loop and the GPU coordinator of the live cluster.

Every round (a periodic tick, or sooner when woken by a submission, a finish,
a node joining or leaving) the loop builds a Snapshot from the store, calls
the configured policy — the same code the simulator runs — diffs the plan
against reality and executes the difference as one *wave* (SideCar §III-B):

1. scale-ins first (donors shrink, "reshaping down"): the job master removes
   the workers on the GPUs to give back; they leave after the agreed step;
   only when their processes have exited are the GPUs released;
2. then scale-outs and starts on GPUs that are free: GPUs are taken with a
   conditional update (a GPU never serves two jobs), the job master is asked
   for new workers, agents launch them, newcomers warm up while the others
   keep training (stop-free).

A job master that answers "retry" (a change already in progress, EDL §3.1)
is asked again. Waves are serialised: the next round starts after the last
wave finished, so a plan never races an unfinished one.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field

from sqlalchemy import func, select

from tidal.core.overhead import OverheadModel
from tidal.control.db import GPU, Event, Job, Store, Process
from tidal.control.snapshot import build_snapshot
from tidal.scheduler.api import Policy, get_policy

log = logging.getLogger(__name__)


@dataclass
class Wave:
    drops: dict[str, str] = field(default_factory=dict)
    admits: set[str] = field(default_factory=set)
    shrink: dict[str, list[int]] = field(default_factory=dict)  # job -> gids to give back
    grow: dict[str, list[int]] = field(default_factory=dict)  # job -> gids to add
    start: dict[str, list[int]] = field(default_factory=dict)  # job -> gids
    suspend: dict[str, list[int]] = field(default_factory=dict)  # job -> all its gids (preempted)
    tags: dict[str, dict] = field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.drops or self.admits or self.shrink or self.grow or self.start or self.suspend or self.tags)


class Coordinator:
    def __init__(
        self,
        store: Store,
        policy: str | Policy = "edf",
        *,
        server_url: str = "",
        agent_token: str = "",
        tick_s: float = 2.0,
        overheads: OverheadModel | None = None,
        change_timeout_s: float = 120.0,
    ) -> None:
        self.store = store
        self.policy = get_policy(policy) if isinstance(policy, str) else policy
        self.server_url = server_url
        self.agent_token = agent_token
        self.tick_s = tick_s
        self.overheads = overheads or OverheadModel(mode="stop-free", pause_s=0.5, warmup_s=3.0)
        self.change_timeout_s = change_timeout_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds = 0
        self.decision_latencies: list[float] = []  # submit -> placement decision, seconds
        self._last_account = time.time()

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> "Coordinator":
        self._thread = threading.Thread(target=self._run, name="tidal-coordinator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=10)

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        # the job-master client lives in tidal.runtime, whose import pulls in
        # torch (1-3 s): pay it now, not in the first reshaping
        import tidal.runtime.client  # noqa: F401

        while not self._stop.is_set():
            self._wake.wait(self.tick_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.round()
            except Exception:  # noqa: BLE001 - the loop must survive any bad round
                log.exception("scheduling round failed")

    # -- one round ----------------------------------------------------------------
    def round(self) -> Wave:
        now = time.time()
        self.rounds += 1
        self._account(now)
        self._reap(now)
        with self.store.session() as s:
            snap, gmap, jobs = build_snapshot(s, now, self.overheads)
            snap = self._apply_pins(snap, jobs)
            unsuspendable = {jid for jid, j in jobs.items() if (j.tags or {}).get("_unsuspendable")}
        if not snap.jobs:
            return Wave()
        plan = self.policy.schedule(snap)
        wave = Wave(drops=dict(plan.drop), admits=set(plan.admit), tags=dict(plan.tags))
        current = {v.job_id: {gmap.gid(i) for i in v.gpus} for v in snap.jobs}
        for v in snap.jobs:
            jid = v.job_id
            want = {gmap.gid(i) for i in plan.placement.get(jid, ())} if plan.allocation.get(jid, 0) > 0 else set()
            have = current[jid]
            if not have and want:
                wave.start[jid] = sorted(want)
            elif have and not want:
                if jid in unsuspendable:
                    continue  # its master refused once (no checkpoints): it keeps its GPUs
                wave.suspend[jid] = sorted(have)  # preempted: checkpoint, stop, resume later
            elif have != want:
                if have - want:
                    wave.shrink[jid] = sorted(have - want)
                if want - have:
                    wave.grow[jid] = sorted(want - have)
        self.execute(wave, now)
        return wave

    def _apply_pins(self, snap, jobs):
        """A user's ``tidal scale ID N`` pins the job at N GPUs."""
        from dataclasses import replace

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

    def _account(self, now: float) -> None:
        dt = max(0.0, now - self._last_account)
        self._last_account = now
        with self.store.session() as s:
            held: dict[str, int] = {}
            for g in s.scalars(select(GPU).where(GPU.job_id.is_not(None))):
                held[g.job_id] = held.get(g.job_id, 0) + 1
            for j in s.scalars(select(Job).where(Job.state.in_(("running", "resizing")))):
                n = held.get(j.id, 0)
                j.executed += dt
                j.attained += n * dt
                j.done = float((j.progress or {}).get("step", j.done))

    def _reap(self, now: float) -> None:
        """Finish jobs whose master process exited; free GPUs of exited workers
        of finished or cancelled jobs."""
        with self.store.session() as s:
            jobs = s.scalars(select(Job).where(Job.state.in_(("running", "resizing", "cancelling", "suspending")))).all()
            by_job: dict[str, list[Process]] = {}
            for w in s.scalars(select(Process).where(Process.job_id.in_([j.id for j in jobs]))):
                by_job.setdefault(w.job_id, []).append(w)
            for j in jobs:
                procs = by_job.get(j.id, [])
                master = max((p for p in procs if p.kind == "master"), key=lambda p: p.id, default=None)
                live = [p for p in procs if p.state in ("pending", "running")]
                if j.state == "cancelling":
                    for p in live:
                        p.desired = "stop"
                    if not live:
                        self.store.release_gpus(s, j.id, self.store.job_gpus(s, j.id))
                        j.state, j.end_time = "cancelled", now
                        self.store.log(s, "job.cancelled", j.id)
                    continue
                if j.state == "suspending":
                    if not live:  # every process is gone: the suspension is over (also after a restart)
                        self._suspended(s, j, now)
                    continue
                if j.state in ("running", "resizing") and master is not None:
                    # this incarnation's workers only (after a resume, the old ones are history)
                    self._release_dead_workers(s, j, [p for p in procs if p.id > master.id])
                if master is None or master.state not in ("exited", "failed", "lost"):
                    continue
                workers_live = [p for p in live if p.kind == "worker"]
                ok = master.exit_code == 0 and (j.progress or {}).get("state") == "finished"
                if workers_live and ok:
                    continue  # wait for the last workers to exit
                for p in workers_live:
                    p.desired = "stop"
                if workers_live:
                    continue
                self.store.release_gpus(s, j.id, self.store.job_gpus(s, j.id))
                j.state = "completed" if ok else "failed"
                j.end_time = now
                if not ok:
                    j.exit_info = (f"master lost with node {master.node}" if master.state == "lost"
                                   else f"master exit code {master.exit_code}")
                self.store.log(s, f"job.{j.state}", j.id, exit_code=master.exit_code)

    def _release_dead_workers(self, s, j: Job, procs: list[Process]) -> None:
        """A worker of a running job died (issue 5: the runtime's survivors
        re-form without it, a forced scale-in): its GPU goes back to the pool,
        so the policy can give it to this job again or to another one, unless
        a live process of the job already uses it."""
        busy = {p.gpu for p in procs if p.state in ("pending", "running", "lost")}
        # a lost worker's GPU waits until its node reports the process gone (then it is "failed")
        dead = [p for p in procs if p.kind == "worker" and p.state == "failed" and p.gpu is not None]
        if not dead:
            return
        done = {(e.detail or {}).get("worker") for e in s.scalars(
            select(Event).where(Event.job_id == j.id, Event.kind == "job.worker_lost"))}
        held = set(self.store.job_gpus(s, j.id))
        for p in dead:
            if p.name in done or p.gpu in busy or p.gpu not in held:
                continue  # handled once; or the GPU already runs another process of the job
            self.store.release_gpus(s, j.id, [p.gpu])
            self.store.log(s, "job.worker_lost", j.id, gpu=p.gpu, worker=p.name, state=p.state, exit_code=p.exit_code)

    # -- executing a wave -------------------------------------------------------
    def execute(self, wave: Wave, now: float) -> None:
        with self.store.session() as s:
            for jid, reason in wave.drops.items():
                j = s.get(Job, jid)
                if j and j.state in ("submitted", "pending"):
                    j.state, j.drop_reason, j.end_time = "dropped", reason, now
                    self.store.log(s, "job.dropped", jid, reason=reason)
            for jid in wave.admits:
                j = s.get(Job, jid)
                if j and j.state == "submitted":
                    j.state, j.admitted, j.waiting_since = "pending", True, now
                    self.store.log(s, "job.admitted", jid)
            for jid, tags in wave.tags.items():
                j = s.get(Job, jid)
                if j:
                    j.tags = {**(j.tags or {}), **tags}
        # 0. early initialisation (SideCar §III-C): a job that gets GPUs from a
        #    shrinking donor reserves them and starts its processes now; they
        #    warm up (interpreter, imports) and wait at a gate while the donor
        #    still trains on those GPUs
        donor_gpus = {g for gids in (*wave.shrink.values(), *wave.suspend.values()) for g in gids}
        early = {jid for jid, gids in {**wave.start, **wave.grow}.items() if set(gids) & donor_gpus}
        for jid in early:
            if jid in wave.start:
                self._guard(self._start, jid, wave.start[jid], early=True)
            else:
                self._guard(self._grow_begin, jid, wave.grow[jid], early=True)
        # 1. reshaping down: shrink donors and wait until their GPUs are free
        threads = [threading.Thread(target=self._guard, args=(self._shrink, jid, gids)) for jid, gids in wave.shrink.items()]
        threads += [threading.Thread(target=self._guard, args=(self._suspend, jid, gids))
                    for jid, gids in wave.suspend.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # 2. starts and scale-outs on free GPUs; early ones take their GPUs
        #    and open the gate
        self._start_many({jid: g for jid, g in wave.start.items() if jid not in early})
        for jid in early & set(wave.start):
            self._guard(self._start, jid, wave.start[jid])
        threads = [threading.Thread(target=self._guard, args=(self._grow, jid, gids)) for jid, gids in wave.grow.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # reservations nobody could take (a donor that did not shrink) lapse
        with self.store.session() as s:
            for jid in early:
                gids = wave.start.get(jid) or wave.grow.get(jid) or []
                held = set(self.store.job_gpus(s, jid))
                stale = [g for g in gids if g not in held]
                if stale:
                    self.store.unreserve_gpus(s, jid, stale)
                    j = s.get(Job, jid)
                    starting = j is not None and j.state in ("pending", "submitted")
                    for w in s.scalars(select(Process).where(Process.job_id == jid)):
                        if (w.gated and w.gpu in stale) or (starting and w.state in ("pending", "running")):
                            w.desired = "stop"
                    self.store.log(s, "job.early_init_lapsed", jid, gpus=stale)

    def _guard(self, fn, jid: str, gids: list[int], **kw) -> None:
        try:
            fn(jid, gids, **kw)
        except Exception as e:  # noqa: BLE001
            log.exception("action %s on %s failed", fn.__name__, jid)
            with self.store.session() as s:
                self.store.log(s, "action.failed", jid, action=fn.__name__, error=str(e))

    def _client(self, jid: str):
        from tidal.runtime.client import MasterClient

        deadline = time.time() + 60
        while True:
            with self.store.session() as s:
                j = s.get(Job, jid)
                url = j.master_url if j else ""
                formed = bool(j and (j.progress or {}).get("state") in ("running", "changing"))
            if url and formed:
                return MasterClient(url, timeout_s=10, patience_s=20)
            if time.time() > deadline:
                raise TimeoutError(f"job {jid} master not ready")
            time.sleep(0.1)

    @staticmethod
    def _all_free(s, gids: list[int]) -> bool:
        """GPUs the plan names may still be held by a job the coordinator could
        not shrink or suspend this wave; then the action waits for a later round."""
        held = s.scalars(select(GPU.gid).where(GPU.gid.in_(gids), GPU.job_id.is_not(None))).all()
        if held:
            log.debug("GPUs %s still held; action deferred", list(held))
        return not held

    def _start(self, jid: str, gids: list[int], early: bool = False) -> None:
        """Start a job. ``early``: reserve its GPUs and launch its processes
        (they warm up behind a gate) before the GPUs are free; the later call
        takes the GPUs, which opens the gate."""
        with self.store.session() as s:
            j = s.get(Job, jid)
            if j is None or j.state not in ("pending", "submitted"):
                return
            launched = s.scalar(select(Process.id).where(Process.job_id == jid, Process.kind == "master",
                                                        Process.state.in_(("pending", "running")))) is not None
            if early:
                if launched or not self.store.reserve_gpus(s, jid, gids):
                    return
                self._launch_master(s, j, gids)
                self.store.log(s, "job.prestart", jid, gpus=gids)
                return
            if not self._all_free(s, gids):
                return
            self.store.assign_gpus(s, jid, gids)
            if not launched:
                self._launch_master(s, j, gids)
            j.state = "running"
            if j.start_time is None:
                j.start_time = time.time()
                self.decision_latencies.append(j.start_time - j.submit_time)
            j.target = len(gids)
            self.store.log(s, "job.resume" if (j.tags or {}).get("_suspended") else "job.start", jid, gpus=gids,
                           early_init=launched)

    def _start_many(self, starts: dict[str, list[int]]) -> None:
        """Start many jobs in one transaction (a savepoint each, so one that
        cannot start does not undo the others): a burst of submissions is
        decided in milliseconds per job, not a commit per job."""
        if not starts:
            return
        with self.store.session() as s:
            for jid, gids in starts.items():
                try:
                    with s.begin_nested():
                        j = s.get(Job, jid)
                        if j is None or j.state not in ("pending", "submitted") or not self._all_free(s, gids):
                            continue
                        self.store.assign_gpus(s, jid, gids)
                        self._launch_master(s, j, gids)
                        j.state, j.target = "running", len(gids)
                        if j.start_time is None:
                            j.start_time = time.time()
                            self.decision_latencies.append(j.start_time - j.submit_time)
                        self.store.log(s, "job.resume" if (j.tags or {}).get("_suspended") else "job.start", jid,
                                       gpus=gids, early_init=False)
                except Exception as e:  # noqa: BLE001 - one bad start must not stop the others
                    log.exception("start of %s failed", jid)
                    self.store.log(s, "action.failed", jid, action="start", error=str(e))

    def _launch_master(self, s, j: Job, gids: list[int]) -> None:
        first = s.get(GPU, gids[0])
        sub = j.spec.get("submission", {})
        # worker ids never repeat within a job, also after a suspension (w0.. then wN..)
        names = s.scalars(select(Process.name).where(Process.job_id == j.id, Process.kind == "worker")).all()
        offset = max((int(n[1:]) + 1 for n in names if n[1:].isdigit()), default=0)
        argv = [sys.executable, "-m", "tidal.control.jobproc", "--job", j.id, "--server", self.server_url,
                "--workers", str(len(gids)), "--hosts", ",".join(str(g) for g in gids), "--first-id", str(offset)]
        s.add(Process(job_id=j.id, name="master", kind="master", node=first.node, gpu=None, argv=argv,
                     env={"TIDAL_AGENT_TOKEN": self.agent_token, **sub.get("env", {})},
                     cwd=sub.get("workdir", ""), created=time.time()))

    def _grow_begin(self, jid: str, gids: list[int], early: bool = False) -> None:
        """Ask the master for workers on ``gids`` (reserved, or already held)."""
        c = self._client(jid)
        with self.store.session() as s:
            if early:
                if not self.store.reserve_gpus(s, jid, gids):
                    return
            else:
                if not self._all_free(s, gids):
                    return
                self.store.assign_gpus(s, jid, gids)
            j = s.get(Job, jid)
            j.state = "resizing"
            before = len(self.store.job_gpus(s, jid)) - (0 if early else len(gids))
            j.target = before + len(gids)
            j.tags = {**(j.tags or {}), "_grow": {"gids": gids, "before": before}}
            self.store.log(s, "job.scale_out", jid, add=gids, size_from=before, size_to=j.target, early=early)
        ans = self._retry(lambda: c.scale_out(hosts=[str(g) for g in gids]))
        if ans.status != "accepted":
            with self.store.session() as s:
                if early:
                    self.store.unreserve_gpus(s, jid, gids)
                else:
                    self.store.release_gpus(s, jid, gids)
                j = s.get(Job, jid)
                j.state = "running"
                self.store.log(s, "job.scale_out_failed", jid, answer=ans.message)

    def _grow(self, jid: str, gids: list[int]) -> None:
        with self.store.session() as s:
            j = s.get(Job, jid)
            begun = (j.tags or {}).get("_grow", {}).get("gids") == gids if j else False
        if not begun:
            self._grow_begin(jid, gids)
        else:
            with self.store.session() as s:
                if not self._all_free(s, gids):
                    # the donor did not free them: the early grow lapses (its newcomers are stopped)
                    j = s.get(Job, jid)
                    if j is not None and j.state == "resizing":
                        j.state = "running"
                    if j is not None:
                        j.tags = {k: v for k, v in (j.tags or {}).items() if k != "_grow"}
                    return
                self.store.assign_gpus(s, jid, gids)  # opens the warmed-up newcomers' gate
                self.store.log(s, "job.gate_open", jid, gpus=gids)
        with self.store.session() as s:
            j = s.get(Job, jid)
            if j is None or j.state != "resizing":
                return
            before = (j.tags or {}).get("_grow", {}).get("before", 0)
        c = self._client(jid)
        try:
            c.wait_for(before + len(gids), timeout_s=self.change_timeout_s)
        finally:
            with self.store.session() as s:
                j = s.get(Job, jid)
                if j.state == "resizing":
                    j.state = "running"
                j.rescales += 1
                j.tags = {k: v for k, v in (j.tags or {}).items() if k != "_grow"}

    def _shrink(self, jid: str, gids: list[int]) -> None:
        c = self._client(jid)
        with self.store.session() as s:
            procs = s.scalars(select(Process).where(Process.job_id == jid, Process.kind == "worker",
                                                   Process.gpu.in_(gids), Process.state.in_(("pending", "running")))).all()
            names = {p.name: p.id for p in procs}
            j = s.get(Job, jid)
            j.state = "resizing"
            size_from = len(self.store.job_gpus(s, jid))
            self.store.log(s, "job.scale_in", jid, remove=gids, size_from=size_from, size_to=size_from - len(gids))
        st = c.status()
        ranks = [st.members.index(n) for n in names if n in st.members]
        if ranks:
            ans = self._retry(lambda: c.scale_in(ranks=ranks))
            if ans.status != "accepted":
                raise RuntimeError(f"scale_in refused: {ans.message}")
        # wait until the leaving processes have exited, then free their GPUs
        deadline = time.time() + self.change_timeout_s
        while True:
            with self.store.session() as s:
                left = s.scalars(select(Process).where(Process.id.in_(list(names.values())),
                                                      Process.state.in_(("pending", "running")))).all()
                if not left:
                    self.store.release_gpus(s, jid, gids)
                    j = s.get(Job, jid)
                    j.state = "running" if j.state == "resizing" else j.state
                    j.rescales += 1
                    j.target = size_from - len(gids)
                    return
                if time.time() > deadline:
                    for p in left:
                        p.desired = "stop"  # the agent terminates them
                if time.time() > deadline + self.change_timeout_s:
                    # their node does not answer: the GPUs stay with the job
                    # (never handed out while a process may still use them)
                    j = s.get(Job, jid)
                    if j.state == "resizing":
                        j.state = "running"
                    raise TimeoutError(f"workers {[p.name for p in left]} of {jid} did not exit")
            time.sleep(0.1)

    def _suspend(self, jid: str, gids: list[int]) -> None:
        """Preemption (Tiresias, Gandiva, EDF, ...): the job master checkpoints
        the job at an agreed step and every worker leaves (docs/runtime.md);
        once its processes are gone (:meth:`_reap` sees it) its GPUs are free
        and the job waits (``pending``) with its attained service; a later
        start resumes it from the checkpoint (its workers share the job's
        checkpoint directory). A job whose master refuses (no checkpoint
        directory) is not preempted again."""
        with self.store.session() as s:
            j = s.get(Job, jid)
            if j is None or j.state not in ("running", "resizing"):
                return
            j.state = "suspending"
            self.store.log(s, "job.suspend", jid, gpus=gids)
        try:
            c = self._client(jid)
            ans = self._retry(lambda: c.suspend())
        except Exception as e:  # noqa: BLE001 - e.g. its master is gone: _reap decides what became of the job
            ans = None
            log.warning("suspend of %s failed: %s", jid, e)
        if ans is None or ans.status != "accepted":
            with self.store.session() as s:
                j = s.get(Job, jid)
                if j is not None and j.state == "suspending":
                    j.state = "running"
                    if ans is not None and ans.status == "error":
                        j.tags = {**(j.tags or {}), "_unsuspendable": ans.message}
                    self.store.log(s, "job.suspend_failed", jid, answer=ans.message if ans else "master unreachable")
            return
        deadline = time.time() + self.change_timeout_s
        while True:
            with self.store.session() as s:
                j = s.get(Job, jid)
                if j is None or j.state != "suspending":
                    return  # finished by _reap, or cancelled meanwhile
                live = s.scalars(select(Process).where(Process.job_id == jid, Process.state.in_(("pending", "running")))).all()
                if not live:
                    self._suspended(s, j, time.time())
                    return
                if time.time() > deadline:
                    for p in live:
                        p.desired = "stop"
            time.sleep(0.1)

    def _suspended(self, s, j: Job, now: float) -> None:
        """Every process of a suspending job is gone: free its GPUs; it waits
        to be resumed from its checkpoint."""
        self.store.release_gpus(s, j.id, self.store.job_gpus(s, j.id))
        j.state, j.master_url, j.waiting_since = "pending", "", now
        j.progress = {**(j.progress or {}), "state": "suspended"}
        j.rescales += 1
        j.tags = {**(j.tags or {}), "_suspended": int((j.tags or {}).get("_suspended", 0)) + 1}
        self.store.log(s, "job.suspended", j.id, step=(j.progress or {}).get("step"))

    def _retry(self, call):
        deadline = time.time() + self.change_timeout_s
        while True:
            ans = call()
            if ans.status != "retry" or time.time() > deadline:
                return ans
            time.sleep(max(0.05, ans.retry_after_s))
