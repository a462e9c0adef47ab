"""Weighted gradient all-reduce with DDP's contract: when ``loss.backward()``
returns, every ``p.grad`` holds the globally reduced gradient.

Strong scaling (Elan §V-B): rank ``r`` contributes ``(b_r / B) * grad_r``,
``grad_r`` being the gradient of its mean local loss; the SUM over ranks is
then the fixed-size gradient ``(1/B) * sum_i grad l_i`` for any split. The
weights add up to 1, so reducing a gradient that is already equal on every
rank leaves it unchanged (a second backward pass in the same step reduces
the sum, as in DDP).

Like DDP, parameters are grouped into buckets in reverse registration order;
a post-accumulate-grad hook copies the scaled gradient into its bucket and a
full bucket is all-reduced asynchronously while backward continues. The
first hook of a backward pass queues a callback on the autograd engine that
runs when backward ends: it launches the buckets whose hooks did not fire
(parameters unused on this rank, as with ``find_unused_parameters``), reduces
a small control tensor (the switch agreement, EDL §4.2, and per-rank compute
times) and writes the reduced gradients back. Buckets are launched strictly
in index order, so every rank issues the same collectives in the same order.
A parameter unused on every rank keeps ``grad = None``, as in DDP. A step
dropped because a peer died leaves zero gradients (tensors, never None).

Like DDP's ``gradient_as_bucket_view=True`` (the default here, ``grad_views``),
the reduced gradient is not copied out: ``p.grad`` becomes a view of its
bucket, and a later backward accumulates straight into the bucket. A
reference to ``p.grad`` kept across steps therefore sees the next step's
values (clone it to keep it). The control numbers ride in a tail of the last
bucket (each as two float32 halves, exact for integers below 2**48) when that
bucket is float32 or float64, saving a collective per step (on the CPU
written and read in place through a numpy view of the bucket); otherwise
they are a separate float64 tensor.

With one rank, a weight of 1 and no norms to take (a script run without a
master, or a job at one worker), nothing is copied into the buckets: the
gradients stay where backward left them (only the control numbers pass).

Gradient accumulation: inside :meth:`GradReducer.no_sync` nothing is
reduced; each micro-batch's incoming gradient is scaled by its own weight
before it is accumulated (a pre-accumulation hook), so a window of uneven
micro-batches still sums to the exact fixed-size gradient, and the synced
backward that closes the window reduces without scaling again. Those hooks
exist only from the first ``no_sync`` of a window until a window ends
outside a ``no_sync`` block (one that ends inside a block, as in a loop
that takes its next batch there, keeps them for the next window): a
Python tensor hook costs about a microsecond per parameter per backward
even when it does nothing, which a step without accumulation would pay for
every parameter.

Gradient norms (for the noise scale, :mod:`tidal.runtime.noise`): with
``measure`` on, each bucket's squared norm is taken just before its
all-reduce is launched (one ``torch.dot`` on the flat buffer, i.e. this
rank's weighted gradient before reduction); their sum is
:attr:`GradReducer.local_sq` when the listener's ``sync_begin`` runs, so the
listener can put it in the control tail. After the reduction the squared
norm of the reduced buckets is :attr:`GradReducer.reduced_sq` when
``sync_done`` runs. Off (the default), nothing is computed.

A silent peer (a cut host, a stopped process) cannot hold the training
thread for the collective timeout: every collective is launched with
``async_op=True`` and waited for through :func:`tidal.runtime.abortable.wait`,
which gives up when the master aborts the generation. The step then fails
like one whose peer died; the buckets the abandoned collectives still hold
are replaced by fresh ones, so a late completion cannot write into the next
step's gradients. The same holds for a backward that raised after launching
some buckets (a script that catches an out-of-memory error and goes on):
its end-of-backward callback never runs, and the next :meth:`GradReducer.
arm` starts over with fresh buckets.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd import Variable

from tidal.runtime import abortable
from tidal.runtime.devices import params_device
from tidal.runtime.rank0 import Diverged

log = logging.getLogger(__name__)

_SUM_ASYNC = dist.AllreduceOptions()  # what dist.all_reduce(t, async_op=True) passes to the group
_SUM_ASYNC.reduceOp = dist.ReduceOp.SUM
if hasattr(_SUM_ASYNC, "asyncOp"):  # torch >= 2.7; before, every collective launched this way was async
    _SUM_ASYNC.asyncOp = True


class SyncListener(Protocol):
    """What the step runner learns from a synced backward pass."""

    def sync_begin(self) -> list[float]:
        """Backward ended on this rank: the numbers to add to the control
        tensor (summed over ranks)."""

    def sync_done(self, reduced: list[float]) -> None:
        """The reduction finished; ``reduced`` is the reduced control tensor."""

    def sync_failed(self, error: Exception) -> None:
        """A collective failed (a peer died): every gradient is now None."""


class _Bucket:
    """Parameters reduced together: one flat buffer of their gradients, then
    room for the control tail (used only by the last bucket)."""

    def __init__(self, params: list[torch.nn.Parameter], tail: int = 0) -> None:
        self.params = params
        self.n = sum(p.numel() for p in params)
        self.ready: set[int] = set()  # positions in ``params`` filled in the running backward
        self.work: Any = None
        self.tail = tail
        self.buf = torch.zeros(self.n + tail, dtype=params[0].dtype, device=params[0].device)
        self._views()

    def renew(self) -> None:
        """A fresh buffer (zeros): an abandoned collective keeps the old one."""
        self.buf = torch.zeros_like(self.buf)
        self._views()

    def _views(self) -> None:
        self.views: list[torch.Tensor] = []
        off = 0
        for p in self.params:
            self.views.append(self.buf[off : off + p.numel()].view(p.shape))
            off += p.numel()
        # the control tail as a numpy array sharing the buffer's memory (CPU only): written and read
        # in place, without a tensor made per step
        self.tail_np = self.buf[self.n :].numpy() if self.tail and self.buf.device.type == "cpu" else None

    def grow_tail(self, k: int) -> None:
        """Room for ``k`` control numbers after the gradients (keeps them)."""
        if k <= self.tail:
            return
        old = self.buf
        self.buf = torch.zeros(self.n + k + 16, dtype=old.dtype, device=old.device)
        self.buf[: self.n].copy_(old[: self.n])
        self.tail = k + 16
        self._views()


class GradReducer:
    """Owns the hooks and buckets for one model's trainable parameters."""

    def __init__(self, params: list[torch.nn.Parameter], listener: SyncListener | None = None,
                 bucket_cap_mb: float = 25.0, overlap: bool = True, first_bucket_mb: float = 1.0,
                 grad_views: bool = True, aborted: Callable[[], str | None] = abortable.SIGNAL.pending) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.aborted = aborted  # why the master aborted this generation (None: it did not)
        self.device = params_device(self.params)  # buckets and the control tensor live here
        self.listener = listener
        self.buckets = _make_buckets(self.params, int(bucket_cap_mb * 2**20), int(min(first_bucket_mb, bucket_cap_mb) * 2**20))
        # each parameter's bucket and position in it, looked up once per parameter per backward
        self.slot_of = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.overlap = overlap
        self.grad_views = grad_views
        self.merge = self.buckets[-1].buf.dtype in (torch.float32, torch.float64) if self.buckets else False
        if self.merge:
            self.buckets[-1].grow_tail(2 * 20)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        self._prescaling: list[Any] = []  # the pre-accumulation hooks, inside an accumulation window only
        self.weight = 1.0
        self.distributed = False
        self.armed = False
        self.syncing = True  # False inside no_sync()
        self.scaled = False  # the accumulated gradients are already weighted (an accumulation window)
        self.queued = False  # the end-of-backward callback is queued for the running backward
        self.filling = False  # the running backward fills the buckets as its gradients are ready
        self.fired = 0  # post-accumulate hooks that fired in the running backward (armed)
        self.syncs = 0  # synced backward passes since arm()
        self.last_extra: list[float] = []
        self._next = 0
        self.measure = False  # take the gradient norms (noise scale)
        self.local_sq = 0.0  # this rank's |bucket contents|² before the reduction (in sync_begin)
        self.reduced_sq = 0.0  # |reduced bucket contents|² (in sync_done)
        self._sq: list[torch.Tensor] = []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stop_prescaling()

    def _start_prescaling(self) -> None:
        """Hook :meth:`_prescale` on every parameter (an accumulation window began)."""
        if not self._prescaling:
            self._prescaling = [p.register_hook(self._prescale) for p in self.params]

    def _stop_prescaling(self) -> None:
        """Unhook it: outside ``no_sync`` and with nothing scaled, it would do nothing."""
        for h in self._prescaling:
            h.remove()
        self._prescaling = []

    def arm(self, weight: float, distributed: bool) -> None:
        """A micro-batch starts: its weight ``b_r / B`` and whether to reduce."""
        self.weight, self.distributed, self.armed = weight, distributed, True
        if self.queued:  # the last backward raised (the script caught it): its end-of-backward callback never ran
            self.queued = False
            for b in self.buckets:
                b.work = None
                b.renew()  # an all-reduce it launched may still write into the old buffer

    def disarm(self) -> None:
        """No reduction until the next :meth:`arm` (a failed collective, or local code)."""
        self.armed, self.distributed = False, False
        for b in self.buckets:
            b.work = None  # in-flight work would keep a broken group alive

    def closed(self) -> None:
        """The step ended: the next window starts from zeroed gradients."""
        self.scaled, self.syncs = False, 0
        if self.syncing:  # inside no_sync (a loop that takes its next batch in the block) the next window needs them
            self._stop_prescaling()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate locally; the first backward after the block reduces."""
        prev = self.syncing
        self.syncing = False
        self._start_prescaling()  # until the window closes: the synced backward after the block needs it too
        try:
            yield
        finally:
            self.syncing = prev

    # -------------------------------------------------------------- hooks
    def _prescale(self, grad: torch.Tensor) -> torch.Tensor | None:
        if not self.armed or not (self.scaled or not self.syncing):
            return None
        self.scaled = True
        if self.weight == 1.0:
            return None
        return torch.zeros_like(grad) if self.weight == 0.0 else grad * self.weight

    def _hook(self, p: torch.Tensor) -> None:
        """Runs once per parameter per backward (a Python call each time,
        so it does as little as it can: one lookup, one copy)."""
        if not self.armed:
            return
        if not self.queued:
            self._backward_began()
        self.fired += 1
        if not self.filling:
            return
        b, i = self.slot_of[id(p)]
        self._fill(b, i, p.grad)
        b.ready.add(i)
        if len(b.ready) == len(b.params):  # launch the buckets that are full, in index order
            last = len(self.buckets) - 1 if self.merge else len(self.buckets)  # the last one carries the tail
            while self._next < last and len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
                self._norm(self.buckets[self._next])
                self._launch(self.buckets[self._next])
                self._next += 1

    def _backward_began(self) -> None:
        """The first hook of a backward pass: queue the end-of-backward
        callback and decide whether this backward fills the buckets as it
        goes (synced, overlapping, and something to reduce or scale)."""
        self.queued = True
        self._next, self._sq, self.fired = 0, [], 0
        for b in self.buckets:
            b.ready.clear()
            b.work = None
        self.filling = self.syncing and self.overlap and not self._alone()
        Variable._execution_engine.queue_callback(self._finalize)

    def _fill(self, b: _Bucket, i: int, g: torch.Tensor | None) -> None:
        """Put parameter ``i`` of ``b``'s gradient ``g``, weighted, into its view."""
        view = b.views[i]
        if g is None or (self.weight == 0.0 and not self.scaled):
            view.zero_()  # unused here, or an empty share: contributes nothing
        elif g is view or (g._base is not None and g.data_ptr() == view.data_ptr() and g.shape == view.shape):
            if not self.scaled and self.weight != 1.0:
                view.mul_(self.weight)  # accumulated straight into the bucket
        elif self.scaled:
            view.copy_(g.detach() if g.requires_grad else g)
        else:
            torch.mul(g.detach() if g.requires_grad else g, self.weight, out=view)

    def _norm(self, b: _Bucket) -> None:
        """This rank's squared norm of ``b`` before its all-reduce (measuring only)."""
        if self.measure and self.distributed:
            self._sq.append(_sqnorm(b.buf[: b.n]))

    def _launch(self, b: _Bucket, extra: int = 0) -> None:
        if self.distributed:
            b.work = self._all_reduce(b.buf[: b.n + extra] if extra else b.buf[: b.n])

    def _all_reduce(self, t: torch.Tensor) -> Any:
        """Launch a sum all-reduce of ``t`` in the default group; its ``Work``.
        The group's own call: ``dist.all_reduce(t, async_op=True)`` ends in
        it too, after checks that cost more than a small bucket's launch.
        The group is looked up each time, never kept: a reference would keep
        a broken group (and its sockets) alive after it is destroyed."""
        return dist.group.WORLD.allreduce([t], _SUM_ASYNC)

    # -------------------------------------------------------------- end of backward
    def _finalize(self) -> None:
        self.queued = False
        if not self.syncing or not self.armed:
            return
        try:
            self._reduce()
        except Diverged:
            raise  # the replicas differ: the job fails (tidal.runtime.checksum)
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError/DistBackendError subclasses
            if isinstance(e, abortable.GenerationAborted):
                self._abandon()
            if self.listener is None:
                raise
            failure = RuntimeError(f"{type(e).__name__}: {e}")  # without the traceback, which holds the group
        else:
            self.syncs += 1
            return
        self.disarm()
        # a dropped step: zero gradients, as tensors (a script may update by hand), new ones (an abandoned
        # collective may still write into the buckets); the registered optimizers skip the step
        # (capture.LateOptimizerGuard)
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.listener.sync_failed(failure)

    def _abandon(self) -> None:
        """The generation was aborted: its pending collectives stay alive
        (never waited for, never freed) with the buffers they hold; the
        buckets get fresh ones."""
        abortable.keep_forever(*(b.work for b in self.buckets if b.work is not None))
        for b in self.buckets:
            b.work = None
            b.renew()

    def _wait(self, work: Any) -> None:
        """Wait for one collective, giving up if the generation is aborted."""
        abortable.wait(work, self.aborted, nccl=self.device.type == "cuda")

    def _alone(self) -> bool:
        """Nothing to reduce and nothing to scale (one rank, weight 1, no
        norms): the gradients stay where backward left them."""
        return not self.distributed and self.weight == 1.0 and not self.scaled and not self.measure

    def _reduce(self) -> None:
        alone = self._alone()
        for b in () if alone else self.buckets[self._next :]:
            for i, p in enumerate(b.params):
                if i not in b.ready:
                    self._fill(b, i, p.grad)
        # every hook fired: every gradient exists; else find the ones that do not
        unused = [] if self.fired == len(self.params) else [p for p in self.params if p.grad is None]
        if self.measure:
            for b in self.buckets[self._next :]:
                self._norm(b)
            self.local_sq = float(torch.stack([t.double() for t in self._sq]).sum()) if self._sq else 0.0
        extra = self.listener.sync_begin() if self.listener is not None else []
        control = [1.0 if unused else 0.0, *extra]
        if self.merge:
            tail = self._put_tail(control)
            for b in self.buckets[self._next : -1]:
                self._launch(b)
            self._launch(self.buckets[-1], tail)
        else:
            for b in self.buckets[self._next :]:
                self._launch(b)
            c = torch.tensor(control, dtype=torch.float64, device=self.device)
            if self.distributed:
                self._wait(self._all_reduce(c))
        self._next = len(self.buckets)
        for b in self.buckets:
            if b.work is not None:
                self._wait(b.work)
                b.work = None
        reduced = self._get_tail(len(control)) if self.merge else c.tolist()
        if self.measure:
            self.reduced_sq = float(sum(_sqnorm(b.buf[: b.n]) for b in self.buckets)) if self.buckets else 0.0
            self._sq = []
        skip = self._globally_unused(unused) if reduced[0] > 0 else set()
        for b in () if alone else self.buckets:  # write the reduced gradients back
            for p, g in zip(b.params, b.views):
                if skip and id(p) in skip:
                    continue
                if self.grad_views:
                    if p.grad is not g:
                        p.grad = g
                elif p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        self.scaled = False  # the window's sum is reduced; further backward passes reduce like DDP
        self.last_extra = reduced[1:]
        if self.listener is not None:
            self.listener.sync_done(reduced[1:])

    def _put_tail(self, control: list[float]) -> int:
        """Write the control numbers after the last bucket's gradients; a
        float32 bucket gets each as (hi, lo) float32 halves. Returns the
        tail's length."""
        b = self.buckets[-1]
        v = np.array(control, dtype=np.float64)
        k = len(v) if b.buf.dtype == torch.float64 else 2 * len(v)
        b.grow_tail(k)
        t = b.tail_np
        if t is None:  # a GPU buffer: one copy in
            if k > len(v):
                hi = v.astype(np.float32)
                v = np.concatenate([hi, (v - hi).astype(np.float32)])
            b.buf[b.n : b.n + k].copy_(torch.from_numpy(v))
        elif k > len(v):  # written in place: the float32 value, then what it left out
            t[: len(v)] = v
            t[len(v) : k] = v - t[: len(v)]
        else:
            t[:k] = v
        return k

    def _get_tail(self, k: int) -> list[float]:
        b = self.buckets[-1]
        n = k if b.buf.dtype == torch.float64 else 2 * k
        t = b.tail_np[:n] if b.tail_np is not None else b.buf[b.n : b.n + n].cpu().numpy()
        if b.buf.dtype == torch.float64:
            return t.tolist()
        return (t[:k].astype(np.float64) + t[k:]).tolist()

    def _globally_unused(self, unused: list[torch.nn.Parameter]) -> set[int]:
        """Parameters no rank used (their grad stays None): one more small
        all-reduce, only in steps where some rank had unused parameters."""
        used = torch.ones(len(self.params), dtype=torch.float32, device=self.device)
        for p in unused:
            used[self.index[id(p)]] = 0.0
        if self.distributed:
            self._wait(self._all_reduce(used))
        flags = used.tolist()
        return {id(p) for p in self.params if flags[self.index[id(p)]] == 0.0}


def _sqnorm(x: torch.Tensor) -> torch.Tensor:
    """``|x|²`` of a flat buffer (accumulated in float32 for half precision)."""
    if x.dtype in (torch.float32, torch.float64):
        return torch.dot(x, x)
    return torch.linalg.vector_norm(x, dtype=torch.float32).square()


def _make_buckets(params: list[torch.nn.Parameter], cap: int, first_cap: int) -> list[_Bucket]:
    """Reverse registration order, one dtype per bucket; a bucket closes once
    it holds at least ``cap`` bytes, the first at least ``first_cap`` (DDP's
    assignment and defaults for a model of one dtype: 25 MB, 1 MB). Closing
    only after the limit is reached, not before it would be passed, matters:
    a first bucket that stopped short of a large weight would leave nearly
    all of the model to the last bucket, reduced after backward instead of
    during it. Unlike DDP, a change of dtype closes the open bucket (DDP
    keeps one open bucket per dtype), and a cap that is given leaves the
    first bucket at ``first_cap`` (DDP then uses the cap for it too)."""
    buckets: list[_Bucket] = []
    cur: list[torch.nn.Parameter] = []
    size = 0
    for p in reversed(params):
        if cur and p.dtype != cur[0].dtype:
            buckets.append(_Bucket(cur))
            cur, size = [], 0
        cur.append(p)
        size += p.numel() * p.element_size()
        if size >= (cap if buckets else first_cap):
            buckets.append(_Bucket(cur))
            cur, size = [], 0
    if cur:
        buckets.append(_Bucket(cur))
    return buckets
