"""The rows one parameter server holds, and the next layout's rows while a
repartition is in flight. Not thread-safe: :class:`tidal.ps.server.PSServer`
calls it under its lock."""

from __future__ import annotations

import zlib

import torch

from tidal.ps.layout import Layout, TableSpec


def _initial(spec: TableSpec, lo: int, hi: int, seed: int) -> torch.Tensor:
    if spec.init == "zeros":
        return torch.zeros(hi - lo, spec.dim, dtype=spec.torch_dtype)
    if spec.init == "normal":
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{spec.name}/{lo}".encode()) & 0x7FFFFFFF)
        return (torch.randn(hi - lo, spec.dim, generator=g) * spec.std).to(spec.torch_dtype)
    raise ValueError(f"table {spec.name}: unknown init {spec.init!r} (zeros or normal)")


class ShardStore:
    """``table -> (first row, rows x dim tensor)`` for one server."""

    def __init__(self) -> None:
        self.shards: dict[str, tuple[int, torch.Tensor]] = {}
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}

    def init(self, layout: Layout, ps: str, seed: int = 0) -> None:
        """The server's rows of a fresh job."""
        self.shards = {}
        for name, spec in layout.tables.items():
            lo, hi = layout.range_of(ps, name)
            self.shards[name] = (lo, _initial(spec, lo, hi, seed))

    def owns(self, table: str, ids: torch.Tensor) -> bool:
        if table not in self.shards:
            return False
        lo, t = self.shards[table]
        return bool(ids.numel() == 0 or (int(ids.min()) >= lo and int(ids.max()) < lo + t.shape[0]))

    def read(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        lo, t = self.shards[table]
        return t.index_select(0, ids - lo)

    def read_range(self, table: str, lo: int, hi: int) -> torch.Tensor:
        first, t = self.shards[table]
        return t[lo - first:hi - first].clone()

    def apply(self, table: str, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        """``rows[ids] -= lr * grads`` (repeated ids add up)."""
        lo, t = self.shards[table]
        t.index_add_(0, ids - lo, grads.to(t.dtype).reshape(-1, t.shape[1]), alpha=-lr)

    # -- repartition ----------------------------------------------------------------
    def prepare(self, new: Layout, ps: str) -> None:
        """Allocates the rows ``ps`` holds in ``new`` and copies the ones it already has."""
        self.pending = {}
        for name, spec in new.tables.items():
            lo, hi = new.range_of(ps, name)
            t = torch.zeros(hi - lo, spec.dim, dtype=spec.torch_dtype)
            if name in self.shards:
                first, old = self.shards[name]
                a, b = max(lo, first), min(hi, first + old.shape[0])
                if a < b:
                    t[a - lo:b - lo] = old[a - first:b - first]
            self.pending[name] = (lo, t)

    def put(self, table: str, lo: int, rows: torch.Tensor) -> None:
        """Rows another server sends for the pending layout."""
        first, t = self.pending[table]
        t[lo - first:lo - first + rows.shape[0]] = rows

    def commit(self) -> None:
        self.shards, self.pending = self.pending, {}

    def ranges(self) -> dict[str, list[int]]:
        return {k: [lo, lo + t.shape[0]] for k, (lo, t) in self.shards.items()}

    def snapshot(self) -> dict[str, tuple[int, torch.Tensor]]:
        """A copy of every shard (taken under the server's lock, written outside it)."""
        return {k: (lo, t.clone()) for k, (lo, t) in self.shards.items()}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.shards.values())
