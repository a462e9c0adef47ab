"""Buddy placement on the topology tree, with migration to defragment.

ElasticFlow §4.3 (topology-aware placement with buddy allocation) and Elan
§IV (placement that keeps jobs consolidated across resizes). GPUs are
numbered in tree order (switch -> node -> GPU, :mod:`tidal.core.topology`),
so an *aligned block* of ``s`` GPUs (offset a multiple of ``s``, ``s`` a
power of two) is one buddy: half a node, a node, two neighbouring nodes...

- **Buddy allocation**: a job of ``n = 2^k`` GPUs gets one aligned block of
  size ``n``; a count that is not a power of two is split into its binary
  pieces (8 + 2 for 10), each one an aligned block, all on one node when
  a node can hold them.
- **Best-Fit subtree choice**: among the free aligned blocks of the wanted
  size, take the one whose enclosing subtrees are the fullest: fewest free
  GPUs in its buddy pair (the parent block), then in its node, then in its
  switch. Small jobs fill split nodes first and whole nodes stay whole.
- **Keep, then move**: a job whose count does not change keeps its GPUs; a
  resized job keeps the part of its old block that is still aligned and
  grows into its buddy when that is free. Placement goes largest first.
- **Migration to defragment**: if a job cannot get an aligned block although
  enough GPUs are free, it takes the block whose occupants are cheapest to
  move (``weights``; then fewest GPUs) and they move elsewhere; if that
  fails, every job is re-packed largest first, each keeping
  its current block when that is still possible. With power-of-two sizes
  placed in decreasing order on aligned blocks, the free space is always a
  union of aligned blocks at least as large as the next request, so the
  re-pack never fails. A job that keeps its count but gets other GPUs is a
  migration; the simulator charges ``OverheadModel.migrate`` for it.
"""

from __future__ import annotations

import logging
import math
from itertools import chain, compress
from typing import Iterable, Mapping, Sequence

import numpy as np

from tidal.core.topology import Cluster
from tidal.scheduler.api import FrozenDict, Snapshot
from tidal.scheduler import kernels
from tidal.scheduler.nodebits import NodeBits, first_free_block

log = logging.getLogger(__name__)

_BYTE_SUM = np.uint64(0x0101010101010101)
_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # block size -> word of that many bools
_OR, _count = np.bitwise_or.reduce, np.count_nonzero  # C-level, without ndarray.any's Python wrapper


def pieces(n: int) -> list[int]:
    """Power-of-two pieces of ``n``, largest first (10 -> [8, 2])."""
    if n > 0 and n & (n - 1) == 0:
        return [n]
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


def is_aligned_block(gpus: tuple[int, ...] | list[int]) -> bool:
    """True if ``gpus`` are exactly one aligned power-of-two block."""
    n = len(gpus)
    if n == 0 or n & (n - 1):
        return False
    lo = min(gpus)
    return lo % n == 0 and max(gpus) == lo + n - 1 and len(set(gpus)) == n


def node_bits(cluster: Cluster, used: np.ndarray) -> NodeBits | None:
    """Per-node counts of the (padded) used mask ``used``, on clusters of
    8-GPU nodes (None on others: the searches read the mask)."""
    if cluster.gpus_per_node != 8 or used.size % 8:
        return None
    return NodeBits(used, cluster.nodes_per_switch)


def _padded(n: int) -> int:
    """A buddy tree's size for ``n`` GPUs: the next power of two."""
    return 1 << (max(n, 1) - 1).bit_length()


class BuddyAllocator:
    """Free/used map of a cluster with aligned-block allocation.

    On clusters of 8-GPU nodes the best-fit search reads per-node counts
    (:class:`~tidal.scheduler.nodebits.NodeBits`) that every take and release
    keeps up to date, instead of the whole GPU mask."""

    def __init__(self, cluster: Cluster, used: set[int] | None = None,
                 start: tuple[np.ndarray, NodeBits | None] | None = None) -> None:
        """``start``: a used mask (padding included, owned from now on) and its
        per-node counts if known, instead of an empty cluster and ``used``."""
        self.cluster = cluster
        self.n = cluster.num_gpus
        self.size = size = _padded(self.n)  # padding is "used"
        self._bits: NodeBits | None = None  # built when first searched
        if start is not None:
            self._used, self._bits = start
        else:
            self._used = np.ones(size, dtype=bool)
            self._used[: self.n] = False
            if used:
                self._used[list(used)] = True
        self._exposed = False  # ``used`` was handed out: it may be written behind our back
        self._held: np.ndarray | None = None  # made when ``held`` is first handed out (all zeros till then)
        self._holding = False  # whether ``held`` was ever handed out
        # the smallest block size found to have no free aligned block: no larger
        # one has any either until GPUs are released (``used`` is only set meanwhile)
        self._full_from = size + 1

    @property
    def used(self) -> np.ndarray:
        """Per GPU (padding included), whether it is used. Writable in place;
        once handed out, every search re-reads it."""
        self._exposed = True
        return self._used

    @used.setter
    def used(self, mask: np.ndarray) -> None:
        self._used = mask
        self._bits = None

    @property
    def held(self) -> np.ndarray:
        """GPUs that other jobs still hold now, weighted by how much moving
        them costs (re-pack): blocks avoid them. Writable in place."""
        self._holding = True
        if self._held is None:
            self._held = np.zeros(self.size, dtype=np.int64)
        return self._held

    def mask(self) -> np.ndarray:
        """A copy of the used mask."""
        return self._used.copy()

    def any_used(self, gpus: Iterable[int]) -> bool:
        """Whether one of ``gpus`` is used."""
        return bool(self._used[list(gpus)].any())

    def take_free(self, gpus: tuple[int, ...]) -> bool:
        """Take ``gpus`` (distinct) if all are free; whether they were."""
        lo, hi = min(gpus), max(gpus) + 1
        if hi - lo == len(gpus):  # one run of GPUs
            if _count(self._used[lo:hi]):
                return False
            self._mark_range(lo, hi)
            return True
        if self.any_used(gpus):
            return False
        self.mark(gpus)
        return True

    def mark(self, gpus: Iterable[int], used: bool = True) -> None:
        """Set ``gpus`` (distinct) used (or free) without checks."""
        idx = list(gpus)
        if idx:
            lo, hi = min(idx), max(idx) + 1
            if hi - lo == len(idx):  # one run of GPUs
                self._mark_range(lo, hi, used)
                return
            self._used[idx] = used
            if self._bits is not None:
                self._bits.set_gpus(idx, used)

    def _mark_range(self, lo: int, hi: int, used: bool = True) -> None:
        """GPUs ``lo .. hi-1`` become used (or free)."""
        self._used[lo:hi] = used
        if self._bits is not None:
            self._bits.set_range(lo, hi, used)

    def _node_bits(self) -> NodeBits | None:
        """The per-node counts (8-GPU nodes only), rebuilt if stale."""
        if self._bits is None or self._exposed:
            self._bits = node_bits(self.cluster, self._used)
        return self._bits

    def bits_copy(self) -> NodeBits | None:
        """A copy of the per-node counts of the mask now (None if not kept)."""
        bits = self._node_bits()
        return None if bits is None else bits.copy()

    def free_count(self) -> int:
        return int((~self._used[: self.n]).sum())

    def release(self, gpus) -> None:
        idx = list(gpus)
        if idx:
            self.mark(idx, False)
            self._full_from = self.size + 1

    def take(self, gpus) -> None:
        idx = list(gpus)
        if self._used[idx].any():
            raise ValueError(f"GPUs {sorted(g for g in idx if self._used[g])} are already used")
        self.mark(idx)

    def free_blocks(self, s: int) -> np.ndarray:
        """Offsets of free aligned blocks of size ``s``."""
        used = self._used
        if s & (s - 1) == 0 and s <= self.size and used.flags.c_contiguous:
            if s in _WORD:  # a block of s bools is one s-byte word
                return np.flatnonzero(used.view(_WORD[s]) == 0) * s
            return np.flatnonzero(_OR(used.view(np.uint64).reshape(-1, s // 8), axis=1) == 0) * s
        return np.flatnonzero(~used.reshape(-1, s).any(axis=1)) * s

    def _free_per_block(self, sizes: set[int]) -> dict[int, np.ndarray]:
        """Free GPUs per aligned block, for each size in ``sizes`` (powers of
        two summed pairwise level by level; other sizes directly)."""
        free = ~self._used
        out: dict[int, np.ndarray] = {}
        pow2 = {x for x in sizes if x & (x - 1) == 0}
        for x in sizes - pow2:
            out[x] = free.reshape(-1, x).sum(axis=1)
        if pow2:
            if min(pow2) >= 8 and self.size >= 8:
                # the bytes of an 8-byte word (0 or 1 each) summed by one multiplication
                c, width = ((free.view(np.uint64) * _BYTE_SUM) >> np.uint64(56)).astype(np.int64), 8
            else:
                c, width = free.astype(np.int64), 1
            while True:
                if width in pow2:
                    out[width] = c
                if width >= max(pow2):
                    break
                c, width = c[0::2] + c[1::2], width * 2
        return out

    def best_fit_block(self, s: int, prefer: tuple[int, ...] = (), near: tuple[int, ...] = ()) -> int | None:
        """Offset of the best-fit free aligned block of size ``s`` (None if
        none); a block containing one of ``prefer`` wins (grow in place);
        blocks on the nodes of ``near`` come first (pieces of one job)."""
        if s >= self._full_from and s & (s - 1) == 0:
            return None  # no free aligned block that large (nor any half of it, see _full_from)
        used = self._used
        # the aligned blocks around ``prefer`` (ascending, as ``prefer`` is), the first free one
        if prefer and s <= self.size:
            o = first_free_block(used, prefer, s)
            if o is not None:
                return o
        if not near and s & (s - 1) == 0 and s <= self.size and not (self._holding and self.held.any()):
            bits = self._bits if not self._exposed else None
            if bits is None:
                bits = self._node_bits()
            if bits is not None:  # the usual case: the key below, from the per-node counts
                off = bits.best_whole_nodes(s) if s >= 8 else bits.best_in_node(s)
                if off is None:
                    self._full_from = min(self._full_from, s)
                return off
        return self._best_general(s, near)

    def _best_general(self, s: int, near: tuple[int, ...]) -> int | None:
        """:meth:`best_fit_block` from the whole mask: the key (blocks off the
        nodes of ``near`` last, GPUs other jobs hold, free GPUs in the buddy
        pair, node, switch; lowest offset on ties)."""
        offs = self.free_blocks(s)
        if offs.size <= 1:
            if offs.size:
                return int(offs[0])
            if s & (s - 1) == 0:
                self._full_from = min(self._full_from, s)
            return None
        c = self.cluster
        parent = min(2 * s, self.size)
        node_sz = c.gpus_per_node
        sw_sz = node_sz * c.nodes_per_switch
        sizes = {parent} | ({node_sz} if s < node_sz else set()) | ({sw_sz} if self.size % sw_sz == 0 else set())
        per = self._free_per_block(sizes)
        moved = self._holding and bool(self.held.any())
        if not moved and not near:  # the key of the general case below, in fewer steps
            key = per[parent][offs // parent] * ((node_sz + 1) * (sw_sz + 1))
            if s < node_sz:
                key += per[node_sz][offs // node_sz] * (sw_sz + 1)
            if self.size % sw_sz == 0:
                key += per[sw_sz][offs // sw_sz]
            return int(offs[int(np.argmin(key))])
        zeros = np.zeros(offs.size, dtype=np.int64)
        par_free = per[parent][offs // parent]
        node_free = per[node_sz][offs // node_sz] if s < node_sz else zeros
        sw_free = per[sw_sz][offs // sw_sz] if self.size % sw_sz == 0 else zeros
        displaced = self.held.reshape(-1, s).sum(axis=1)[offs // s] if moved else zeros
        if near:
            far = ~np.isin(offs // node_sz, np.array(sorted({g // node_sz for g in near})))
        else:
            far = np.zeros(offs.size, dtype=bool)
        # each key lies in [0, bound): one integer ranks them lexicographically
        # and its first minimum is the lowest offset among the ties
        bounds = (int(displaced.max()) + 1 if moved else 1, parent + 1, node_sz + 1, sw_sz + 1)
        if (not moved or displaced.min() >= 0) and math.prod(bounds) < 1 << 61:
            key = far.astype(np.int64)
            for k, b in zip((displaced, par_free, node_free, sw_free), bounds):
                key = key * b + k
            return int(offs[int(np.argmin(key))])
        order = np.lexsort((offs, sw_free, node_free, par_free, displaced, far))
        return int(offs[order[0]])

    def alloc(self, n: int, prefer: tuple[int, ...] = ()) -> tuple[int, ...] | None:
        """``n`` GPUs as aligned power-of-two blocks, or None (nothing taken).
        A count that is not a power of two goes to one node if one can hold
        all its pieces (the fullest such node)."""
        if n > 0 and n & (n - 1) == 0:  # one block
            off = self.best_fit_block(n, prefer)
            if off is None:
                return None
            self._mark_range(off, off + n)
            return tuple(range(off, off + n))
        per = self.cluster.gpus_per_node
        parts = pieces(n)
        if len(parts) > 1 and n <= per:
            bits = self._node_bits()
            if bits is not None:
                free_per_node = bits.free8[: self.cluster.num_nodes].copy()  # (marks below change the live one)
            else:
                free_per_node = (~self._used[: self.cluster.num_nodes * per]).reshape(-1, per).sum(axis=1)
            for node in sorted(np.flatnonzero(free_per_node >= n).tolist(), key=lambda x: (free_per_node[x], x)):
                got = self._alloc_in(node * per, per, parts)
                if got is not None:
                    return got
        got: list[int] = []
        for s in parts:
            off = self.best_fit_block(s, prefer, near=tuple(got))
            if off is None:
                self.release(got)
                return None
            self._mark_range(off, off + s)
            got.extend(range(off, off + s))
        return tuple(got)

    def _alloc_in(self, base: int, width: int, parts: list[int]) -> tuple[int, ...] | None:
        """Aligned blocks for ``parts`` inside GPUs ``base .. base+width-1``."""
        got: list[int] = []
        for s in parts:
            seg = self._used[base : base + width].reshape(-1, s)
            free = np.flatnonzero(~seg.any(axis=1))
            if free.size == 0:
                self.release(got)
                return None
            off = base + int(free[0]) * s
            self._mark_range(off, off + s)
            got.extend(range(off, off + s))
        return tuple(got)


def _keep_part(gpus: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The aligned sub-blocks of a job's current GPUs that a shrink to ``n``
    can keep (empty if none fit): for each piece of ``n``, largest first, the
    lowest aligned block of the job's GPUs that no earlier piece kept."""
    kept: list[int] = []
    cur = sorted(gpus)
    left = set(cur)  # the job's GPUs that no piece kept yet
    for s in pieces(n):
        for g in cur:
            if g % s == 0 and left.issuperset(range(g, g + s)):
                left.difference_update(range(g, g + s))
                kept.extend(range(g, g + s))
                break
        else:
            return ()
    return tuple(kept)


def place_buddy(
    snap: Snapshot,
    allocation: dict[str, int],
    fallback: Mapping[str, Sequence[int]] | None = None,
    weights: Mapping[str, int] | None = None,
) -> dict[str, tuple[int, ...]]:
    """GPU ids for every job of ``allocation`` (count > 0): keep, grow in
    place, best-fit new blocks, and re-pack (migrations) only if needed.

    ``fallback``: smaller counts (descending) a job may get instead when it
    cannot be placed without moving others; the caller reads the counts it
    got from the placement's lengths (a job may then be missing: count 0).
    ``weights``: how much moving a job costs, relative to 1 (re-pack moves
    the cheap ones first)."""
    if not snap.cluster.is_uniform:
        # nodes of mixed sizes or types have no buddy tree: best fit over the nodes
        from tidal.scheduler.placement import place_consolidated

        return place_consolidated(snap, {jid: n for jid, n in allocation.items() if n > 0})
    ids, held, fast = snap.ids, snap.held, kernels.fast
    got = NotImplemented
    if fast is not None and type(ids) is tuple and type(held) in (dict, FrozenDict) and type(allocation) is dict:
        got = fast.placer_inputs(ids, held, allocation)  # the lines below, compiled
    if got is NotImplemented:
        holders = list(compress(ids, map(held.__contains__, ids)))
        current = dict(zip(holders, map(held.__getitem__, holders)))  # in snapshot order
        want = {jid: n for jid, n in allocation.items() if n > 0} if 0 in allocation.values() else dict(allocation)
    else:
        current, want = got
    if want == snap.sizes:  # every job keeps its count and nobody else gets GPUs: all keep their GPUs
        return current
    if fallback is None:
        fallback = {}
    options: dict[str, list[int]] = {}  # copied from ``fallback`` when a job first fails
    placer = _Placer(snap.cluster, current, want, used=snap.used_mask)
    while True:
        failed = placer.run()
        if failed is None:
            return placer.out
        if failed not in options:
            options[failed] = list(fallback.get(failed) or ())
        if not options[failed]:
            break
        n = options[failed].pop(0)
        if n > 0:
            want[failed] = n
        else:
            del want[failed]
        if not placer.retry(failed):
            placer = placer.restart(failed)
    # the jobs placed before the failed one are placed as a fresh run would
    # (weights only act on a failure): go on from it, now defragmenting
    if placer.run(weights or {}) is None:
        return placer.out
    try:
        return _repack(snap.cluster, current, want, weights or {})
    except ValueError:
        # counts that are not powers of two can defeat the re-pack
        from tidal.scheduler.placement import place_consolidated

        return place_consolidated(snap, want)


class _Placer:
    """Phase 1: unchanged jobs keep their GPUs; resized and new jobs get
    aligned blocks, largest first. With ``weights``, a job that finds no free
    block takes the block whose occupants are cheapest to move, and they move
    elsewhere (local defragmentation).

    A job that cannot be placed leaves the allocator as it was before it, and
    the jobs before it come first whatever its count becomes, so after its
    count drops (:meth:`retry`) placement goes on from it."""

    def __init__(
        self, cluster: Cluster, current: dict[str, tuple[int, ...]], want: dict[str, int],
        prev: "_Placer | None" = None, kept: str = "", used: np.ndarray | None = None,
    ) -> None:
        """``used``: the GPUs ``current`` holds, as a mask, if the caller has it."""
        self.current, self.want = current, want  # ``want`` is shared with the caller
        self._ordered = True  # ``keep`` is in the order of ``current`` (until a restart adds a job)
        if prev is None:
            buddy = self._start(cluster, current, want, used)
        else:  # start over once job ``kept`` keeps its GPUs too (the order of the rest holds)
            self.keep = prev.keep  # ``prev`` is not used again (see restart): its dict is taken over
            self.keep[kept] = current[kept]
            self._ordered = False
            self.buddy = buddy = BuddyAllocator(cluster, start=(prev.used0.copy(), prev.start_bits()))
            buddy.mark(current[kept])
            self.todo = [j for j in prev.todo if j != kept]
        self.used0 = buddy.mask()
        self._bits0 = buddy.bits_copy() if prev is not None else None  # per-node counts of used0, once known
        self.placed: dict[str, tuple[int, ...]] = {}
        self.pos = 0

    def _start(self, cluster: Cluster, current: dict[str, tuple[int, ...]], want: dict[str, int],
               used: np.ndarray | None) -> BuddyAllocator:
        """The jobs whose count stays keep their GPUs; the others' GPUs are
        free to place (the allocator, returned); the jobs to place, largest
        first."""
        fast, n = kernels.fast, cluster.num_gpus

        def held_mask() -> np.ndarray:  # every held GPU (and the padding)
            mask = np.ones(_padded(n), dtype=bool)
            mask[: len(used)] = used
            mask[len(used) : n] = False
            return mask

        mask = None if used is None else held_mask()
        got = NotImplemented
        if fast is not None and mask is not None and type(current) is dict and type(want) is dict:
            got = fast.placer_start(current, want, mask)  # the lines below, compiled; less the changing jobs' GPUs
        if got is not NotImplemented:
            self.keep, todo = got
        else:
            if mask is not None:  # (a kernel that hands the case back may have cleared some)
                mask = held_mask()
            sizes = dict(zip(current, map(len, current.values())))
            moves = [jid for jid, _ in sizes.items() - want.items()]  # held, and their count changes
            self.keep = keep = dict(current)
            for jid in moves:
                del keep[jid]
            if mask is not None and moves:
                mask[list(chain.from_iterable(map(current.__getitem__, moves)))] = False
            todo = [jid for jid, _ in want.items() - sizes.items()]
        if mask is None:
            self.buddy = buddy = BuddyAllocator(cluster)
            buddy.mark(chain.from_iterable(self.keep.values()))
        else:
            self.buddy = buddy = BuddyAllocator(cluster, start=(mask, None))
        self.todo = sorted(todo, key=lambda j: (-want[j], j))
        return buddy

    def start_bits(self) -> NodeBits | None:
        """A copy of the per-node counts of ``used0`` (for a placer that
        starts over from it)."""
        if self._bits0 is None:
            self._bits0 = node_bits(self.buddy.cluster, self.used0)
        return None if self._bits0 is None else self._bits0.copy()

    @property
    def out(self) -> dict[str, tuple[int, ...]]:
        """The placement: jobs that keep their GPUs (in the order of
        ``current``), then the others in the order they were placed."""
        keep = self.keep
        out = dict(keep) if self._ordered else {jid: keep[jid] for jid in self.current if jid in keep}
        out.update(self.placed)
        return out

    def run(self, weights: Mapping[str, int] | None = None) -> str | None:
        """Place the jobs left; the job that cannot be placed (None: done)."""
        buddy, placed, want, current, keep = self.buddy, self.placed, self.want, self.current, self.keep
        while self.pos < len(self.todo):
            jid = self.todo[self.pos]
            n = want[jid]
            have = current.get(jid, ())
            gpus = None
            if have and n < len(have):
                part = _keep_part(have, n)
                if part and buddy.take_free(part):
                    gpus = part
            if gpus is None:
                gpus = buddy.alloc(n, prefer=tuple(sorted(have)))
            if gpus is None and weights is not None and n & (n - 1) == 0:
                # jobs placed in this call (started or resized) move for free
                out = {**keep, **placed}
                gpus = _evict_for(buddy, out, n, {j: (weights.get(j, 1) if j in keep else 0) for j in out})
                for j, g in out.items():
                    (keep if j in keep else placed)[j] = g
            if gpus is None:
                return jid
            placed[jid] = tuple(sorted(gpus))
            self.pos += 1
        return None

    def restart(self, kept: str) -> "_Placer":
        """Start over now that the failed job ``kept`` keeps its GPUs. When it
        failed first (nothing placed in this run: the allocator is as it began)
        this placer goes on in place, as a new one would. Either way only the
        placer returned is used from then on (a new one takes this one's
        kept jobs over)."""
        if self.pos or self.placed or self.todo[0] != kept:
            return _Placer(self.buddy.cluster, self.current, self.want, self, kept)
        gpus = self.current[kept]
        self.keep[kept] = gpus
        self._ordered = False
        self.buddy.mark(gpus)
        self.used0 = self.buddy.mask()
        self._bits0 = None
        del self.todo[0]
        return self

    def retry(self, jid: str) -> bool:
        """The job that failed now wants a smaller count (or none); False if
        it now keeps its GPUs (then placement must start over)."""
        n = self.want.get(jid, 0)
        if n and n == len(self.current.get(jid, ())):
            return False
        tail = [j for j in self.todo[self.pos + 1 :]]
        if n:
            tail.append(jid)
        want = self.want
        self.todo[self.pos :] = sorted(tail, key=lambda j: (-want[j], j))
        return True


def _evict_for(buddy: BuddyAllocator, out: dict[str, tuple[int, ...]], n: int, weights: Mapping[str, int]):
    """Free the aligned block of ``n`` GPUs whose occupants weigh least
    (then: fewest GPUs moved), re-place them elsewhere, return the block."""
    ids = list(out)
    owner = np.full(buddy.size, -1, dtype=np.int64)
    owner[buddy.n :] = -2  # padding: never usable
    for k, jid in enumerate(ids):
        owner[list(out[jid])] = k
    best = None
    for b, row in enumerate(owner.reshape(-1, n)):
        occ = set(row.tolist()) - {-1}
        if not occ or -2 in occ:
            continue
        lo, hi = b * n, b * n + n
        if any(min(out[ids[k]]) < lo or max(out[ids[k]]) >= hi for k in occ):
            continue  # an occupant spans more than this block
        key = (sum(weights.get(ids[k], 1) for k in occ), sum(len(out[ids[k]]) for k in occ), b)
        if best is None or key < best[0]:
            best = (key, b, occ)
    if best is None:
        return None
    _, b, occ = best
    moved = sorted((ids[k] for k in occ), key=lambda j: (-len(out[j]), j))
    for jid in moved:
        buddy.release(out[jid])
    block = tuple(range(b * n, b * n + n))
    buddy.take(block)
    for jid in moved:
        got = buddy.alloc(len(out[jid]))
        if got is None:
            return None  # the caller falls back to a full re-pack
        out[jid] = tuple(sorted(got))
    return block


def _repack(cluster: Cluster, current: dict[str, tuple[int, ...]], want: dict[str, int], weights: Mapping[str, int]):
    """Phase 2: place jobs largest first; within a size, jobs whose current
    block is still free keep it, then the others take the best-fit block
    that displaces the fewest GPUs other jobs hold now. Jobs that move at
    the same count are migrations."""
    buddy = BuddyAllocator(cluster)
    for jid, gpus in current.items():
        buddy.held[list(gpus)] = weights.get(jid, 1)
    out: dict[str, tuple[int, ...]] = {}
    sizes = sorted(set(want.values()), reverse=True)
    for size in sizes:
        group = sorted(j for j in want if want[j] == size)
        movers = []
        for jid in group:
            have = current.get(jid, ())
            part = have if len(have) == size else (_keep_part(have, size) if len(have) > size else ())
            if part and len(part) == size and is_aligned_block(part) and not buddy.any_used(part):
                buddy.take(part)
                buddy.held[list(have)] = 0
                out[jid] = tuple(sorted(part))
            else:
                movers.append(jid)
        for jid in movers:
            have = current.get(jid, ())
            buddy.held[list(have)] = 0
            gpus = buddy.alloc(size, prefer=tuple(sorted(have)))
            if gpus is None:
                raise ValueError(f"cannot place {size} GPUs for {jid}: {buddy.free_count()} free")
            out[jid] = tuple(sorted(gpus))
    moved = [j for j in out if j in current and len(current[j]) == want[j] and tuple(sorted(current[j])) != out[j]]
    if moved:
        log.debug("buddy re-pack migrates %d jobs: %s", len(moved), moved[:10])
    return out
