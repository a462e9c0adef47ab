"""Sequential data: bptt windows over one long tensor, and state carried
per stream (an RNN's hidden state) across rescales.

A language model in the style of PyTorch's word-language-model example
cuts one long token tensor into ``B`` streams (``batchify``) and trains on
successive windows of ``bptt`` tokens of all streams (``get_batch``),
carrying each stream's hidden state from one window to the next.
:meth:`tidal.runtime.Job.sequence` gives the same batches: window ``w``
is global step ``w`` of the epoch, its ``B`` streams are the global batch,
and each rank takes a contiguous range of streams (the elastic loader's
split), so ``data`` is ``(seq_len, local streams)`` and ``targets`` the
flattened next tokens, as ``get_batch`` returns them.

The hidden state belongs to streams, not ranks. ``hidden =
loader.carry(hidden)`` after the forward pass (where the example calls
``repackage_hidden``) returns it detached and lets the runtime hold it.
When the ranks change, the runtime moves each stream's state to the
stream's new rank:

* a switch: before leavers go, the old group gathers every stream's
  state; it reaches newcomers with the model; every member then takes its
  new range, *in place* in the tensors the script holds (``Tensor.set_``),
  so the script's own ``hidden`` variable is right for the next window;
* a recovery after a failure: the survivors gather what they hold; the
  lost ranks' streams start again from zeros (their state died with them),
  and a dropped window is redone from the state before it.

``hidden = loader.carry(model.init_hidden(batch_size))`` at the start of an
epoch registers the initial state: a state for all ``batch_size`` streams
is cut to this rank's range (a newcomer gets the streams' current state
instead).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from tidal.runtime.data import step_slice
from tidal.runtime.loader import ElasticLoader
from tidal.runtime.transfer import broadcast_state

if TYPE_CHECKING:
    from tidal.runtime.worker import Job

log = logging.getLogger(__name__)


class Windows(Dataset):
    """Sample ``w * streams + s``: window ``w`` of stream ``s``, the pair
    ``(tokens[i : i + L], tokens[i + 1 : i + 1 + L])`` of that stream with
    ``i = w * bptt`` and ``L = min(bptt, stream length - 1 - i)``. Stream
    ``s`` is the ``s``-th contiguous chunk of ``data`` (``batchify``)."""

    def __init__(self, data: torch.Tensor, streams: int, bptt: int) -> None:
        if data.dim() != 1:
            raise ValueError(f"sequence data must be one long 1-D tensor, not of shape {tuple(data.shape)}")
        if streams < 1 or bptt < 1:
            raise ValueError(f"batch_size (streams) and bptt must be at least 1, not {streams} and {bptt}")
        length = data.size(0) // streams
        if length < 2:
            raise ValueError(f"{data.size(0)} tokens make no window of {streams} streams")
        self.source = data[: length * streams].view(streams, length)
        self.streams, self.bptt, self.length = streams, bptt, length
        self.windows = -(-(length - 1) // bptt)

    def __len__(self) -> int:
        return self.windows * self.streams

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w, s = divmod(int(k), self.streams)
        i = w * self.bptt
        n = min(self.bptt, self.length - 1 - i)
        return self.source[s, i : i + n], self.source[s, i + 1 : i + 1 + n]


def collate_windows(items: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, targets)`` as ``get_batch``: ``(seq_len, streams)`` and the flattened targets."""
    data = torch.stack([x for x, _ in items], dim=1)
    targets = torch.stack([y for _, y in items], dim=1).reshape(-1)
    return data, targets


def _leaves(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _leaves(x)]
    if isinstance(obj, dict):
        return [t for k in sorted(obj) for t in _leaves(obj[k])]
    return []


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        out = [_map(x, fn) for x in obj]
        return type(obj)(out) if isinstance(obj, list) else tuple(out)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


@dataclass
class Held:
    """What :meth:`SequenceLoader.carry` returned last: the state at the
    start of window ``window`` of streams ``[lo, hi)``, and the one before."""

    state: Any
    lo: int
    hi: int
    window: int
    before: Any = None  # the state at the start of ``window - 1`` (a dropped window is redone from it)


def gather(held: Held | None, streams: int, dim: int) -> Any:
    """Every stream's state from the ranks of the current group (each
    broadcasts what it holds, in turn); streams nobody holds are zeros."""
    pieces: list[tuple[int, int, Any]] = []
    for r in range(dist.get_world_size()):
        mine = (held.lo, held.hi, held.state) if held is not None else None
        got = broadcast_state(mine if dist.get_rank() == r else None, src=r)
        if got is not None:
            pieces.append(got)
    if not pieces:
        return None
    pieces.sort(key=lambda p: p[0])
    template = pieces[0][2]

    def full(i: int) -> torch.Tensor:
        ref = _leaves(template)[i]
        shape = list(ref.shape)
        shape[dim] = streams
        out = torch.zeros(shape, dtype=ref.dtype, device=ref.device)
        for lo, hi, st in pieces:
            out.narrow(dim, lo, hi - lo).copy_(_leaves(st)[i].to(out.device))
        return out

    count = iter(range(len(_leaves(template))))
    return _map(template, lambda _t: full(next(count)))


class SequenceLoader(ElasticLoader):
    """``job.sequence(data, batch_size, bptt)``: an elastic loader of bptt
    windows (see the module docstring) with :meth:`carry`."""

    def __init__(self, job: "Job", data: torch.Tensor, batch_size: int, bptt: int, dim: int = 1,
                 **loader_kw: Any) -> None:
        super().__init__(job, Windows(data, batch_size, bptt), batch_size, shuffle=False,
                         collate_fn=collate_windows, **loader_kw)
        self.dim = dim
        self.held: Held | None = None
        job.carriers.append(self)

    @property
    def streams(self) -> int:
        return self.dataset.streams

    def _range(self) -> tuple[int, int, int]:
        """``(window, lo, hi)``: the next window and this rank's streams of it."""
        j, b = self.job, self.streams
        pos = j.runner.live_cursor % self.n
        sl = step_slice(pos, self.n, b, j.rank, j.world_size, tuple(j.shares))
        w = sl.start // b
        return w, sl.lo - w * b, sl.hi - w * b

    def carry(self, state: Any) -> Any:
        """``state`` detached, held for this rank's streams: call it after the
        forward pass with the new hidden state (instead of ``repackage_hidden``),
        and with the initial state at an epoch's start. On a newcomer, the first
        call returns the streams' state received with the model."""
        w, lo, hi = self._range()
        pending = self.job.train.carried
        fresh = not self.job.runner.window.open and self.job.runner.live_cursor % self.n == 0  # an epoch's start
        if pending is not None and int(pending["window"]) == w and not fresh:
            out = _map(pending["state"], lambda t: t.narrow(self.dim, lo, hi - lo).clone())
        else:  # a copy (the runtime may resize it in place); a state for every stream: this rank's range of it
            out = _map(state, lambda t: (t.narrow(self.dim, lo, hi - lo) if t.dim() > self.dim
                                         and t.size(self.dim) == self.streams != hi - lo else t).detach().clone())
        self.job.train.carried = None
        before = self.held.state if self.held is not None and self.held.window == w - 1 else None
        self.held = Held(out, lo, hi, w, before)
        return out

    # ------------------------------------------------------------------ rescales (called by the lifecycle)
    def before_switch(self) -> None:
        """Old group, at the switch boundary (leavers still here): every
        stream's state goes into the payload newcomers receive."""
        if dist.is_initialized() and dist.get_world_size() > 1 and self.held is not None:
            full = gather(self.held, self.streams, self.dim)
            self.job.train.carried = {"window": self.held.window, "state": full}
        elif self.held is not None:
            self.job.train.carried = {"window": self.held.window, "state": self.held.state}

    def after_change(self, recovered: bool = False) -> None:
        """New group: each member takes its streams' state, in place in the
        tensors the script holds. After a recovery the survivors gather what
        they hold first (a dropped window is redone from the state before it)."""
        if self.held is None:
            return
        w, lo, hi = self._range()
        if recovered:
            if self.held.window == w + 1 and self.held.before is not None:
                self.held = Held(self.held.before, self.held.lo, self.held.hi, w)  # the dropped window again
            full = gather(self.held, self.streams, self.dim) if dist.is_initialized() else self.held.state
            self.job.train.carried = {"window": w, "state": full}
        pending = self.job.train.carried
        if pending is None or int(pending["window"]) != w:
            return
        self.job.train.carried = None
        new = [t.narrow(self.dim, lo, hi - lo) for t in _leaves(pending["state"])]
        for mine, t in zip(_leaves(self.held.state), new):
            with torch.no_grad():
                mine.set_(t.clone().to(mine.device))
        self.held = Held(self.held.state, lo, hi, w)
