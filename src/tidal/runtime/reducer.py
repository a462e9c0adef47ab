"""Weighted gradient all-reduce, overlapped with the backward pass.

Strong scaling (Elan §V-B): rank ``r`` contributes ``(b_r / B) * grad_r`` where
``grad_r`` is the gradient of its mean local loss; the SUM over ranks is then
exactly the fixed-size gradient ``(1/B) * sum_i grad l_i`` for any split.

Like DDP, parameters are grouped into buckets in reverse registration order
(roughly the order backward produces gradients); a post-accumulate-grad hook
copies the scaled gradient into its bucket, and a full bucket is all-reduced
asynchronously while backward continues. Buckets are launched strictly in
index order, so every rank issues the same collectives in the same order.
A three-number control tensor (target generation, switch step, a "redo"
flag) is reduced at the end of every step; it carries the switch agreement
(EDL §4.2) at no extra synchronisation. If a gradient changed after its
bucket was sent (e.g. several backward passes per step) any rank can raise
the redo flag and every rank then falls back to one synchronous flat
all-reduce, so the result is always correct.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.distributed as dist

from tidal.runtime.devices import params_device

log = logging.getLogger(__name__)


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.dtype = params[0].dtype
        self.offsets: dict[int, tuple[int, int]] = {}
        off = 0
        for p in params:
            self.offsets[id(p)] = (off, p.numel())
            off += p.numel()
        self.buf = torch.zeros(off, dtype=self.dtype, device=params[0].device)
        self.ready: set[int] = set()
        self.work: Any = None
        self.launched = False


class GradReducer:
    """Owns the hooks and buckets for one model's trainable parameters."""

    def __init__(self, params: list[torch.nn.Parameter], bucket_cap_mb: float = 4.0, overlap: bool = True) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.device = params_device(self.params)  # buckets and the control tensor live here
        cap = int(bucket_cap_mb * 2**20)
        self.buckets: list[_Bucket] = []
        cur: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            if cur and (size + nbytes > cap or p.dtype != cur[0].dtype):
                self.buckets.append(_Bucket(cur))
                cur, size = [], 0
            cur.append(p)
            size += nbytes
        if cur:
            self.buckets.append(_Bucket(cur))
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.overlap = overlap and hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params] if self.overlap else []
        self.active = False
        self.weight = 1.0
        self.distributed = False
        self.redo = False
        self.last_redo = False  # whether the last step took the synchronous fallback (on every rank)
        self.last_extra: list[float] = []
        self._next = 0

    def abort(self) -> None:
        """Drop in-flight work after a failed collective, so the broken process
        group can really be torn down (its sockets closed, which is how the
        other survivors notice quickly)."""
        self.active = False
        for b in self.buckets:
            b.work = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -------------------------------------------------------------- per step
    def begin(self, weight: float, distributed: bool) -> None:
        """Arm the hooks for the batch about to be computed."""
        self.weight, self.distributed, self.redo, self._next = weight, distributed, False, 0
        for b in self.buckets:
            b.ready.clear()
            b.work, b.launched = None, False
        self.active = True

    def _fill(self, b: _Bucket, p: torch.nn.Parameter) -> None:
        off, n = b.offsets[id(p)]
        view = b.buf[off : off + n]
        if p.grad is None or self.weight == 0.0:
            view.zero_()  # an empty local batch contributes nothing (its mean loss is NaN)
        else:
            torch.mul(p.grad.detach().reshape(-1), self.weight, out=view)

    def _hook(self, p: torch.Tensor) -> None:
        if not self.active:
            return
        b = self.bucket_of[id(p)]
        if b.launched:
            self.redo = True  # accumulated again after its bucket was sent
            return
        self._fill(b, p)  # type: ignore[arg-type]
        b.ready.add(id(p))
        self._launch_ready()

    def _launch(self, b: _Bucket) -> None:
        b.launched = True
        if self.distributed:
            b.work = dist.all_reduce(b.buf, async_op=True)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def finish(self, ctrl: tuple[float, float], extra: Sequence[float] = ()) -> tuple[float, float]:
        """Complete the reduction, write the gradients back and return the
        reduced control pair (target generation, switch step). ``extra``
        numbers ride along in the same control tensor (summed); their reduced
        values are in ``last_extra`` (e.g. per-rank compute times)."""
        self.active = False
        for b in self.buckets[self._next :]:  # buckets whose hooks did not all fire (unused params, no overlap)
            for p in b.params:
                if id(p) not in b.ready:
                    self._fill(b, p)
            self._launch(b)
        self._next = len(self.buckets)
        c = torch.tensor([ctrl[0], ctrl[1], 1.0 if self.redo else 0.0, *extra], dtype=torch.float64,
                         device=self.device)
        if self.distributed:
            dist.all_reduce(c)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
        self.last_redo = c[2].item() > 0
        self.last_extra = c[3:].tolist()
        if self.last_redo:  # some rank saw late gradients: redo synchronously, identically everywhere
            log.debug("gradient changed after its bucket was sent; synchronous all-reduce")
            for b in self.buckets:
                for p in b.params:
                    self._fill(b, p)
                if self.distributed:
                    dist.all_reduce(b.buf)
        for b in self.buckets:
            for p in b.params:
                off, n = b.offsets[id(p)]
                g = b.buf[off : off + n].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        return c[0].item(), c[1].item()
