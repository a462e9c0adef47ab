"""The worker side: :func:`init` and :class:`Job`.

A training script adds a few lines (see ``examples/``)::

    job = tidal.runtime.init()
    job.register_state(model, optimizer)            # Elan's RegisterState
    for x, y in job.data(dataset, batch_size=64, epochs=3):   # EDL's elastic_shard_generator
        loss_fn(model(x), y).backward()
        job.step()                                  # weighted all-reduce + optimizer step + boundary

How a change happens without stopping (EDL §4.2, Elan §V-B):

1. The master publishes a plan (target generation, switch step ``t_cur + k``).
2. Rank 0 learns it on its asynchronous heartbeat and contributes two numbers
   (target generation, switch step) to the small control tensor reduced with
   the next step's gradients, so every rank agrees at the same step at no
   extra synchronisation; the effective switch step is ``max(planned, t + 1)``.
3. At that boundary leavers exit; survivors ``destroy_process_group`` and
   ``init_process_group`` at the new size with the generation's store prefix
   (same processes); newcomers, which were blocked on the generation's ``go``
   key, join the rendezvous and receive the full state by broadcast from the
   new rank 0 (always an existing worker).

Strong scaling: each rank multiplies its gradient of the *mean* local loss by
``b_r / B`` before the SUM all-reduce (:mod:`tidal.runtime.reducer`), so the
update equals the fixed-size update for any split of the global batch. A peer
that dies is survived: see :meth:`Job._recover`.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import os
import socket
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from tidal.runtime import checkpoint as ckpt
from tidal.runtime.client import MasterClient
from tidal.runtime.data import ElasticBatchIterator, StepSlice, default_collate
from tidal.runtime.faults import FaultInjector
from tidal.runtime.stragglers import StragglerDetector
from tidal.runtime.messages import Generation, SwitchPlan
from tidal.runtime.scaling import BatchPolicy, make_policy
from tidal.runtime.reducer import GradReducer
from tidal.runtime.state import ElasticState, RescaleHook
from tidal.runtime.transfer import broadcast_state, replicate_state

log = logging.getLogger(__name__)

ENV_MASTER = "TIDAL_MASTER_URL"
ENV_WORKER = "TIDAL_WORKER_ID"
ENV_HOST = "TIDAL_HOST"  # this worker's host name for topology-aware replication (default: the hostname)
ENV_SWITCH = "TIDAL_SWITCH"  # the switch (rack) of that host, if known
ENV_STATE_CAP = "TIDAL_STATE_MAX_MBPS"  # cap on a source's state-transfer egress, MB/s (0: none)
ALIVE_EVERY_S = 0.5  # liveness beats of every rank (hung-worker detection)


def _pctl(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class Job:
    """One worker's handle on the elastic job. Create with :func:`init`."""

    def __init__(
        self,
        master_url: str | None,
        worker_id: str,
        *,
        pg_timeout_s: float = 60.0,
        join_timeout_s: float = 300.0,
        heartbeat_interval_s: float | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        checkpoint_keep: int = 2,
    ) -> None:
        self.worker_id = worker_id
        # periodic checkpoints (consistent recovery when every worker died): see tidal.runtime.checkpoint
        cdir = checkpoint_dir if checkpoint_dir is not None else os.environ.get(ckpt.ENV_DIR) or None
        self.checkpoint_dir: str | None = os.fspath(cdir) if cdir is not None else None
        every = checkpoint_every if checkpoint_every is not None else int(os.environ.get(ckpt.ENV_EVERY, "0") or 0)
        if self.checkpoint_dir is not None and every <= 0:
            every = 100
        self.checkpoint_every = int(every) if self.checkpoint_dir is not None else 0
        self.checkpoint_keep = checkpoint_keep
        self.resumed_from: int | None = None  # step of the checkpoint this job resumed from
        self.checkpoints: list[dict[str, Any]] = []  # what this worker (as rank 0) wrote
        self._ckpt_last = -1
        self.client = MasterClient(master_url) if master_url else None
        self.pg_timeout = datetime.timedelta(seconds=pg_timeout_s)
        self.join_timeout_s = join_timeout_s
        # at most one heartbeat per interval (and per step): plans have T_a = 0.5 s of lead time
        self.heartbeat_interval_s = float(os.environ.get("TIDAL_HEARTBEAT_S", 0.05)) if heartbeat_interval_s is None else heartbeat_interval_s
        self.state: ElasticState | None = None
        self.reducer: GradReducer | None = None
        self.overlap = os.environ.get("TIDAL_OVERLAP", "1") != "0"  # bucketed all-reduce during backward
        self.policy: BatchPolicy = make_policy("strong", 1)
        self.global_batch_size = 1
        self.hooks: list[RescaleHook] = []
        self.gen: Generation | None = None
        # rank -1 until this worker has joined a generation (0 in local mode)
        self.rank, self.world_size = (0 if master_url is None else -1), 1
        self.cursor = 0  # the data state: one integer (global sample position)
        self.step_count = 0
        self.end_cursor: int | None = None
        self.finished = False
        self.left = False
        self.suspended = False  # left because the job was suspended (it resumes from a checkpoint)
        self._started = False
        self._data: ElasticBatchIterator | None = None
        self._slice: StepSlice | None = None
        self._stepped = True
        self._seen_plan: SwitchPlan | None = None  # written by the heartbeat thread
        self._agreed: tuple[SwitchPlan | None, int, int] | None = None  # (plan, gen, switch_step)
        self._report_agreed: tuple[int, int] | None = None
        self._report_switched: dict[str, Any] | None = None
        self._failed = False
        self._step_snapshot: dict[str, Any] | None = None  # user-side state at the start of the step
        self._agreed_lock = threading.Lock()  # _agreed is completed by the heartbeat thread
        self._stores: dict[tuple[str, int, str], Any] = {}
        self._lr_applied = 1.0
        # statistics
        self.step_times: deque[float] = deque(maxlen=200)
        self._last_step_end: float | None = None
        self.step_ends: deque[tuple[int, float, int]] = deque(maxlen=10_000)  # (step, wall time at end, world size)
        self.pauses: list[dict[str, Any]] = []
        self.rtts_ms: deque[float] = deque(maxlen=100_000)
        self.joined_at_step = 0
        self.failures: list[dict[str, Any]] = []  # detected peer failures (wall time, step)
        self.faults = FaultInjector.from_env()  # $TIDAL_FAULTS (tests, users): see tidal.runtime.faults
        self._batch_t0 = 0.0
        self._compute_s = 0.0  # this step's compute time (batch start to job.step())
        self.stragglers = StragglerDetector()  # rank 0: per-rank compute times (EDL §5.2)
        self._straggler_gen = 0
        self._report_stragglers: list[dict[str, Any]] = []
        self.straggler_reports: list[dict[str, Any]] = []  # what this worker (as rank 0) reported
        # heartbeat thread
        self._hb_event = threading.Event()
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._store_addr: tuple[str, int] = ("", 0)
        # what the training thread is doing, for the master's hung-worker check:
        # ("compute" | "sync" | "idle", step); beaten by the heartbeat thread
        self._phase: tuple[str, int] = ("idle", 0)
        self._beats = 0
        self._last_beat = 0.0
        self._beat_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ user API
    def register_state(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        extras: dict[str, Any] | None = None,
    ) -> ElasticState:
        """Register what must survive a rescale (Elan's RegisterState)."""
        self.state = ElasticState(model, optimizer, scheduler, extras)
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        return self.state

    def register_hook(self, hook: RescaleHook) -> None:
        """``hook(old_world, new_world)`` after each rescale (Elan's RegisterHook)."""
        self.hooks.append(hook)

    def data(
        self,
        dataset: Any,
        batch_size: int,
        epochs: int = 1,
        seed: int = 0,
        scaling: str | BatchPolicy = "strong",
        collate_fn: Callable[[Sequence[Any]], Any] = default_collate,
        **scaling_kw: Any,
    ) -> ElasticBatchIterator:
        """Elastic batch iterator over a map-style dataset (exactly once per
        epoch). ``batch_size`` is the global batch for strong/hybrid scaling,
        the local batch for weak scaling."""
        self.policy = scaling if isinstance(scaling, BatchPolicy) else make_policy(scaling, batch_size, **scaling_kw)
        self.global_batch_size = self.policy.batch
        return ElasticBatchIterator(self, dataset, epochs, seed, collate_fn)

    @property
    def shares(self) -> tuple[float, ...]:
        """Relative batch shares of the ranks (empty: even split)."""
        return self.gen.shares if self.gen is not None else ()

    @property
    def step_time_s(self) -> float:
        return _pctl(list(self.step_times), 0.5)

    @property
    def epoch(self) -> int:
        if self._slice is not None:
            return self._slice.epoch
        return self.cursor // self._data.n if self._data is not None and self._data.n else 0

    def step(self, optimizer_step: bool = True) -> bool:
        """Mark the batch boundary (EDL's notify_batch_end): all-reduce the
        gradients weighted by local batch size, step the optimizer and advance
        the data cursor; a planned switch follows at the next batch.

        Returns False if the step was dropped because a peer died during the
        all-reduce: nothing was applied, and the survivors re-form at the next
        batch, continuing from the most advanced survivor's state."""
        if self._slice is None:
            raise RuntimeError("job.step() called outside of a batch of job.data(...)")
        if self.state is None:
            raise RuntimeError("call job.register_state(model, optimizer) first")
        sl = self._slice
        if self.faults:
            self.faults.slowdown(time.perf_counter() - self._batch_t0)
        self._compute_s = time.perf_counter() - self._batch_t0
        self._phase = ("sync", self.step_count)
        try:
            self._allreduce(sl)
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError/DistBackendError subclasses
            if self.client is None:
                raise
            self.failures.append({"detected_at": time.time(), "step": self.step_count, "gen": self.gen.gen if self.gen else 0})
            log.warning("worker %s: all-reduce failed at step %d (%s); recovering", self.worker_id, self.step_count, e)
            self._failed = True
            self._slice, self._stepped = None, True
            if self.reducer is not None:
                self.reducer.abort()
            try:  # close the broken group's sockets now: peers blocked on us fail fast too
                dist.destroy_process_group()
            except Exception as e2:  # noqa: BLE001
                log.debug("destroy after failure: %s", e2)
            if self.state.optimizer is not None:
                self.state.optimizer.zero_grad()
            with self._agreed_lock:
                self._agreed = None
            return False
        opt = self.state.optimizer
        if optimizer_step and opt is not None:
            self._apply_lr()
            opt.step()
            opt.zero_grad()
        self.cursor = sl.epoch * self._data.n + sl.stop if self._data else self.cursor + sl.global_size
        self.step_count += 1
        self._slice = None
        self._stepped = True
        now = time.perf_counter()
        if self._last_step_end is not None:
            self.step_times.append(now - self._last_step_end)
        self._last_step_end = now
        self.step_ends.append((self.step_count, time.time(), self.world_size))
        self._phase = ("idle", self.step_count)
        self._hb_event.set()
        return True

    def close(self) -> None:
        """Stop the heartbeat and leave the process group (idempotent)."""
        self._hb_stop.set()
        self._hb_event.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
            self._hb_thread = None
        if self._beat_thread is not None:
            self._beat_thread.join(timeout=5)
            self._beat_thread = None
        if self._report_switched is not None and self.client is not None:
            body, self._report_switched = self._report_switched, None
            self.client.post("/switched", body)
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def summary(self) -> dict[str, Any]:
        return {
            "worker": self.worker_id,
            "steps": self.step_count,
            "cursor": self.cursor,
            "left": self.left,
            "suspended": self.suspended,
            "step_time_s": self.step_time_s,
            "pauses": self.pauses,
            "coord_rtt_ms_p50": _pctl(list(self.rtts_ms), 0.5),
            "coord_rtt_ms_p99": _pctl(list(self.rtts_ms), 0.99),
            "heartbeats": len(self.rtts_ms),
            "failures": self.failures,
            "stragglers": self.straggler_reports,
            "resumed_from": self.resumed_from,
            "checkpoints": self.checkpoints,
        }

    # ------------------------------------------------------------------ iterator hooks
    def _attach_data(self, it: ElasticBatchIterator) -> None:
        self._data = it
        self.end_cursor = it.end_cursor

    def _ready_for_next_batch(self, it: ElasticBatchIterator) -> bool:
        if not self._started:
            self._start()
        if self.finished or self.left:
            return False
        if not self._stepped:
            raise RuntimeError("call job.step() once per batch")
        if self._failed:
            self._recover()
            if self.finished:
                return False
        if self.end_cursor is not None and self.cursor >= self.end_cursor:
            self._finish()
            return False
        # The switch happens here, at the batch boundary after all of the
        # user's per-step code (e.g. scheduler.step()) ran, so the state sent
        # to newcomers is exactly the state the next step starts from.
        if self._agreed is not None and self.step_count >= self._agreed[2]:
            self._switch()
            if self.left:
                return False
            if self._failed:  # the switch's state transfer failed: recover like a failed step
                self._recover()
                if self.finished:
                    return False
        # A periodic checkpoint is taken at the same boundary, for the same reason.
        if self.checkpoint_every and self.rank == 0 and self.step_count % self.checkpoint_every == 0 \
                and self.step_count != self._ckpt_last and self.step_count > 0:
            self._write_checkpoint()
        return True

    # ------------------------------------------------------------------ checkpoints
    def _payload(self) -> dict[str, Any]:
        """Everything the next step starts from (state broadcast and checkpoints)."""
        assert self.state is not None
        return {
            "state": self.state.state_dict(),
            "cursor": self.cursor,
            "step": self.step_count,
            "policy": self.policy.state_dict(),
            "lr_applied": self._lr_applied,
        }

    def _load_payload(self, p: dict[str, Any]) -> None:
        assert self.state is not None
        self.state.load_state_dict(p["state"])
        self.cursor, self.step_count = int(p["cursor"]), int(p["step"])
        self.policy.load_state_dict(p["policy"])
        self.global_batch_size = self.policy.batch
        self._lr_applied = float(p["lr_applied"])

    def _write_checkpoint(self) -> None:
        assert self.checkpoint_dir is not None
        t0 = time.perf_counter()
        payload = dict(self._payload(), world_size=self.world_size, worker=self.worker_id, wall=time.time())
        path = ckpt.save_checkpoint(self.checkpoint_dir, self.step_count, payload, keep=self.checkpoint_keep)
        self._ckpt_last = self.step_count
        self.checkpoints.append({"step": self.step_count, "cursor": self.cursor, "path": str(path),
                                 "write_s": time.perf_counter() - t0})
        self._last_step_end = None  # do not count the write in step-time statistics
        log.info("worker %s: checkpoint of step %d written to %s", self.worker_id, self.step_count, path)

    def _resume_from_checkpoint(self) -> None:
        """A (re)started job: continue from the newest checkpoint, if any."""
        if self.checkpoint_dir is None:
            return
        p = ckpt.load_latest(self.checkpoint_dir)
        if p is None:
            return
        self._load_payload(p)
        self.resumed_from = self._ckpt_last = self.step_count
        log.warning("worker %s: resumed from the checkpoint of step %d (cursor %d)", self.worker_id, self.step_count,
                    self.cursor)

    def _begin_batch(self, sl: StepSlice) -> None:
        self._slice = sl
        self._stepped = False
        assert self.state is not None
        if self.faults:
            self.faults.before_step(self.worker_id, self.rank, self.step_count)
        self._batch_t0 = time.perf_counter()
        self._phase = ("compute", self.step_count)
        if self.reducer is None:
            self.reducer = GradReducer(list(self.state.model.parameters()), overlap=self.overlap)
        weight = sl.local_size / sl.global_size if sl.global_size else 0.0
        self.reducer.begin(weight, dist.is_initialized() and self.world_size > 1)
        if self.client is not None:  # what user code may change after a dropped step (scheduler, extras, RNG)
            st = self.state
            self._step_snapshot = {
                "scheduler": copy.deepcopy(st.scheduler.state_dict()) if st.scheduler is not None else None,
                "extras": copy.deepcopy(st.extras),
                "rng": torch.get_rng_state(),
                # a scheduler stepped after a dropped step also wrote the LR into the
                # param groups; restoring the scheduler alone would not undo that
                "groups": [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in st.optimizer.param_groups]
                if st.optimizer is not None else None,
            }

    # ------------------------------------------------------------------ group management
    def _store(self, host: str, port: int, tag: str = "") -> Any:
        """A cached store client; the heartbeat thread uses its own (tag "hb")."""
        key = (host, port, tag)
        s = self._stores.get(key)
        if s is not None and tag != "hb":  # rare use (rendezvous): check the connection survived a master restart
            try:
                s.check(["tidal/ping"])
            except Exception as e:  # noqa: BLE001
                log.warning("store %s:%d lost (%s); reconnecting", host, port, e)
                s = None
        if s is None:
            s = self._stores[key] = dist.TCPStore(host, port, is_master=False, timeout=self.pg_timeout)
        return s

    def _init_group(self, g: Generation) -> None:
        store = dist.PrefixStore(g.prefix, self._store(g.store_host, g.store_port))
        dist.init_process_group("gloo", store=store, rank=g.rank_of(self.worker_id), world_size=g.world_size, timeout=self.pg_timeout)
        self.gen, self.rank, self.world_size = g, g.rank_of(self.worker_id), g.world_size

    def _sync_state(self, src: int = 0, sources: dict[int, int] | None = None) -> None:
        """Give newcomers the full state: point to point from the sources the
        master chose (destination rank -> source rank, Elan §IV), all at once,
        or else by broadcast from ``src`` (the new rank 0, an existing worker;
        after a failure, the most advanced survivor)."""
        assert self.state is not None
        if sources:
            cap = float(os.environ.get(ENV_STATE_CAP, 0) or 0) * 1e6  # per-source egress cap, MB/s
            if self.rank in sources:
                self._load_payload(replicate_state(None, sources))
            elif self.rank in sources.values():
                replicate_state(self._payload(), sources, max_bytes_per_s=cap)
            return
        payload: list[dict[str, Any] | None] = [None]
        if self.rank == src:
            payload = [self._payload()]
        payload = [broadcast_state(payload[0], src=src)]
        if self.rank != src:
            p = payload[0]
            assert p is not None
            self._load_payload(p)

    def _start(self) -> None:
        """Join the job: wait for a generation, rendezvous, receive state."""
        self._started = True
        if self.state is None:
            raise RuntimeError("call job.register_state(model, optimizer) before iterating")
        if self.client is None:  # local mode: a single process, no master
            self._resume_from_checkpoint()
            self.global_batch_size = self.policy.start(1)
            return
        # Register only now, when model and data pipeline are built: a newcomer
        # is "ready" and the others have not waited for its imports (EDL §4.2).
        info = self.client.post("/register", {"worker_id": self.worker_id, "pid": os.getpid(),
                                              "host": os.environ.get(ENV_HOST) or os.environ.get("TIDAL_NODE")
                                              or socket.gethostname(),
                                              "switch": os.environ.get(ENV_SWITCH, ""),
                                              "checkpoints": self.checkpoint_dir is not None})
        self._store_addr = (info["store_host"], int(info["store_port"]))
        self._keys = {"plan": info["plan_key"], "progress": info["progress_key"], "job": info["job"]}
        log.debug("worker %s registered (ready)", self.worker_id)
        self._phase = ("join", 0)
        self._beat_thread = threading.Thread(target=self._beat_loop, name="tidal-beat", daemon=True)
        self._beat_thread.start()
        deadline = time.monotonic() + self.join_timeout_s
        while True:  # until a generation says go; a cancelled plan is re-planned after a recovery
            a = self._await_assignment(deadline)
            if a is None:
                self.finished = True
                return
            g = Generation.from_json(a["generation"])
            log.debug("worker %s assigned to gen %d", self.worker_id, g.gen)
            go = self._await_go(g, deadline)
            if go is None:
                self.finished = True
                return
            if go == b"go":
                break
            log.info("worker %s: gen %d was cancelled; asking again", self.worker_id, g.gen)
        t0 = time.perf_counter()
        log.debug("worker %s: go for gen %d", self.worker_id, g.gen)
        if not a.get("joining"):  # the job's first generation: a restarted job resumes (rank 0's copy is sent)
            self._resume_from_checkpoint()
        self._init_group(g)
        log.debug("worker %s: group formed", self.worker_id)
        joining_plan = SwitchPlan.from_json(a["plan"]) if a.get("joining") and a.get("plan") else None
        self._sync_state(sources=joining_plan.source_ranks() if joining_plan is not None else None)
        if self.resumed_from is not None:
            self._ckpt_last = self.resumed_from
        if a.get("joining"):
            self.joined_at_step = self.step_count
        else:
            self.global_batch_size = self.policy.start(self.world_size)
        self._phase = ("idle", self.step_count)
        log.info("worker %s joined gen %d as rank %d/%d at step %d (%.1f ms)", self.worker_id, g.gen, self.rank, self.world_size, self.step_count, 1e3 * (time.perf_counter() - t0))
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="tidal-heartbeat", daemon=True)
        self._hb_thread.start()

    def _await_assignment(self, deadline: float) -> dict[str, Any] | None:
        """Poll the master until it assigns a generation (None: the job finished)."""
        assert self.client is not None
        while True:
            a = self.client.get("/assignment", worker_id=self.worker_id)
            if a["status"] == "finished":
                return None
            if a["status"] == "assigned":
                return a
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.worker_id} got no generation within {self.join_timeout_s}s")
            time.sleep(0.01)

    def _await_go(self, g: Generation, deadline: float) -> bytes | None:
        """Wait for generation ``g``'s go key: set by the master (gen 1) or the
        old rank 0 at the switch. Polled (a few µs per check), asking the
        master once a second whether the job ended (None) or the plan was
        replaced (``b"cancel"``); survives a master restart (Elan §V-D)."""
        assert self.client is not None
        store = self._store(g.store_host, g.store_port)
        next_ask = time.monotonic() + 1.0
        while True:
            try:
                if store.check([g.prefix + "go"]):
                    return bytes(store.get(g.prefix + "go"))
            except Exception as e:  # noqa: BLE001 - the master (and its store) restarts: reconnect
                log.warning("worker %s: store lost while waiting for gen %d (%s); reconnecting", self.worker_id, g.gen, e)
                self._stores.pop((g.store_host, g.store_port, ""), None)
                time.sleep(0.2)
                try:
                    store = self._store(g.store_host, g.store_port)
                except Exception as e2:  # noqa: BLE001
                    log.debug("store reconnect failed: %s", e2)
            time.sleep(0.002)
            if time.monotonic() > next_ask:
                next_ask = time.monotonic() + 1.0
                if time.monotonic() > deadline:
                    return None
                try:
                    a = self.client.get("/assignment", worker_id=self.worker_id)
                except Exception as e:  # noqa: BLE001 - a master down for longer than the client's patience
                    log.warning("worker %s: master unreachable while waiting (%s)", self.worker_id, e)
                    continue
                if a["status"] == "finished":
                    return None
                if a["status"] == "assigned" and int(a["generation"]["gen"]) != g.gen:
                    return b"cancel"  # re-planned meanwhile

    def _switch(self) -> None:
        assert self._agreed is not None and self.client is not None
        t0 = time.perf_counter()
        wall0 = time.time()
        with self._agreed_lock:
            plan, gen, switch_step = self._agreed
            self._agreed = None
        if plan is None:  # rank 0 holds the plan; the others prefetched it, or fetch it now
            plan = SwitchPlan.from_json(self.client.get("/plan", gen=gen)["plan"])
        old_world = self.world_size
        if plan.kind == "suspend":  # the whole job stops here and resumes from this checkpoint later
            if self.rank == 0:
                self._write_checkpoint()
                self.client.post("/suspended", {"step": self.step_count, "cursor": self.cursor,
                                                "path": self.checkpoints[-1]["path"]})
            self.suspended = True
        if self.worker_id in plan.leavers:
            dist.destroy_process_group()
            self.left = True
            self.client.post("/left", {"worker_id": self.worker_id})
            self.close()
            log.info("worker %s left at step %d", self.worker_id, self.step_count)
            return
        g = plan.target
        if self.gen is not None and g.members == self.gen.members:
            # same group, new batch shares (a reshare): no new process group needed
            self.gen = g
            t1 = t2 = time.perf_counter()
        else:
            if g.rank_of(self.worker_id) == 0:
                self._store(g.store_host, g.store_port).set(g.prefix + "go", "go")
            dist.destroy_process_group()
            t1 = time.perf_counter()
            self._init_group(g)
            t2 = time.perf_counter()
        self.global_batch_size = self.policy.rescale(self.step_count, old_world, self.world_size)
        if plan.joiners:
            try:
                self._sync_state(sources=plan.source_ranks() or None)
            except Exception as e:  # noqa: BLE001 - a newcomer (or source) died during the transfer
                log.warning("worker %s: state transfer of gen %d failed (%s); recovering", self.worker_id, g.gen, e)
                self.failures.append({"detected_at": time.time(), "step": self.step_count, "gen": g.gen})
                self._step_snapshot = None  # the last step was applied in full: nothing to undo
                self._failed = True
                try:
                    dist.destroy_process_group()
                except Exception as e2:  # noqa: BLE001
                    log.debug("destroy after failed transfer: %s", e2)
                return
        t3 = time.perf_counter()
        for h in self.hooks:
            h(old_world, self.world_size)
        pause = time.perf_counter() - t0
        self.pauses.append({"gen": g.gen, "step": self.step_count, "from": old_world, "to": self.world_size,
                            "pause_s": pause, "wall_start": wall0, "destroy_s": t1 - t0, "rendezvous_s": t2 - t1,
                            "state_sync_s": t3 - t2})
        self._last_step_end = None  # do not count the switch in step-time statistics
        if self.rank == 0:  # reported by the background thread, off the critical path
            self._report_switched = {"gen": g.gen, "step": self.step_count, "pause_s": pause}
            self._hb_event.set()
        log.info("worker %s switched to gen %d rank %d/%d at step %d in %.1f ms", self.worker_id, g.gen, self.rank, self.world_size, self.step_count, 1e3 * pause)

    def _recover(self) -> None:
        """A peer died during the all-reduce (EDL/Elan failure handling): leave
        the broken group, report to the master, join the generation of the
        survivors it forms, and continue from the most advanced survivor's
        state (a survivor may have completed the failed step)."""
        assert self.client is not None and self.state is not None and self.gen is not None
        t0, wall0 = time.perf_counter(), time.time()
        snap, st = self._step_snapshot, self.state
        if snap is not None:  # undo user-side effects of the dropped step
            if st.scheduler is not None and snap["scheduler"] is not None:
                st.scheduler.load_state_dict(snap["scheduler"])
            st.extras.clear()
            st.extras.update(snap["extras"])
            torch.set_rng_state(snap["rng"])
            if st.optimizer is not None and snap.get("groups") is not None:
                for g, saved in zip(st.optimizer.param_groups, snap["groups"]):
                    g.update(saved)
        failed_gen, old_world = self.gen.gen, self.world_size
        if dist.is_initialized():
            dist.destroy_process_group()
        self.client.post("/failed", {"worker_id": self.worker_id, "gen": failed_gen, "step": self.step_count})
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            a = self.client.get("/assignment", worker_id=self.worker_id, after_gen=failed_gen)
            if a["status"] == "finished":
                self.finished = True
                self.close()
                return
            if a["status"] == "assigned":
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.worker_id}: no recovery generation within {self.join_timeout_s}s")
            time.sleep(0.01)
        g = Generation.from_json(a["generation"])
        self._init_group(g)
        mine = torch.tensor([float(self.step_count)], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        best = int(mine.item())
        cand = torch.tensor([float(self.rank if self.step_count == best else self.world_size)], dtype=torch.float64)
        dist.all_reduce(cand, op=dist.ReduceOp.MIN)
        self._sync_state(src=int(cand.item()))
        self.global_batch_size = self.policy.rescale(self.step_count, old_world, self.world_size)
        self._failed = False
        for h in self.hooks:
            h(old_world, self.world_size)
        pause = time.perf_counter() - t0
        self.pauses.append({"gen": g.gen, "step": self.step_count, "from": old_world, "to": self.world_size,
                            "pause_s": pause, "wall_start": wall0, "kind": "recover"})
        self._last_step_end = None
        log.warning("worker %s recovered in gen %d as rank %d/%d at step %d (%.0f ms)", self.worker_id, g.gen,
                    self.rank, self.world_size, self.step_count, 1e3 * pause)

    def _finish(self) -> None:
        self.finished = True
        if self.client is not None and self.rank == 0:
            self.client.post("/done", {"step": self.step_count, "cursor": self.cursor, "epoch": self.epoch})
        self.close()

    # ------------------------------------------------------------------ gradients
    def _allreduce(self, sl: StepSlice) -> None:
        """Finish the weighted gradient all-reduce started by the backward
        hooks; the control pair piggy-backed on it carries the switch
        agreement: rank 0 contributes (target generation, planned switch
        step) of a plan it has seen, the others zeros."""
        assert self.reducer is not None
        ctrl = (0.0, 0.0)
        plan = self._seen_plan
        if self.rank == 0 and plan is not None and self.gen is not None and plan.target.gen > self.gen.gen and self._agreed is None:
            ctrl = (float(plan.target.gen), float(plan.switch_step))
        track = self.client is not None and self.world_size > 1 and dist.is_initialized()
        extra = [0.0] * self.world_size if track else []
        if track:
            extra[self.rank] = self._compute_s
        gen_f, step_f = self.reducer.finish(ctrl, extra)
        if track and self.rank == 0 and self.gen is not None:
            self._check_stragglers(self.reducer.last_extra)
        gen_c, step_c = int(round(gen_f)), int(round(step_f))
        if gen_c > 0 and self._agreed is None:
            switch = max(step_c, self.step_count + 1)  # a pure function of values every rank holds
            with self._agreed_lock:
                self._agreed = (plan if self.rank == 0 else None, gen_c, switch)
            if self.rank == 0:
                self._report_agreed = (gen_c, switch)
            self._hb_event.set()

    def _check_stragglers(self, times: list[float]) -> None:
        """Rank 0: feed the per-rank compute times of this step to the
        detector; new stragglers are reported by the heartbeat thread."""
        assert self.gen is not None
        if self._straggler_gen != self.gen.gen:
            self.stragglers.reset()
            self._straggler_gen = self.gen.gen
        for r, ratio in self.stragglers.update(times):
            log.warning("worker %s: rank %d (%s) is a straggler (%.2fx the median compute time)",
                        self.worker_id, r, self.gen.members[r], ratio)
            rep = {"worker_id": self.gen.members[r], "gen": self.gen.gen, "step": self.step_count, "ratio": ratio,
                   "detected_at": time.time()}
            self._report_stragglers.append(rep)
            self.straggler_reports.append(rep)
            self._hb_event.set()

    def _apply_lr(self) -> None:
        f = self.policy.lr_factor(self.step_count)
        if f != self._lr_applied and self.state is not None and self.state.optimizer is not None:
            for group in self.state.optimizer.param_groups:
                group["lr"] = group["lr"] * f / self._lr_applied
            self._lr_applied = f

    # ------------------------------------------------------------------ heartbeat (off the critical path)
    def _beat_loop(self) -> None:
        """Liveness beats, in their own thread so that nothing else (HTTP
        calls of the heartbeat thread, a long state transfer) delays them."""
        self._beat_alive()  # at once: from now on this worker can be judged
        while not self._hb_stop.wait(ALIVE_EVERY_S):
            self._beat_alive()

    def _beat_alive(self) -> None:
        """Every rank: write (beat count, step, phase) to the master's store,
        where its hung-worker check watches it (issue 5: a missed heartbeat).
        A stopped process stops beating; a training thread stuck in compute
        keeps the same (step, "compute") while its peers wait in "sync"."""
        self._last_beat = time.perf_counter()
        self._beats += 1
        try:
            store = self._store(*self._store_addr, tag="beat")
            store.set(f"tidal/{self._keys['job']}/alive/{self.worker_id}",
                      json.dumps([self._beats, self._phase[1], self._phase[0]]))
        except Exception as e:  # noqa: BLE001 - the master may be restarting
            log.debug("liveness beat failed: %s", e)
            self._stores.pop((*self._store_addr, "beat"), None)

    def _heartbeat_loop(self) -> None:
        """Rank 0 only, in a background thread, at most once per step and per
        ``heartbeat_interval_s``: write progress to and read the published plan
        from the master's TCPStore (two C++ store round trips, GIL released),
        so the training thread never waits for the master."""
        assert self.client is not None
        last = 0.0
        seen_raw = b""
        while not self._hb_stop.is_set():
            self._hb_event.wait(timeout=0.5)
            self._hb_event.clear()
            if self._hb_stop.is_set():
                break
            g = self.gen
            ag = self._agreed
            if ag is not None and ag[0] is None:  # non-zero ranks: fetch the agreed plan before the switch step
                try:
                    plan = SwitchPlan.from_json(self.client.get("/plan", gen=ag[1])["plan"])
                    with self._agreed_lock:
                        if self._agreed is ag:
                            self._agreed = (plan, ag[1], ag[2])
                except Exception as e:  # noqa: BLE001 - _switch fetches it again
                    log.debug("plan prefetch failed: %s", e)
            if self.rank != 0 or g is None:
                continue
            wait = self.heartbeat_interval_s - (time.perf_counter() - last)
            if wait > 0:
                time.sleep(wait)
            try:
                if self._report_switched is not None:
                    body = self._report_switched
                    self.client.post("/switched", body)
                    if self._report_switched is body:  # a newer one may have replaced it meanwhile
                        self._report_switched = None
                while self._report_stragglers:
                    self.client.post("/straggler", self._report_stragglers.pop(0))
                if self._report_agreed is not None:
                    gen, sw = self._report_agreed
                    self._report_agreed = None
                    self.client.post("/agreed", {"gen": gen, "switch_step": sw})
                store = self._store(*self._store_addr, tag="hb")
                ls = self.step_ends[-1] if self.step_ends else None  # (step, wall time at its end, world size)
                progress = json.dumps({
                    "gen": g.gen, "step": self.step_count, "cursor": self.cursor, "epoch": self.epoch,
                    "step_time_s": self.step_time_s, "world_size": self.world_size,
                    "last_step": list(ls) if ls is not None else [],
                })
                t = time.perf_counter()
                store.set(self._keys["progress"], progress)
                raw = store.get(self._keys["plan"])
                last = time.perf_counter()
                self.rtts_ms.append(1e3 * (last - t))
            except Exception as e:  # noqa: BLE001
                # the master (and its store) may be restarting (Elan §V-D): reconnect on the next beat
                log.warning("heartbeat failed: %s", e)
                self._stores.pop((*self._store_addr, "hb"), None)
                time.sleep(0.2)
                continue
            if raw and raw != seen_raw:
                seen_raw = raw
                obj = json.loads(raw)
                if "moved" in obj:  # the master handed over: follow it and use its store
                    self.client.url = str(obj["moved"])
                    info = self.client.get("/store")
                    self._store_addr = (info["store_host"], int(info["store_port"]))
                    self._keys = {"plan": info["plan_key"], "progress": info["progress_key"], "job": info["job"]}
                    seen_raw = b""
                    continue
                plan = SwitchPlan.from_json(obj)
                if plan.target.gen > g.gen:
                    self._seen_plan = plan


def init(master_url: str | None = None, worker_id: str | None = None, **kw: Any) -> Job:
    """Connect this process to its job master (``$TIDAL_MASTER_URL``, set by
    ``tidal run``) and register. Without a master the job runs as a single
    local worker, so the same script also runs with plain ``python``."""
    lvl = os.environ.get("TIDAL_LOG_LEVEL")
    if lvl:
        logging.basicConfig(level=lvl.upper(), format="%(asctime)s %(process)d %(name)s: %(message)s")
    url = master_url or os.environ.get(ENV_MASTER)
    wid = worker_id or os.environ.get(ENV_WORKER) or f"local-{os.getpid()}"
    return Job(url, wid, **kw)
