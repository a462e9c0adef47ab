"""The worker side: :func:`init` and :class:`Job`.

A training script adds a few lines (see ``examples/``)::

    job = tidal.runtime.init()
    job.register_state(model, optimizer)            # Elan's RegisterState
    for x, y in job.data(dataset, batch_size=64, epochs=3):   # EDL's elastic_shard_generator
        loss_fn(model(x), y).backward()
        job.step()                                  # weighted all-reduce + optimizer step + boundary

How a change happens without stopping (EDL §4.2, Elan §V-B):

1. The master publishes a plan (target generation, switch step ``t_cur + k``).
2. Rank 0 learns it on its asynchronous heartbeat (:mod:`tidal.runtime.
   heartbeat`) and contributes two numbers (target generation, switch step)
   to the small control tensor reduced with the next step's gradients, so
   every rank agrees at the same step at no extra synchronisation; the
   effective switch step is ``max(planned, t + 1)``.
3. At that boundary leavers exit; survivors ``destroy_process_group`` and
   ``init_process_group`` at the new size with the generation's store prefix
   (same processes); newcomers, which were blocked on the generation's ``go``
   key, join the rendezvous and receive the full state by broadcast from the
   new rank 0 (always an existing worker). See :mod:`tidal.runtime.membership`.

Strong scaling: each rank multiplies its gradient of the *mean* local loss by
``b_r / B`` before the SUM all-reduce (:mod:`tidal.runtime.reducer`), so the
update equals the fixed-size update for any split of the global batch. A peer
that dies is survived: see :meth:`Job._recover`.

Threads: :class:`Job` belongs to the training thread, which writes all of its
state. The heartbeat threads read the progress (step, cursor, epoch, step
time, last step end: single attribute reads of values replaced whole or
appended) through :meth:`Job._progress`; everything else they share with the
training thread goes through the locks of :mod:`tidal.runtime.membership`
and :mod:`tidal.runtime.heartbeat`.
"""

from __future__ import annotations

import logging
import operator
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from tidal import settings
from tidal.runtime.checkpoint import Checkpointer
from tidal.runtime.client import MasterClient
from tidal.runtime.data import ElasticBatchIterator, StepSlice, default_collate
from tidal.runtime.faults import FaultInjector
from tidal.runtime.heartbeat import Heartbeat, StoreEndpoint, StragglerWatch
from tidal.runtime.devices import backend_for, params_device
from tidal.runtime.membership import Membership
from tidal.runtime.messages import Generation
from tidal.runtime.reducer import GradReducer
from tidal.runtime.scaling import BatchPolicy, make_policy
from tidal.runtime.state import ElasticState, RescaleHook, StepSnapshot, TrainState

log = logging.getLogger(__name__)


def _pctl(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _view(path: str, doc: str = "") -> property:
    """A read-only attribute of :class:`Job` kept in one of its parts."""
    return property(operator.attrgetter(path), doc=doc)


@dataclass
class BatchLoop:
    """Where the training loop is within ``job.data(...)``."""

    started: bool = False  # joined the job (first iteration)
    data: ElasticBatchIterator | None = None
    end_cursor: int | None = None
    slice: StepSlice | None = None  # the batch being computed
    stepped: bool = True  # job.step() was called for the last batch
    failed: bool = False  # a collective failed: recover at the next boundary
    snapshot: StepSnapshot | None = None  # user-side state at the start of the step
    batch_t0: float = 0.0
    compute_s: float = 0.0  # this step's compute time (batch start to job.step())


@dataclass
class StepTiming:
    """Step-time statistics (switches and checkpoint writes excluded)."""

    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=200))
    last_step_end: float | None = None
    # (step, wall time at its end, world size)
    step_ends: deque[tuple[int, float, int]] = field(default_factory=lambda: deque(maxlen=10_000))

    def record(self, step: int, world_size: int) -> None:
        """Step ``step`` just ended."""
        now = time.perf_counter()
        if self.last_step_end is not None:
            self.step_times.append(now - self.last_step_end)
        self.last_step_end = now
        self.step_ends.append((step, time.time(), world_size))


class StepRunner:
    """The per-step mechanics of one worker: arms the gradient reducer for a
    batch, finishes the weighted all-reduce (whose control tensor carries
    the switch agreement and every rank's compute time), applies the
    optimizer step and advances the cursor. A failed all-reduce drops the
    step (a peer died): recovery follows at the next batch boundary."""

    def __init__(self, worker_id: str, train: TrainState, membership: Membership, heartbeat: Heartbeat) -> None:
        self.worker_id = worker_id
        self.train, self.membership, self.heartbeat = train, membership, heartbeat
        self.with_master = membership.client is not None
        self.reducer: GradReducer | None = None
        self.overlap = settings.OVERLAP.get()  # bucketed all-reduce during backward
        self.faults = FaultInjector.from_env()  # $TIDAL_FAULTS (tests, users): see tidal.runtime.faults
        self.loop = BatchLoop()
        self.timing = StepTiming()
        self.stragglers = StragglerWatch(worker_id)  # rank 0: per-rank compute times (EDL §5.2)

    def drop_reducer(self) -> None:
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None

    def begin(self, sl: StepSlice) -> None:
        """A batch starts: fire due faults, arm the reducer's hooks with this
        rank's weight ``b_r / B`` and snapshot what user code may change."""
        lp, st, seat = self.loop, self.train.elastic, self.membership.seat
        lp.slice, lp.stepped = sl, False
        assert st is not None
        if self.faults:
            self.faults.before_step(self.worker_id, seat.rank, self.train.step)
        lp.batch_t0 = time.perf_counter()
        self.heartbeat.phase = ("compute", self.train.step)
        if self.reducer is None:
            self.reducer = GradReducer(list(st.model.parameters()), overlap=self.overlap)
        weight = sl.local_size / sl.global_size if sl.global_size else 0.0
        self.reducer.begin(weight, dist.is_initialized() and seat.world_size > 1)
        if self.with_master:  # what user code may change after a dropped step
            lp.snapshot = st.step_snapshot()

    def step(self, optimizer_step: bool) -> bool:
        """See :meth:`Job.step`."""
        lp, t = self.loop, self.train
        if lp.slice is None:
            raise RuntimeError("job.step() called outside of a batch of job.data(...)")
        if t.elastic is None:
            raise RuntimeError("call job.register_state(model, optimizer) first")
        sl = lp.slice
        if self.faults:
            self.faults.slowdown(time.perf_counter() - lp.batch_t0)
        lp.compute_s = time.perf_counter() - lp.batch_t0
        self.heartbeat.phase = ("sync", t.step)
        try:
            self._allreduce()
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError/DistBackendError subclasses
            if not self.with_master:
                raise
            self._drop(e)
            return False
        opt = t.elastic.optimizer
        if optimizer_step and opt is not None:
            t.apply_lr()
            opt.step()
            opt.zero_grad()
        t.cursor = sl.epoch * lp.data.n + sl.stop if lp.data else t.cursor + sl.global_size
        t.step += 1
        lp.slice, lp.stepped = None, True
        self.timing.record(t.step, self.membership.seat.world_size)
        self.heartbeat.phase = ("idle", t.step)
        self.heartbeat.wake()
        return True

    def _allreduce(self) -> None:
        """Finish the weighted gradient all-reduce started by the backward
        hooks; the control pair piggy-backed on it carries the switch
        agreement (see :class:`~tidal.runtime.membership.SwitchAgreement`)
        and, with a master, every rank's compute time for rank 0's straggler
        detection."""
        assert self.reducer is not None
        seat, agreement = self.membership.seat, self.membership.agreement
        plan, ctrl = agreement.control(seat)
        track = self.with_master and seat.world_size > 1 and dist.is_initialized()
        extra = [0.0] * seat.world_size if track else []
        if track:
            extra[seat.rank] = self.loop.compute_s
        reduced = self.reducer.finish(ctrl, extra)
        if track and seat.rank == 0 and seat.gen is not None:
            for rep in self.stragglers.check(self.reducer.last_extra, seat.gen, self.train.step):
                self.heartbeat.report_straggler(rep)
        ag = agreement.settle(plan, reduced, self.train.step)
        if ag is not None and seat.rank == 0:
            self.heartbeat.report_agreed(ag.gen, ag.switch_step)
        elif ag is not None:
            self.heartbeat.wake()  # the other ranks prefetch the plan

    def _drop(self, e: Exception) -> None:
        """The all-reduce failed: drop the step, tear the broken group down
        now and recover at the next boundary."""
        assert self.train.elastic is not None
        self.loop.failed = True
        self.loop.slice, self.loop.stepped = None, True
        if self.reducer is not None:
            self.reducer.abort()  # in-flight work would keep the broken group alive
        gen = self.membership.seat.gen
        self.membership.fail(self.train.step, gen.gen if gen else 0,
                             f"all-reduce failed at step {self.train.step} ({e})")
        if self.train.elastic.optimizer is not None:
            self.train.elastic.optimizer.zero_grad()
        self.membership.agreement.clear()


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
        self.client = MasterClient(master_url) if master_url else None
        self.train = TrainState()
        # periodic checkpoints (consistent recovery when every worker died): see tidal.runtime.checkpoint
        self.checkpointer = Checkpointer.configure(checkpoint_dir, checkpoint_every, checkpoint_keep)
        self.membership = Membership(worker_id, self.client, pg_timeout_s, join_timeout_s)
        # at most one heartbeat per interval (and per step): plans have T_a = 0.5 s of lead time
        interval = settings.HEARTBEAT_S.get() if heartbeat_interval_s is None else heartbeat_interval_s
        self.heartbeat = Heartbeat(self.membership, interval, self._progress)
        self.runner = StepRunner(worker_id, self.train, self.membership, self.heartbeat)
        self.finished = self.left = False
        self.suspended = False  # left because the job was suspended (it resumes from a checkpoint)
        self._loop, self._timing = self.runner.loop, self.runner.timing

    # ------------------------------------------------------------------ views
    state = _view("train.elastic", "The registered :class:`ElasticState`.")
    policy = _view("train.policy", "The batch policy (strong, weak or hybrid).")
    global_batch_size = _view("train.global_batch_size")
    cursor = _view("train.cursor", "The data state: the global sample position.")
    step_count = _view("train.step", "Steps applied so far.")
    gen = _view("membership.seat.gen", "The current generation (None before joining).")
    rank = _view("membership.seat.rank", "-1 until joined (0 in local mode).")
    world_size = _view("membership.seat.world_size")
    hooks = _view("membership.hooks", "Rescale hooks (see :meth:`register_hook`).")
    pauses = _view("membership.pauses", "Switches and recoveries: when and how long.")
    failures = _view("membership.failures", "Detected peer failures.")
    joined_at_step = _view("membership.joined_at_step", "The step this worker joined at (0: from the start).")
    checkpoints = _view("checkpointer.written", "What this worker (as rank 0) wrote.")
    resumed_from = _view("checkpointer.resumed_from", "Step of the checkpoint the job resumed from.")
    straggler_reports = _view("runner.stragglers.reports", "Stragglers this worker (as rank 0) reported.")
    reducer = _view("runner.reducer")
    faults = _view("runner.faults", "Injected faults (``$TIDAL_FAULTS``).")

    @property
    def shares(self) -> tuple[float, ...]:
        """Relative batch shares of the ranks (empty: even split)."""
        g = self.gen
        return g.shares if g is not None else ()

    @property
    def step_time_s(self) -> float:
        return _pctl(list(self._timing.step_times), 0.5)

    @property
    def epoch(self) -> int:
        sl, data = self._loop.slice, self._loop.data
        if sl is not None:
            return sl.epoch
        return self.cursor // data.n if data is not None and data.n else 0

    # ------------------------------------------------------------------ user API
    def register_state(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        extras: dict[str, Any] | None = None,
    ) -> ElasticState:
        """Register what must survive a rescale (Elan's RegisterState). The
        model's device picks the collective backend: NCCL for CUDA, gloo on
        the CPU."""
        self.membership.backend = backend_for(params_device(model.parameters()))
        self.train.elastic = ElasticState(model, optimizer, scheduler, extras)
        self.runner.drop_reducer()
        return self.train.elastic

    def register_hook(self, hook: RescaleHook) -> None:
        """``hook(old_world, new_world)`` after each rescale (Elan's RegisterHook)."""
        self.membership.hooks.append(hook)

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
        t = self.train
        t.policy = scaling if isinstance(scaling, BatchPolicy) else make_policy(scaling, batch_size, **scaling_kw)
        t.global_batch_size = t.policy.batch
        return ElasticBatchIterator(self, dataset, epochs, seed, collate_fn)

    def step(self, optimizer_step: bool = True) -> bool:
        """Mark the batch boundary (EDL's notify_batch_end): all-reduce the
        gradients weighted by local batch size, step the optimizer and advance
        the data cursor; a planned switch follows at the next batch.

        Returns False if the step was dropped because a peer died during the
        all-reduce: nothing was applied, and the survivors re-form at the next
        batch, continuing from the most advanced survivor's state."""
        return self.runner.step(optimizer_step)

    def close(self) -> None:
        """Stop the heartbeat and leave the process group (idempotent)."""
        self.heartbeat.stop()
        if self.client is not None:
            self.heartbeat.outbox.flush_switched(self.client)
        self.runner.drop_reducer()
        if dist.is_initialized():
            dist.destroy_process_group()

    def summary(self) -> dict[str, Any]:
        rtts = list(self.heartbeat.rtts_ms)
        return {
            "worker": self.worker_id,
            "steps": self.step_count,
            "cursor": self.cursor,
            "left": self.left,
            "suspended": self.suspended,
            "step_time_s": self.step_time_s,
            "pauses": self.pauses,
            "coord_rtt_ms_p50": _pctl(rtts, 0.5),
            "coord_rtt_ms_p99": _pctl(rtts, 0.99),
            "heartbeats": len(rtts),
            "failures": self.failures,
            "stragglers": self.straggler_reports,
            "resumed_from": self.resumed_from,
            "checkpoints": self.checkpoints,
        }

    # ------------------------------------------------------------------ iterator hooks
    def _attach_data(self, it: ElasticBatchIterator) -> None:
        self._loop.data = it
        self._loop.end_cursor = it.end_cursor

    def _ready_for_next_batch(self, it: ElasticBatchIterator) -> bool:
        lp = self._loop
        if not lp.started:
            self._start()
        if self.finished or self.left:
            return False
        if not lp.stepped:
            raise RuntimeError("call job.step() once per batch")
        if lp.failed and not self._recover():
            return False
        if lp.end_cursor is not None and self.cursor >= lp.end_cursor:
            self._finish()
            return False
        # The switch happens here, at the batch boundary after all of the
        # user's per-step code (e.g. scheduler.step()) ran, so the state sent
        # to newcomers is exactly the state the next step starts from.
        if self.membership.agreement.due(self.step_count):
            self._switch()
            if self.left:
                return False
            if lp.failed and not self._recover():  # the switch's state transfer failed
                return False
        # A periodic checkpoint is taken at the same boundary, for the same reason.
        if self.rank == 0 and self.checkpointer.due(self.step_count):
            self._write_checkpoint()
        return True

    def _begin_batch(self, sl: StepSlice) -> None:
        self.runner.begin(sl)

    # ------------------------------------------------------------------ membership
    def _start(self) -> None:
        """Join the job: wait for a generation, rendezvous, receive state."""
        self._loop.started = True
        t = self.train
        if t.elastic is None:
            raise RuntimeError("call job.register_state(model, optimizer) before iterating")
        if self.client is None:  # local mode: a single process, no master
            self._resume_from_checkpoint()
            t.global_batch_size = t.policy.start(1)
            return
        # Register only now, when model and data pipeline are built: a newcomer
        # is "ready" and the others have not waited for its imports (EDL §4.2).
        info = self.membership.register(checkpoints=self.checkpointer.directory is not None)
        log.debug("worker %s registered (ready)", self.worker_id)
        self.heartbeat.phase = ("join", 0)
        self.heartbeat.start_beats(StoreEndpoint.from_json(info))
        if not self.membership.join(t, self._resume_from_checkpoint):
            self.finished = True
            return
        self.heartbeat.phase = ("idle", t.step)
        self.heartbeat.start()

    def _switch(self) -> None:
        """The agreed switch, at the batch boundary (EDL §4.2)."""
        assert self.client is not None
        t0, wall0 = time.perf_counter(), time.time()
        plan = self.membership.take_plan()
        if plan.kind == "suspend":  # the whole job stops here and resumes from this checkpoint later
            if self.rank == 0:
                self._write_checkpoint()
                self.client.post("/suspended", {"step": self.step_count, "cursor": self.cursor,
                                                "path": self.checkpoints[-1]["path"]})
            self.suspended = True
        if self.worker_id in plan.leavers:
            self.membership.leave()
            self.left = True
            self.close()
            log.info("worker %s left at step %d", self.worker_id, self.step_count)
            return
        pause = self.membership.switch(plan, self.train, t0, wall0)
        if pause is None:  # the state transfer failed; the last step was applied in full: nothing to undo
            self._loop.snapshot = None
            self._loop.failed = True
            return
        self._timing.last_step_end = None  # do not count the switch in step-time statistics
        if self.rank == 0:  # reported by the heartbeat thread, off the critical path
            self.heartbeat.report_switched({"gen": pause["gen"], "step": pause["step"], "pause_s": pause["pause_s"]})
        log.info("worker %s switched to gen %d rank %d/%d at step %d in %.1f ms", self.worker_id, pause["gen"],
                 self.rank, self.world_size, self.step_count, 1e3 * pause["pause_s"])

    def _recover(self) -> bool:
        """A peer died during a collective: undo the user-side effects of the
        dropped step and re-form with the survivors (:meth:`Membership.
        recover`). False: the job finished meanwhile."""
        assert self.train.elastic is not None
        t0, wall0 = time.perf_counter(), time.time()
        if self._loop.snapshot is not None:
            self.train.elastic.restore_step_snapshot(self._loop.snapshot)
        pause = self.membership.recover(self.train, t0, wall0)
        if pause is None:
            self.finished = True
            self.close()
            return False
        self._loop.failed = False
        self._timing.last_step_end = None
        log.warning("worker %s recovered in gen %d as rank %d/%d at step %d (%.0f ms)", self.worker_id, pause["gen"],
                    self.rank, self.world_size, self.step_count, 1e3 * pause["pause_s"])
        return True

    def _finish(self) -> None:
        self.finished = True
        if self.client is not None and self.rank == 0:
            self.client.post("/done", {"step": self.step_count, "cursor": self.cursor, "epoch": self.epoch})
        self.close()

    # ------------------------------------------------------------------ checkpoints and progress
    def _write_checkpoint(self) -> None:
        path = self.checkpointer.write(self.train, world_size=self.world_size, worker=self.worker_id)
        self._timing.last_step_end = None  # do not count the write in step-time statistics
        log.info("worker %s: checkpoint of step %d written to %s", self.worker_id, self.step_count, path)

    def _resume_from_checkpoint(self) -> None:
        """A (re)started job: continue from the newest checkpoint, if any."""
        if self.checkpointer.resume(self.train):
            log.warning("worker %s: resumed from the checkpoint of step %d (cursor %d)", self.worker_id,
                        self.step_count, self.cursor)

    def _progress(self, g: Generation) -> dict[str, Any]:
        """Heartbeat thread: what rank 0 reports (reads of values the training thread replaces whole)."""
        ends = self._timing.step_ends
        ls = ends[-1] if ends else None  # (step, wall time at its end, world size)
        return {"gen": g.gen, "step": self.step_count, "cursor": self.cursor, "epoch": self.epoch,
                "step_time_s": self.step_time_s, "world_size": self.world_size,
                "last_step": list(ls) if ls is not None else []}


def init(master_url: str | None = None, worker_id: str | None = None, **kw: Any) -> Job:
    """Connect this process to its job master (``$TIDAL_MASTER_URL``, set by
    ``tidal run``) and register. Without a master the job runs as a single
    local worker, so the same script also runs with plain ``python``."""
    lvl = settings.LOG_LEVEL.get()
    if lvl:
        logging.basicConfig(level=lvl.upper(), format="%(asctime)s %(process)d %(name)s: %(message)s")
    url = master_url or settings.MASTER_URL.get()
    wid = worker_id or settings.WORKER_ID.get() or f"local-{os.getpid()}"
    return Job(url, wid, **kw)
