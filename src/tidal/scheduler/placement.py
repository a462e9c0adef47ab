"""Placement: turn GPU counts into GPU ids on the switch -> node -> GPU tree.

``place_consolidated`` is the default for every policy: a job keeps its GPUs
when its count does not change; a shrinking job gives back GPUs from its
least-used nodes; a growing job first takes GPUs on nodes it already uses; a
new job takes the best-fit node (the fullest node that still fits it) or, when
it needs several nodes, whole free nodes under one switch (the fullest switch
that fits), and only then spreads. This is ElasticFlow §4.3's Best-Fit over
the topology tree without buddy alignment or migration (those are in
:mod:`tidal.scheduler.buddy`).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import compress
from operator import eq
from typing import TYPE_CHECKING, Sequence

from tidal.core.topology import Cluster

if TYPE_CHECKING:
    from tidal.scheduler.api import Snapshot


class FreeMap:
    """Free GPUs per node, for best-fit searches: a snapshot's free lists plus
    the changes made while placing (nodes are copied when first changed).

    It behaves as the dict ``by_node`` (node -> free GPUs, nodes with any free
    GPU; ascending at first, a node that becomes free again goes last), whose
    order decides ties between switches; single-node best fit uses the
    snapshot's nodes-by-free-count index instead of scanning every node.
    """

    def __init__(
        self,
        cluster: Cluster,
        used: set[int] | None = None,
        free: Sequence[Sequence[int]] | None = None,
        by_free: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.cluster = cluster
        per = cluster.max_gpus_per_node
        if free is None or by_free is None:
            taken = used or set()
            free = [[g for g in cluster.gpus_of_node(n) if g not in taken] for n in range(cluster.num_nodes)]
            by_free = [[n for n, f in enumerate(free) if len(f) == k] for k in range(per + 1)]
        self._base = free
        self._by_free = by_free
        self._mod: dict[int, list[int]] = {}  # changed nodes: their free GPUs now
        self._gone: set[int] = set()  # nodes free at first that were emptied
        self._tail: dict[int, None] = {}  # nodes that became free again, in order
        # changed nodes by their free count now: per count, a bit set of nodes (bit i: node i)
        self._mod_bits = [0] * (per + 1)
        # per count, where in ``by_free[k]`` the first node not yet changed may be (nodes never
        # leave ``_mod``, so it only moves forward)
        self._first = [0] * (per + 1)
        self._nonempty: list[int] | None = None  # nodes with a free GPU at first (ascending)

    def _free(self, node: int) -> Sequence[int]:
        m = self._mod.get(node)
        return self._base[node] if m is None else m

    def has(self, node: int) -> bool:
        return bool(self._free(node))

    @property
    def by_node(self) -> dict[int, list[int]]:
        """Node -> free GPUs, in dict order (see the class docstring)."""
        return {n: list(self._free(n)) for n in self.counts()}

    def counts(self) -> dict[int, int]:
        """Node -> how many GPUs are free there, in the order of :attr:`by_node`."""
        base, gone, mod = self._base, self._gone, self._mod
        if self._nonempty is None:
            self._nonempty = [n for n, f in enumerate(base) if f]
        out = {n: len(mod[n]) if n in mod else len(base[n]) for n in self._nonempty if n not in gone}
        for n in self._tail:
            out[n] = len(mod[n])
        return out

    def total(self) -> int:
        return sum(self.counts().values())

    def take(self, node: int, k: int) -> list[int]:
        gpus = self._free(node)
        out, rest = list(gpus[:k]), list(gpus[k:])
        self._set(node, rest)
        if not rest:
            if node in self._tail:
                del self._tail[node]
            else:
                self._gone.add(node)
        return out

    def give(self, gpus: list[int]) -> None:
        node_of = self.cluster.node_of
        groups: dict[int, list[int]] = {}  # node -> its GPUs given, nodes in the order first seen
        for g in gpus:
            groups.setdefault(node_of(g), []).append(g)
        for node, add in groups.items():
            cur = self._free(node)
            if not cur:
                self._tail[node] = None
            add.extend(cur)
            add.sort()
            self._set(node, add)

    def _set(self, node: int, free: list[int]) -> None:
        """Node ``node`` now has the free GPUs ``free`` (kept in the count buckets)."""
        bits, old = self._mod_bits, self._mod.get(node)
        if old is not None:
            bits[len(old)] &= ~(1 << node)
        self._mod[node] = free
        bits[len(free)] |= 1 << node

    def _best_node(self, need: int) -> int | None:
        """The fullest node with at least ``need`` free GPUs (lowest id on ties)."""
        mod, bits, first, by_free = self._mod, self._mod_bits, self._first, self._by_free
        for k in range(need, self.cluster.max_gpus_per_node + 1):
            nodes, i = by_free[k], first[k]
            while i < len(nodes) and nodes[i] in mod:
                i += 1
            first[k] = i
            b = bits[k]
            if b:
                best = (b & -b).bit_length() - 1  # the lowest changed node with k free
                return min(best, nodes[i]) if i < len(nodes) else best
            if i < len(nodes):
                return nodes[i]
        return None

    def best_fit(self, n: int, prefer_nodes: list[int] | None = None) -> list[int]:
        """Pick ``n`` free GPUs as consolidated as possible."""
        c = self.cluster
        out: list[int] = []
        for node in prefer_nodes or ():
            if len(out) == n:
                break
            if self.has(node):
                out += self.take(node, n - len(out))
        need = n - len(out)
        if need == 0:
            return out
        if need <= c.max_gpus_per_node:
            node = self._best_node(need)
            if node is not None:
                return out + self.take(node, need)
        elif self._switch_fit(n, need, out):
            return out
        # spread: most-free nodes first
        counts = self.counts()
        for node in sorted(counts, key=lambda x: (-counts[x], x)):
            if len(out) == n:
                break
            out += self.take(node, n - len(out))
        if len(out) < n:
            raise ValueError(f"cannot place {n} GPUs: only {len(out)} free")
        return out

    def _switch_fit(self, n: int, need: int, out: list[int]) -> bool:
        """Whole free nodes under the fullest switch that fits ``need`` GPUs
        (appended to ``out``); False if no switch has room."""
        c = self.cluster
        whole = -(-need // c.max_gpus_per_node)
        counts = self.counts()
        per_switch: dict[int, list[int]] = defaultdict(list)
        for node in counts:
            per_switch[c.switch_of_node(node)].append(node)
        best = None
        for sw, nodes in per_switch.items():
            cap = sum(map(counts.__getitem__, nodes))
            if cap >= need and (best is None or cap < best[0]):
                best = (cap, sw)
        if best is None:
            return False
        nodes = sorted(per_switch[best[1]], key=lambda x: (-counts[x], x))
        for node in nodes[: max(whole, 1)]:
            out += self.take(node, n - len(out))
        for node in nodes[whole:]:
            if len(out) == n:
                break
            if self.has(node):
                out += self.take(node, n - len(out))
        return len(out) == n


def place_consolidated(snap: Snapshot, allocation: dict[str, int]) -> dict[str, tuple[int, ...]]:
    held, sizes = snap.held, snap.sizes
    c = snap.cluster
    fmap = FreeMap(c, free=snap.free, by_free=snap.by_free)
    if sizes.items() <= allocation.items():
        placement = dict(held)  # every job holding GPUs keeps its count: only the others are placed
    elif allocation.items() <= sizes.items():
        # every allocated job keeps its count (the others stop): keep every placement
        return dict(zip(allocation, map(held.__getitem__, allocation)))
    else:
        # jobs that keep their GPUs, then those that stop or shrink (in snapshot order)
        keep = list(compress(allocation, map(eq, allocation.values(), map(sizes.get, allocation))))
        placement = dict(zip(keep, map(held.__getitem__, keep)))
        _release(snap, allocation, placement, fmap)
    # grow and start, biggest first
    todo = [(jid, allocation[jid]) for jid in allocation.keys() - placement.keys() if allocation[jid] > 0]
    todo.sort(key=lambda x: (-x[1], x[0]))
    for jid, n in todo:
        have = held.get(jid, ())
        if have:
            nodes = sorted({c.node_of(g) for g in have})
            extra = fmap.best_fit(n - len(have), prefer_nodes=nodes)
            placement[jid] = tuple(sorted((*have, *extra)))
        else:
            placement[jid] = tuple(sorted(fmap.best_fit(n)))
    return placement


def _release(snap: Snapshot, allocation: dict[str, int], placement: dict[str, tuple[int, ...]], fmap: FreeMap) -> None:
    """Preempted jobs give back their GPUs; shrinking jobs give back GPUs on
    their least-used nodes and keep the rest (recorded in ``placement``)."""
    sizes, aget = snap.sizes, allocation.get
    node_of = snap.cluster.node_of
    for view in snap.in_order({jid for jid in sizes.keys() - placement.keys() if aget(jid, 0) < sizes[jid]}):
        jid, gpus = view.spec.job_id, view.gpus
        want = aget(jid, 0)
        if want == 0:
            fmap.give(list(gpus))
            continue
        per_node: dict[int, list[int]] = {}
        for g in gpus:
            per_node.setdefault(node_of(g), []).append(g)
        order = sorted(per_node.values(), key=len)
        give: list[int] = []
        extra = len(gpus) - want
        for grp in order:
            take = grp[:extra - len(give)]
            give += take
            if len(give) == extra:
                break
        fmap.give(give)
        placement[jid] = tuple(sorted(set(gpus) - set(give)))
