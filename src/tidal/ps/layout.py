"""Which parameter server holds which rows: row-range sharding.

Every parameter is a table of ``rows x dim`` (a dense weight of shape
``(a, b, c)`` is ``a`` rows of ``b*c``); with ``n`` servers, server ``i`` of a
layout holds rows ``[rows*i//n, rows*(i+1)//n)`` of every table. A layout has
a version; every change (scale-out/in, a replaced or restored server) makes a
new one, and :func:`moves` lists the row ranges that change hands.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class TableSpec:
    """One parameter: ``rows x dim``, its dtype and how it starts (zeros, or normal with ``std``)."""

    name: str
    rows: int
    dim: int
    dtype: str = "float32"
    init: str = "zeros"
    std: float = 0.01

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class Layout:
    """Version, tables, the servers in shard order and their addresses."""

    version: int
    tables: dict[str, TableSpec]
    servers: list[str]
    addrs: dict[str, str] = field(default_factory=dict)

    def bounds(self, table: str) -> list[int]:
        """Row boundaries: server ``i`` holds ``[b[i], b[i+1])``."""
        rows, n = self.tables[table].rows, len(self.servers)
        return [rows * i // n for i in range(n + 1)]

    def range_of(self, ps: str, table: str) -> tuple[int, int]:
        """The rows of ``table`` that ``ps`` holds (empty if it is not in the layout)."""
        if ps not in self.servers:
            return (0, 0)
        i = self.servers.index(ps)
        b = self.bounds(table)
        return (b[i], b[i + 1])

    def split(self, table: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Positions in ``ids`` that each server owns (only servers with at least one)."""
        b = torch.tensor(self.bounds(table)[1:-1], dtype=torch.int64)
        owner = torch.bucketize(ids.to(torch.int64), b, right=True)
        out = {}
        for i, ps in enumerate(self.servers):
            pos = (owner == i).nonzero().flatten()
            if pos.numel():
                out[ps] = pos
        return out

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "servers": list(self.servers), "addrs": dict(self.addrs),
                "tables": [asdict(t) for t in self.tables.values()]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Layout":
        tables = {t["name"]: TableSpec(**t) for t in d["tables"]}
        return Layout(int(d["version"]), tables, list(d["servers"]), dict(d["addrs"]))

    def with_servers(self, servers: list[str]) -> "Layout":
        """The next version with ``servers`` in shard order (addresses kept for the ones still in)."""
        return Layout(self.version + 1, self.tables, list(servers),
                      {k: v for k, v in self.addrs.items() if k in servers})


def moves(old: Layout, new: Layout) -> list[tuple[str, str, str, int, int]]:
    """``(table, source, destination, lo, hi)``: rows that change server between two layouts."""
    out = []
    for table in new.tables:
        for src in old.servers:
            s0, s1 = old.range_of(src, table)
            for dst in new.servers:
                if dst == src:
                    continue
                d0, d1 = new.range_of(dst, table)
                lo, hi = max(s0, d0), min(s1, d1)
                if lo < hi:
                    out.append((table, src, dst, lo, hi))
    return out
