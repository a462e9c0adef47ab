"""Per-node bit patterns of used GPUs, kept up to date as blocks are taken
and released, for :class:`tidal.scheduler.buddy.BuddyAllocator`'s best-fit
search on clusters of 8-GPU nodes.

Node ``k`` holds GPUs ``8k .. 8k+7``; its pattern is one byte (bit ``i`` set:
GPU ``8k+i`` used). Tables indexed by that byte give, for a block size of 1, 2
or 4, the node's best free aligned block (fewest free GPUs in its buddy pair,
then lowest offset) and its rank, so a search reads one small array per node
instead of the whole GPU mask; the free GPUs per node and per switch are kept
as counts.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable

import numpy as np

from tidal.scheduler import kernels

_NONE = 1 << 20  # rank of a node without a free block of the size


def _tables(s: int) -> tuple[np.ndarray, np.ndarray]:
    """For block size ``s`` (1, 2, 4) and every node byte: the rank
    ``free in buddy pair * 9 + free in node`` of the node's best free aligned
    block (``_NONE`` if none) and that block's offset in the node."""
    rank = np.full(256, _NONE, dtype=np.int64)
    local = np.zeros(256, dtype=np.int64)
    ones, pair_ones = (1 << s) - 1, (1 << 2 * s) - 1
    for b in range(256):
        node_free = 8 - b.bit_count()
        best = None
        for off in range(0, 8, s):
            if b >> off & ones:
                continue
            par = off - off % (2 * s)
            key = (2 * s - (b >> par & pair_ones).bit_count(), off)
            if best is None or key < best:
                best = key
        if best is not None:
            rank[b] = best[0] * 9 + node_free
            local[b] = best[1]
    return rank, local


_RANK = {s: _tables(s) for s in (1, 2, 4)}
_USED8 = np.array([b.bit_count() for b in range(256)], dtype=np.int64)
_SUM = np.add.reduce  # ndarray.sum without its Python wrapper
_COUNT = np.count_nonzero


def first_free_block(used: np.ndarray, prefer: tuple[int, ...], s: int) -> int | None:
    """The first aligned block of ``s`` GPUs around a GPU of ``prefer`` (in
    its order) that is free in the mask ``used``, or None."""
    fast = kernels.fast
    if fast is not None:
        o = fast.first_free(used, prefer, s)
        if o is not NotImplemented:
            return o
    for o in dict.fromkeys(map(s.__rmul__, map(s.__rfloordiv__, prefer))):
        if not _COUNT(used[o : o + s]):
            return o
    return None


@lru_cache(maxsize=16)
def _switch_of_node(nodes: int, nodes_per_switch: int) -> np.ndarray:
    """Each node's switch (read only: shared by every NodeBits of the shape)."""
    out = np.arange(nodes) // nodes_per_switch
    out.flags.writeable = False
    return out


class NodeBits:
    """Used-GPU bytes per 8-GPU node, free GPUs per node and per switch, of a
    used mask (padding included; its length a multiple of 8)."""

    def __init__(self, used: np.ndarray, nodes_per_switch: int) -> None:
        """Counts of the mask ``used``."""
        nodes = used.size // 8
        self.nps = nodes_per_switch
        self.sw_sz = 8 * nodes_per_switch
        # per switch (aligned run of nodes_per_switch nodes): free GPUs, when the
        # nodes split into several whole switches (else the key has no switch
        # term, or the same one for every block: left out)
        self.swf: np.ndarray | None = None
        self.sw_of_node: np.ndarray | None = None
        switched = nodes % nodes_per_switch == 0 and nodes > nodes_per_switch
        fast = kernels.fast
        if fast is not None and used.dtype == np.bool_:
            self.bytes, self.free8 = np.empty(nodes, dtype=np.int64), np.empty(nodes, dtype=np.int64)
            swf = np.empty(nodes // nodes_per_switch, dtype=np.int64) if switched else None
            if fast.counts(used, self.bytes, self.free8, swf, nodes_per_switch) is None:
                self.swf = swf
                if switched:
                    self.sw_of_node = _switch_of_node(nodes, nodes_per_switch)
                return
        self.bytes = np.packbits(used.reshape(-1, 8), axis=1, bitorder="little").ravel().astype(np.int64)
        self.free8 = 8 - _USED8[self.bytes]  # free GPUs per node (read only outside this class)
        if switched:
            self.swf = _SUM(self.free8.reshape(-1, nodes_per_switch), axis=1)
            self.sw_of_node = _switch_of_node(nodes, nodes_per_switch)

    def copy(self) -> "NodeBits":
        """An independent copy (cheaper than building one from a mask)."""
        out = NodeBits.__new__(NodeBits)
        out.bytes, out.free8, out.nps, out.sw_sz = self.bytes.copy(), self.free8.copy(), self.nps, self.sw_sz
        out.swf = None if self.swf is None else self.swf.copy()
        out.sw_of_node = self.sw_of_node  # never written
        return out

    def set_range(self, lo: int, hi: int, used: bool) -> None:
        """GPUs ``lo .. hi-1`` become used (or free)."""
        fast = kernels.fast
        if fast is not None and fast.set_range(self.bytes, self.free8, self.swf, lo, hi, used, self.nps) is None:
            return
        if lo & 7 == 0 and hi & 7 == 0:  # whole nodes
            n0, n1 = lo >> 3, hi >> 3
            swf = self.swf
            if swf is not None:
                free = self.free8[n0:n1]
                sw = n0 // self.nps
                if (n1 - 1) // self.nps == sw:  # within one switch
                    got = int(_SUM(free))
                    swf[sw] -= got if used else got - 8 * (n1 - n0)
                else:
                    np.subtract.at(swf, self.sw_of_node[n0:n1], free if used else free - 8)
            self.bytes[n0:n1] = 255 if used else 0
            self.free8[n0:n1] = 0 if used else 8
            return
        while lo < hi:
            n = lo >> 3
            end = min(hi, (n + 1) << 3)
            self._set(n, ((1 << (end - lo)) - 1) << (lo & 7), used)
            lo = end

    def set_gpus(self, gpus: Iterable[int], used: bool) -> None:
        """GPUs ``gpus`` (any order) become used (or free)."""
        masks: dict[int, int] = {}
        for g in gpus:
            n = g >> 3
            masks[n] = masks.get(n, 0) | 1 << (g & 7)
        for n, m in masks.items():
            self._set(n, m, used)

    def _set(self, n: int, mask: int, used: bool) -> None:
        """Bits ``mask`` of node ``n`` become set (used) or clear."""
        old = self.bytes.item(n)
        new = old | mask if used else old & ~mask
        if new != old:
            self.bytes[n] = new
            d = new.bit_count() - old.bit_count()
            self.free8[n] -= d
            if self.swf is not None:
                self.swf[n // self.nps] -= d

    def best_in_node(self, s: int) -> int | None:
        """Offset of the best free aligned block of ``s`` (1, 2 or 4) GPUs:
        fewest free GPUs in its buddy pair, then node, then switch; the lowest
        offset on ties (None if there is none)."""
        rank, local = _RANK[s]
        nb = self.bytes
        key = rank[nb]
        if self.swf is not None:
            key = key * (self.sw_sz + 1) + self.swf[self.sw_of_node]
        i = int(key.argmin())
        if key.item(i) >= _NONE * (1 if self.swf is None else self.sw_sz + 1):
            return None
        return i * 8 + local.item(nb.item(i))

    def best_whole_nodes(self, s: int) -> int | None:
        """Offset of the best free aligned block of ``s`` GPUs (a power of two
        >= 8, at most the padded GPU count): fewest free GPUs in its buddy
        pair, then in its switch; the lowest offset on ties."""
        fast = kernels.fast
        if fast is not None:
            off = fast.best_whole_nodes(self.free8, self.swf, s, self.sw_sz)
            if off is not NotImplemented:
                return off
        free8 = self.free8
        cs = free8 if s == 8 else _SUM(free8.reshape(-1, s // 8), axis=1)  # free GPUs per aligned block
        blocks = (cs == s).nonzero()[0]
        if blocks.size <= 1:
            return int(blocks[0]) * s if blocks.size else None
        sw_sz = self.sw_sz
        key = _SUM(cs.reshape(-1, 2), axis=1)[blocks >> 1] * (sw_sz + 1)  # 2 s <= size: two blocks exist
        if self.swf is not None:  # (one switch: the same term for every block)
            key += self.swf[(blocks * s) // sw_sz]
        return int(blocks[int(key.argmin())]) * s
