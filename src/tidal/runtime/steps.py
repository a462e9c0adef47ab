"""The per-step mechanics of one worker.

A *step* is one optimizer step: the micro-batches from the first batch after
a boundary to the batch boundary after an optimizer over the model stepped
(with no optimizer: after a synced backward). The reducer
(:mod:`tidal.runtime.reducer`) reduces the gradients when backward returns;
its control tensor carries the switch agreement and every rank's compute
time. The step is committed at the next batch boundary, after all of the
user's per-step code ran, so a switch there sends newcomers exactly the state
the next step starts from. A failed all-reduce (a peer died) drops the step:
its gradients are zeroed and the registered optimizers skip it, so an
update the script still makes changes nothing, and recovery follows at the
next boundary. In the first two synced steps of each generation and every
``$TIDAL_CHECK_EVERY`` steps the replicas compare checksums
(:mod:`tidal.runtime.checksum`).

When the batch policy measures the gradient noise scale
(:mod:`tidal.runtime.noise`), each rank adds to the control tail its
weighted squared gradient norm, its weight and samples in the step, its
compute time and the previous step's time; every rank then hands the same
reduced numbers to the policy (``policy.observe``), so a policy that
changes the batch (``goodput``) decides the same on every rank, at a step
boundary (``policy.revise``) or at a switch."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch.distributed as dist

from tidal import settings
from tidal.runtime import checksum
from tidal.runtime.capture import LateOptimizerGuard, complete
from tidal.runtime.data import StepSlice
from tidal.runtime.faults import FaultInjector
from tidal.runtime.goodput import StepSample
from tidal.runtime.heartbeat import Heartbeat, StragglerWatch
from tidal.runtime.membership import Membership
from tidal.runtime.messages import SwitchPlan
from tidal.runtime.noise import RANK_NUMBERS, StepNorms, rank_numbers
from tidal.runtime.reducer import GradReducer
from tidal.runtime.state import StepSnapshot, TrainState

log = logging.getLogger(__name__)


@dataclass
class Window:
    """The step in progress, from its first micro-batch to its boundary."""

    open: bool = False
    slice: StepSlice | None = None  # the micro-batch being computed
    next_cursor: int = 0  # where the next micro-batch starts
    stepped: bool = False  # an optimizer stepped (the step can be committed)
    failed: bool = False  # a collective failed: recover at the next boundary
    snapshot: StepSnapshot | None = None  # user-side state at the start of the step
    t0: float = 0.0
    compute_s: float = 0.0  # start of the step to the end of its synced backward
    weight: float = 0.0  # this rank's reducer weights summed over the step's micro-batches
    samples: int = 0  # this rank's samples in the step


@dataclass
class StepTiming:
    """Step-time statistics (switches and checkpoint writes excluded)."""

    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=200))
    last_step_end: float | None = None
    # (step, wall time at its end, world size)
    step_ends: deque[tuple[int, float, int]] = field(default_factory=lambda: deque(maxlen=10_000))
    # the last step's (duration, world size, global batch); None if it was not timed
    last: tuple[float, int, int] | None = None

    def record(self, step: int, world_size: int, batch: int = 0) -> None:
        """Step ``step`` just ended."""
        now = time.perf_counter()
        self.last = None
        if self.last_step_end is not None:
            self.step_times.append(now - self.last_step_end)
            self.last = (now - self.last_step_end, world_size, batch)
        self.last_step_end = now
        self.step_ends.append((step, time.time(), world_size))


class StepRunner:
    """Arms the reducer for each micro-batch, takes part in the switch
    agreement and the straggler check when a backward pass syncs, and
    commits steps at batch boundaries."""

    def __init__(self, worker_id: str, train: TrainState, membership: Membership, heartbeat: Heartbeat) -> None:
        self.worker_id = worker_id
        self.train, self.membership, self.heartbeat = train, membership, heartbeat
        self.with_master = membership.client is not None
        self.reducer: GradReducer | None = None
        self.guard: LateOptimizerGuard | None = None
        self.overlap = settings.OVERLAP.get()  # bucketed all-reduce during backward
        self.faults = FaultInjector.from_env()  # $TIDAL_FAULTS (tests, users): see tidal.runtime.faults
        self.window = Window()
        self.timing = StepTiming()
        self.stragglers = StragglerWatch(worker_id)  # rank 0: per-rank compute times (EDL §5.2)
        self._plan: SwitchPlan | None = None
        self._track = False
        self.check_every = settings.CHECK_EVERY.get()
        self._checks: tuple[int, int] = (-1, 0)  # (generation, its synced steps whose replicas were compared)

    # ------------------------------------------------------------------ set-up
    def attach(self) -> None:
        """Hooks on the registered model; finds unregistered training objects."""
        st = self.train.elastic
        assert st is not None
        self.detach()
        complete(st)
        self.reducer = GradReducer(list(st.model.parameters()), listener=self, overlap=self.overlap)
        self.guard = LateOptimizerGuard(st, self.optimizer_stepped, dropped=lambda: self.window.failed)

    def detach(self) -> None:
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        if self.guard is not None:
            self.guard.remove()
            self.guard = None

    # ------------------------------------------------------------------ micro-batches
    @property
    def live_cursor(self) -> int:
        """Where the next micro-batch starts."""
        return self.window.next_cursor if self.window.open else self.train.cursor

    def begin(self, sl: StepSlice, next_cursor: int) -> None:
        """A micro-batch starts: open the step if none is open (fire due
        faults, snapshot what user code may change, apply the batch policy's
        LR) and arm the reducer with this rank's weight ``b_r / B``."""
        w, t, seat = self.window, self.train, self.membership.seat
        assert t.elastic is not None and self.reducer is not None
        if not w.open:
            if self.faults:
                self.faults.before_step(self.worker_id, seat.rank, t.step)
            w.open, w.stepped, w.t0 = True, False, time.perf_counter()
            w.snapshot = t.elastic.step_snapshot() if self.with_master else None
            t.apply_lr()
            self.heartbeat.phase = ("compute", t.step)
        w.slice, w.next_cursor = sl, next_cursor
        weight = sl.local_size / sl.global_size if sl.global_size else 0.0
        w.weight, w.samples = w.weight + weight, w.samples + sl.local_size
        self.reducer.measure = t.policy.noise is not None
        self.reducer.arm(weight, dist.is_initialized() and seat.world_size > 1)

    def optimizer_stepped(self) -> None:
        if self.window.open:
            self.window.stepped = True

    # ------------------------------------------------------------------ SyncListener
    def sync_begin(self) -> list[float]:
        """Backward ended: this rank's control numbers (the switch agreement,
        EDL §4.2, and with a master its compute time for rank 0's straggler
        check)."""
        w, seat = self.window, self.membership.seat
        if self.faults:
            self.faults.slowdown(time.perf_counter() - w.t0)
        w.compute_s = time.perf_counter() - w.t0
        self.heartbeat.phase = ("sync", self.train.step)
        self._plan, ctrl = self.membership.agreement.control(seat)
        self._track = self.with_master and seat.world_size > 1 and dist.is_initialized()
        extra = [0.0] * seat.world_size if self._track else []
        if self._track:
            extra[seat.rank] = w.compute_s
        return [ctrl[0], ctrl[1], *extra, *self._noise_numbers()]

    def _noise_numbers(self) -> list[float]:
        """This rank's numbers for the noise scale and the step-time model
        (none unless the policy measures the noise scale): see
        :func:`tidal.runtime.noise.rank_numbers`, then the compute time and
        the previous step's time if it ran at the same world size and batch."""
        if self.reducer is None or not self.reducer.measure:
            return []
        w, last = self.window, self.timing.last
        same = last is not None and last[1:] == (self.membership.seat.world_size, self.train.global_batch_size)
        return [*rank_numbers(self.reducer.local_sq, w.weight, w.samples), w.compute_s,
                last[0] if same and last is not None else 0.0, 1.0 if same else 0.0]

    def _observe(self, tail: list[float]) -> None:
        """Hand the reduced noise-scale numbers and the step's timing (when
        every rank timed it) to the batch policy; equal on every rank."""
        t, n = self.train, self.membership.seat.world_size
        assert self.reducer is not None
        norms = StepNorms.from_tail(tail[:RANK_NUMBERS], self.reducer.reduced_sq)
        scaler = t.elastic.scaler if t.elastic is not None else None
        if scaler is not None and getattr(scaler, "is_enabled", lambda: False)():
            norms = norms.scaled(float(scaler.get_scale()) ** 2)  # the AMP loss scale, in both norms
        c, step_s, timed = tail[RANK_NUMBERS:]
        timing = StepSample(n, t.global_batch_size / n, 1, c / n, step_s / n) if round(timed) == n else None
        t.policy.observe(norms, timing)

    def sync_done(self, reduced: list[float]) -> None:
        seat, agreement, step = self.membership.seat, self.membership.agreement, self.train.step
        measured = self.reducer is not None and self.reducer.measure
        end = len(reduced) - (RANK_NUMBERS + 3 if measured else 0)
        if measured:
            self._observe(reduced[end:])
        if self._track and seat.rank == 0 and seat.gen is not None:
            for rep in self.stragglers.check(reduced[2:end], seat.gen, step):
                self.heartbeat.report_straggler(rep)
        ag = agreement.settle(self._plan, (reduced[0], reduced[1]), step)
        if ag is not None and seat.rank == 0:
            self.heartbeat.report_agreed(ag.gen, ag.switch_step)
        elif ag is not None:
            self.heartbeat.wake_now()  # the other ranks prefetch the plan
        self.heartbeat.phase = ("idle", step)
        st = self.train.elastic
        if self._track and st is not None and self._check_due(step):
            assert seat.gen is not None and self.reducer is not None
            g, n = self._checks
            self._checks = (seat.gen.gen, n + 1 if g == seat.gen.gen else 1)
            checksum.compare(st, step, seat.gen.gen, self.reducer.device)  # raises Diverged on every rank
        if st is not None and not st.optimizers:
            self.window.stepped = True  # no optimizer: a synced backward ends the step

    def _check_due(self, step: int) -> bool:
        """The replicas are compared in the first two synced steps of each
        generation (the state newcomers received, then the first update
        made from it) and every :attr:`check_every` steps: the same steps on
        every rank, as each sees the same generation and step."""
        gen = self.membership.seat.gen
        if self.check_every < 0 or gen is None:
            return False
        g, n = self._checks
        return g != gen.gen or n < 2 or (self.check_every > 0 and step % self.check_every == 0)

    def sync_failed(self, error: Exception) -> None:
        """The all-reduce failed: drop the step, tear the broken group down
        now and recover at the next boundary."""
        if not self.with_master:
            raise error
        self.window.failed = True
        gen = self.membership.seat.gen
        self.membership.fail(self.train.step, gen.gen if gen else 0,
                             f"all-reduce failed at step {self.train.step} ({error})")
        self.membership.agreement.clear()

    # ------------------------------------------------------------------ boundaries
    def commit(self, epoch_end: int | None = None) -> bool:
        """At a batch boundary: commit the open step if an optimizer stepped;
        ``epoch_end``: the epoch is over, move the cursor there (a window
        without an optimizer step is closed too). True if a step ended."""
        w, t = self.window, self.train
        if w.failed:
            return False
        if not w.open:
            if epoch_end is not None:
                t.cursor = max(t.cursor, epoch_end)  # drop_last's remainder, or an epoch left early
            return False
        if not (w.stepped or epoch_end is not None):
            return False
        t.cursor = w.next_cursor if epoch_end is None else max(w.next_cursor, epoch_end)
        if w.stepped:
            t.step += 1
            self.timing.record(t.step, self.membership.seat.world_size, t.global_batch_size)
            self._revise()
        self.close_window()
        self.heartbeat.phase = ("idle", t.step)
        self.heartbeat.wake()
        return w.stepped

    def _revise(self) -> None:
        """After a committed step: the policy may move the global batch
        (``goodput``, on a drift of the noise scale); the same on every rank,
        as its inputs are reduced numbers. The loader splits the new batch
        from the cursor on, so every sample is still used once per epoch."""
        t = self.train
        new = t.policy.revise(t.step, self.membership.seat.world_size)
        if new is not None and new != t.global_batch_size:
            log.info("worker %s: global batch %d -> %d at step %d (%s)", self.worker_id, t.global_batch_size, new,
                     t.step, t.policy.name)
            t.global_batch_size = new

    def close_window(self) -> None:
        self.window = Window()
        if self.reducer is not None:
            self.reducer.closed()
            self.reducer.disarm()
