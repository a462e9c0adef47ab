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
loader.carry(hidden)`` where the example calls ``repackage_hidden`` (before
the forward pass) returns this rank's streams' state, detached: a state for
all ``batch_size`` streams (``model.init_hidden(batch_size)``) is cut to
the rank's range. The runtime takes the state a window ends with from the
forward of a model given to ``job.wrap`` (the part of its output shaped like the state it
was given), so at a rescale it can move each stream's state to the stream's
new rank:

* a switch: before leavers go, the old group gathers every stream's end
  state; newcomers receive it with the model; the first ``carry`` after the
  switch gives every member its new range;
* a recovery after a failure: the survivors gather what they hold; the lost
  ranks' streams start again from zeros (their state died with them), and a
  dropped window is redone from the state before it.
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
    """What :meth:`SequenceLoader.carry` returned last: the state window
    ``window`` (absolute: epochs count) of streams ``[lo, hi)`` started
    from, and the state the model's forward ended that window with."""

    state: Any
    lo: int
    hi: int
    window: int
    end: Any = None


def _match(out: Any, like: Any) -> Any:
    """The part of a forward's output shaped like ``like`` (the state it was given), or None."""
    shapes = [t.shape for t in _leaves(like)]
    if [t.shape for t in _leaves(out)] == shapes and _leaves(out):
        return out
    if isinstance(out, (list, tuple)):
        for x in out:
            m = _match(x, like)
            if m is not None:
                return m
    return None


def gather(held: Held | None, streams: int, dim: int) -> Any:
    """Every stream's state from the ranks of the current group (each
    broadcasts what it holds, in turn); streams nobody holds are zeros."""
    pieces: list[tuple[int, int, Any]] = []
    mine = (held.lo, held.hi, held.state) if held is not None else None
    for r in range(dist.get_world_size()):
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
        self.rng_draws = 0  # batchify and get_batch draw no random numbers
        self.held: Held | None = None
        self._hook: Any = None
        job.carriers.append(self)

    @property
    def streams(self) -> int:
        return self.dataset.streams

    def _window(self) -> tuple[int, int, int]:
        """``(window, lo, hi)``: the window being computed (else the next
        one), absolute, and this rank's streams of it."""
        j, b, per = self.job, self.streams, self.dataset.windows
        sl = j.runner.window.slice if j.runner.window.open else None
        if sl is None:
            pos = j.runner.live_cursor
            sl = step_slice(pos % self.n, self.n, b, j.rank, j.world_size, tuple(j.shares))
            epoch = pos // self.n
        else:
            epoch = self.epoch
        w = sl.start // b
        return epoch * per + w, sl.lo - w * b, sl.hi - w * b

    def carry(self, state: Any) -> Any:
        """This rank's streams' state for the window about to be computed,
        detached: call it where ``repackage_hidden`` is called, before the
        forward pass, with the state the last window ended with (or
        ``model.init_hidden(batch_size)``). After a rescale it is the state
        each stream ended its last window with, wherever that was computed."""
        w, lo, hi = self._window()
        pending, self.job.train.carried = self.job.train.carried, None
        if pending is not None and int(pending["window"]) == w and w % self.dataset.windows:
            out = _map(pending["state"], lambda t: t.narrow(self.dim, lo, hi - lo).clone())
        else:  # a state for every stream (an epoch's initial one): this rank's range of it
            out = _map(state, lambda t: (t.narrow(self.dim, lo, hi - lo) if t.dim() > self.dim
                                         and t.size(self.dim) == self.streams != hi - lo else t).detach())
        self.held = Held(out, lo, hi, w)
        if self._hook is None and self.job.train.elastic is not None:  # every model given to job.wrap
            models = self.job.wrapped or [self.job.train.elastic.model]
            self._hook = [m.register_forward_hook(self._ended, with_kwargs=True) for m in models]
        return out

    def _ended(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """The registered model's forward: the state the held window ended with."""
        h = self.held
        if h is not None and any(a is h.state for a in (*args, *kwargs.values())):
            end = _match(out, h.state)
            if end is not None:
                h.end = _map(end, lambda t: t.detach())

    def _ends(self) -> Held | None:
        """What this rank holds at a boundary: the end state of its last
        window (the start of the next), else the start of that window."""
        h = self.held
        if h is None:
            return None
        if h.end is not None:
            return Held(h.end, h.lo, h.hi, h.window + 1)
        return h

    # ------------------------------------------------------------------ rescales (called by the lifecycle)
    def before_switch(self) -> None:
        """Old group, at the switch boundary (leavers still here): every
        stream's end state goes into the payload newcomers receive."""
        h = self._ends()
        if h is None:
            return
        full = gather(h, self.streams, self.dim) if dist.is_initialized() and dist.get_world_size() > 1 else h.state
        self.job.train.carried = {"window": h.window, "state": full}

    def after_recovery(self) -> None:
        """After a recovery the survivors gather what they hold: the state
        before the dropped window if it is redone, else the state its last
        window ended with; lost ranks' streams are zeros. (After a switch
        there is nothing to do: :meth:`before_switch` gathered every stream.)"""
        if self.held is None:
            return
        w, _, _ = self._window()
        h = self.held if self.held.window == w else self._ends()
        if h is None or h.window != w:
            h = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            full = gather(h, self.streams, self.dim)
        else:
            full = h.state if h is not None else None
        self.job.train.carried = {"window": w, "state": full} if full is not None else None
