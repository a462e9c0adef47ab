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
from typing import TYPE_CHECKING

from tidal.core.topology import Cluster

if TYPE_CHECKING:
    from tidal.scheduler.api import Snapshot


class FreeMap:
    """Free GPUs per node, for best-fit searches."""

    def __init__(self, cluster: Cluster, used: set[int]) -> None:
        self.cluster = cluster
        self.by_node: dict[int, list[int]] = defaultdict(list)
        per = cluster.gpus_per_node
        busy = {g // per for g in used}
        for node in range(cluster.num_nodes):
            base = node * per
            if node not in busy:
                self.by_node[node] = list(range(base, base + per))
                continue
            free = [g for g in range(base, base + per) if g not in used]
            if free:
                self.by_node[node] = free

    def total(self) -> int:
        return sum(len(v) for v in self.by_node.values())

    def take(self, node: int, k: int) -> list[int]:
        gpus = self.by_node[node]
        out, self.by_node[node] = gpus[:k], gpus[k:]
        if not self.by_node[node]:
            del self.by_node[node]
        return out

    def give(self, gpus: list[int]) -> None:
        for g in gpus:
            self.by_node[self.cluster.node_of(g)].append(g)
        for node in {self.cluster.node_of(g) for g in gpus}:
            self.by_node[node].sort()

    def best_fit(self, n: int, prefer_nodes: list[int] | None = None) -> list[int]:
        """Pick ``n`` free GPUs as consolidated as possible."""
        c = self.cluster
        out: list[int] = []
        for node in prefer_nodes or ():
            if len(out) == n:
                break
            if node in self.by_node:
                out += self.take(node, n - len(out))
        need = n - len(out)
        if need == 0:
            return out
        if need <= c.gpus_per_node:
            fits = [(len(v), node) for node, v in self.by_node.items() if len(v) >= need]
            if fits:
                _, node = min(fits)
                return out + self.take(node, need)
        else:
            whole = -(-need // c.gpus_per_node)
            per_switch: dict[int, list[int]] = defaultdict(list)
            for node, v in self.by_node.items():
                per_switch[c.switch_of_node(node)].append(node)
            best = None
            for sw, nodes in per_switch.items():
                cap = sum(len(self.by_node[x]) for x in nodes)
                if cap >= need and (best is None or cap < best[0]):
                    best = (cap, sw)
            if best is not None:
                nodes = sorted(per_switch[best[1]], key=lambda x: (-len(self.by_node[x]), x))
                for node in nodes[: max(whole, 1)]:
                    out += self.take(node, n - len(out))
                for node in nodes[whole:]:
                    if len(out) == n:
                        break
                    if node in self.by_node:
                        out += self.take(node, n - len(out))
                if len(out) == n:
                    return out
        # spread: most-free nodes first
        for node in sorted(self.by_node, key=lambda x: (-len(self.by_node[x]), x)):
            if len(out) == n:
                break
            out += self.take(node, n - len(out))
        if len(out) < n:
            raise ValueError(f"cannot place {n} GPUs: only {len(out)} free")
        return out


def place_consolidated(snap: Snapshot, allocation: dict[str, int]) -> dict[str, tuple[int, ...]]:
    c = snap.cluster
    current = {j.job_id: j.gpus for j in snap.jobs if j.gpus}
    if all(len(current.get(jid, ())) == n for jid, n in allocation.items() if n > 0) and all(
        allocation.get(jid, 0) in (0, len(g)) for jid, g in current.items()
    ):
        # nothing grows, shrinks or starts: keep every placement
        return {jid: current[jid] for jid, n in allocation.items() if n > 0}
    placement: dict[str, tuple[int, ...]] = {}
    used: set[int] = set()
    for gpus in current.values():
        used.update(gpus)
    fmap = FreeMap(c, used)
    # 1. release: preempted jobs, then shrinking jobs give back least-used nodes
    for jid, gpus in current.items():
        want = allocation.get(jid, 0)
        if want == 0:
            fmap.give(list(gpus))
        elif want < len(gpus):
            per_node: dict[int, list[int]] = defaultdict(list)
            for g in gpus:
                per_node[c.node_of(g)].append(g)
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
        elif want == len(gpus):
            placement[jid] = tuple(gpus)
    # 2. grow and start, biggest first
    todo = [
        (jid, n) for jid, n in allocation.items() if n > 0 and jid not in placement
    ]
    todo.sort(key=lambda x: (-x[1], x[0]))
    for jid, n in todo:
        have = current.get(jid, ())
        if have:
            nodes = sorted({c.node_of(g) for g in have})
            extra = fmap.best_fit(n - len(have), prefer_nodes=nodes)
            placement[jid] = tuple(sorted((*have, *extra)))
        else:
            placement[jid] = tuple(sorted(fmap.best_fit(n)))
    return placement
