"""Elastic data: exactly-once sample order across rescaling.

Serial semantics (Elan §V-B, EDL's ``elastic_shard_generator``): epoch ``e``
visits a seeded permutation of the dataset; the data state is one integer, the
global sample *cursor* ``c`` (``epoch = c // N``, ``offset = c % N``). A step
consumes positions ``[offset, min(offset + B, N))`` of that permutation, split
into contiguous, as-even-as-possible slices over the current workers. With a
fixed global batch ``B`` this is exactly "global step t consumes positions
``[t*B, (t+1)*B)``" per epoch; the last batch of an epoch may be short and
never crosses into the next epoch.

Shard mode (EDL §4.3, DLRover §5.2): :class:`ShardManager` hands out large
partitions in TODO/DOING/DONE states with offsets; a leaving worker's partial
shard goes back to TODO at its offset.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The seeded permutation of ``range(n)`` used in ``epoch``."""
    g = torch.Generator()
    g.manual_seed(int(seed) * 1_000_003 + int(epoch))
    return torch.randperm(n, generator=g)


def split_sizes(total: int, parts: int) -> list[int]:
    """Split ``total`` samples into ``parts`` contiguous slices, first ones
    one larger (uneven local batches are allowed under strong scaling)."""
    q, r = divmod(total, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


@dataclass(frozen=True)
class StepSlice:
    """Where a step reads: ``epoch``, global positions ``[start, stop)`` of the
    epoch's permutation, and this rank's sub-range ``[lo, hi)``."""

    epoch: int
    start: int
    stop: int
    lo: int
    hi: int

    @property
    def global_size(self) -> int:
        return self.stop - self.start

    @property
    def local_size(self) -> int:
        return self.hi - self.lo


def split_weighted(total: int, shares: Sequence[float]) -> list[int]:
    """Split ``total`` in proportion to ``shares`` (largest remainder), every
    rank getting at least one sample while ``total`` allows it (a straggler
    with a smaller share, EDL §5.2). Sums to ``total``."""
    parts = len(shares)
    w = [max(float(x), 0.0) for x in shares]
    tot_w = sum(w)
    if tot_w <= 0:
        return split_sizes(total, parts)
    floor = 1 if total >= parts else 0
    free = total - floor * parts
    exact = [free * x / tot_w for x in w]
    sizes = [int(e) for e in exact]
    order = sorted(range(parts), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[: free - sum(sizes)]:
        sizes[i] += 1
    return [floor + s for s in sizes]


def step_slice(cursor: int, n: int, batch_size: int, rank: int, world_size: int,
               shares: Sequence[float] = ()) -> StepSlice:
    """The positions step ``cursor`` consumes and this rank's share (even, or
    in proportion to ``shares``)."""
    epoch, start = divmod(cursor, n)
    stop = min(start + batch_size, n)
    if shares and len(shares) == world_size:
        sizes = split_weighted(stop - start, shares)
    else:
        sizes = split_sizes(stop - start, world_size)
    lo = start + sum(sizes[:rank])
    return StepSlice(epoch, start, stop, lo, lo + sizes[rank])


# --------------------------------------------------------------------------- shard mode


@dataclass(frozen=True)
class Shard:
    """A partition ``[start, stop)`` of a large dataset; ``offset`` is how far
    into it work has progressed (EDL §4.3 / DLRover §5.2)."""

    shard_id: int
    start: int
    stop: int
    offset: int
    epoch: int

    def to_json(self) -> dict[str, int]:
        return {"shard_id": self.shard_id, "start": self.start, "stop": self.stop, "offset": self.offset, "epoch": self.epoch}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Shard":
        return cls(int(d["shard_id"]), int(d["start"]), int(d["stop"]), int(d["offset"]), int(d["epoch"]))


class ShardManager:
    """TODO/DOING/DONE partitions of ``[0, n)`` with offsets, held by the
    master. Thread-safe. A worker that leaves (or dies) returns its DOING
    shards to TODO at their last reported offset, so every sample of an epoch
    is handed out exactly once provided workers report progress before
    leaving."""

    def __init__(self, n: int, shard_size: int, epochs: int = 1) -> None:
        if shard_size <= 0:
            raise ValueError("shard_size must be positive")
        self.n, self.shard_size, self.epochs = n, shard_size, epochs
        self._lock = threading.Lock()
        self.epoch = 0
        self.todo: list[Shard] = []
        self.doing: dict[int, tuple[str, Shard]] = {}
        self.done: list[Shard] = []
        self._fill(0)

    def _fill(self, epoch: int) -> None:
        base = epoch * ((self.n + self.shard_size - 1) // self.shard_size)
        self.todo = [
            Shard(base + i, s, min(s + self.shard_size, self.n), s, epoch)
            for i, s in enumerate(range(0, self.n, self.shard_size))
        ]
        self.done = []

    def next(self, worker: str) -> Shard | None:
        """The next TODO shard for ``worker`` (None when all epochs are done)."""
        with self._lock:
            if not self.todo and not self.doing and self.epoch + 1 < self.epochs:
                self.epoch += 1
                self._fill(self.epoch)
            if not self.todo:
                return None
            sh = self.todo.pop(0)
            self.doing[sh.shard_id] = (worker, sh)
            return sh

    def progress(self, shard_id: int, offset: int) -> None:
        """Record that samples ``[start, offset)`` of the shard are consumed."""
        with self._lock:
            w, sh = self.doing[shard_id]
            if not sh.offset <= offset <= sh.stop:
                raise ValueError(f"offset {offset} outside shard {sh}")
            self.doing[shard_id] = (w, Shard(sh.shard_id, sh.start, sh.stop, offset, sh.epoch))

    def complete(self, shard_id: int) -> None:
        with self._lock:
            _, sh = self.doing.pop(shard_id)
            self.done.append(Shard(sh.shard_id, sh.start, sh.stop, sh.stop, sh.epoch))

    def release(self, worker: str) -> list[Shard]:
        """A leaving worker's partial shards go back to TODO with offsets."""
        with self._lock:
            back = [sh for (w, sh) in self.doing.values() if w == worker]
            for sh in back:
                del self.doing[sh.shard_id]
                if sh.offset < sh.stop:
                    self.todo.insert(0, sh)
                else:
                    self.done.append(sh)
            return back

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "n": self.n,
                "shard_size": self.shard_size,
                "epochs": self.epochs,
                "epoch": self.epoch,
                "todo": [s.to_json() for s in self.todo],
                "doing": {str(k): [w, s.to_json()] for k, (w, s) in self.doing.items()},
                "done": [s.to_json() for s in self.done],
            }

    @classmethod
    def from_snapshot(cls, d: dict[str, Any]) -> "ShardManager":
        m = cls(int(d["n"]), int(d["shard_size"]), int(d["epochs"]))
        m.epoch = int(d["epoch"])
        m.todo = [Shard.from_json(x) for x in d["todo"]]
        m.doing = {int(k): (w, Shard.from_json(x)) for k, (w, x) in d["doing"].items()}
        m.done = [Shard.from_json(x) for x in d["done"]]
        return m


class ShardReader:
    """Worker side of shard mode: iterate ``(shard, start, stop)`` chunks of
    the shards the master hands out, reporting the offset after each chunk
    (EDL §4.3). Call :meth:`release` when leaving so a partial shard goes back
    to TODO at its offset."""

    def __init__(self, client: Any, worker_id: str, chunk: int) -> None:
        self.client, self.worker_id, self.chunk = client, worker_id, int(chunk)
        self._last: tuple[int, int] | None = None  # (shard id, end of the last chunk handed out)

    def __iter__(self) -> Iterator[tuple[Shard, int, int]]:
        while True:
            r = self.client.post("/shard/next", {"worker_id": self.worker_id})
            if r.get("shard") is None:
                return
            sh = Shard.from_json(r["shard"])
            for lo in range(sh.offset, sh.stop, self.chunk):
                hi = min(lo + self.chunk, sh.stop)
                self._last = (sh.shard_id, hi)
                yield sh, lo, hi
                self.client.post("/shard/progress", {"shard_id": sh.shard_id, "offset": hi})
            self.client.post("/shard/complete", {"shard_id": sh.shard_id})
            self._last = None

    def release(self) -> None:
        """Leave: the last chunk handed out counts as consumed."""
        if self._last is not None:
            self.client.post("/shard/progress", {"shard_id": self._last[0], "offset": self._last[1]})
            self._last = None
        self.client.post("/shard/release", {"worker_id": self.worker_id})
