"""GPU types for heterogeneity-aware policies: rates per (job, type, count),
the GPU types a job may use, and placement on nodes of chosen types.

A heterogeneity-aware policy (Gavel, OSDI'20; Sia, SOSP'23) decides for each
job a *configuration*: a GPU type and a count. :func:`place_typed` turns those
into GPU ids: a job that keeps its type and count keeps its GPUs, a shrinking
job gives back GPUs on its least-used nodes, a growing one first takes GPUs on
the nodes it uses, and a new or moved one takes the fullest node of its types
that fits it (best fit), else whole nodes, most free first. A job may be given
several types (a type-blind policy gives every type the job allows); it then
takes the best fit among all their nodes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Mapping, Sequence

from tidal.core.job import JobSpec
from tidal.core.topology import Cluster
from tidal.scheduler.api import Snapshot

log = logging.getLogger(__name__)

ANY = "*"  # the one pool of a type-blind policy


@dataclass(frozen=True)
class ClusterTypes:
    """A cluster's GPU types: how many GPUs of each (worked out once per cluster)."""

    capacity: dict[str, int]  # type -> GPUs, types in first-seen order


_LAST: list[tuple[Cluster, ClusterTypes]] = []  # the last cluster asked for (hashing a cluster costs)


def cluster_types(cluster: Cluster) -> ClusterTypes:
    """The :class:`ClusterTypes` of ``cluster`` (cached)."""
    if _LAST and _LAST[0][0] is cluster:
        return _LAST[0][1]
    out = _cluster_types(cluster)
    _LAST[:] = [(cluster, out)]
    return out


@lru_cache(maxsize=32)
def _cluster_types(cluster: Cluster) -> ClusterTypes:
    cap: dict[str, int] = {}
    for node in cluster.nodes:
        cap[node.gpu_type] = cap.get(node.gpu_type, 0) + node.gpus
    return ClusterTypes(cap)


def allowed_types(spec: JobSpec, cluster: Cluster) -> tuple[str, ...]:
    """The cluster's GPU types ``spec`` may run on (its constraints honoured)."""
    if not spec.constrained:
        return cluster.gpu_types
    return tuple(t for t in cluster.gpu_types if spec.allows_type(t))


def typed_rate(snap: Snapshot, spec: JobSpec, gpu_type: str, n: int) -> float:
    """Progress (the spec's iterations/s) of ``spec`` on ``n`` GPUs of
    ``gpu_type`` placed on as few nodes as that type allows: the simulator's
    rate (such a placement is not spread: it spans no more nodes than its
    own type needs). ``gpu_type`` :data:`ANY`: the default profile
    (what a type-blind policy believes)."""
    if n <= 0:
        return 0.0
    prof = snap.profiles
    if gpu_type == ANY:
        return prof.throughput(spec.model, spec.batch_size, n)
    return prof.typed(gpu_type, spec.model).throughput(spec.model, spec.batch_size, n)


class TypedFree:
    """Free GPUs per node while a plan is placed, with each type's nodes
    bucketed by free count for best-fit searches."""

    def __init__(self, cluster: Cluster, free: Sequence[Sequence[int]]) -> None:
        self.cluster = cluster
        self.per = cluster.max_gpus_per_node
        self.free: list[list[int]] = [list(f) for f in free]
        self.type_of = [n.gpu_type for n in cluster.nodes]
        self.buckets: dict[str, list[set[int]]] = {t: [set() for _ in range(self.per + 1)] for t in cluster.gpu_types}
        self.count: dict[str, int] = dict.fromkeys(cluster.gpu_types, 0)
        for node, gpus in enumerate(self.free):
            t = self.type_of[node]
            self.buckets[t][len(gpus)].add(node)
            self.count[t] += len(gpus)

    def _set(self, node: int, gpus: list[int]) -> None:
        t = self.type_of[node]
        old = self.free[node]
        self.buckets[t][len(old)].discard(node)
        self.buckets[t][len(gpus)].add(node)
        self.count[t] += len(gpus) - len(old)
        self.free[node] = gpus

    def take(self, node: int, k: int) -> list[int]:
        gpus = self.free[node]
        self._set(node, gpus[k:])
        return gpus[:k]

    def give(self, gpus: Iterable[int]) -> None:
        node_of = self.cluster.node_of
        per_node: dict[int, list[int]] = {}
        for g in gpus:
            per_node.setdefault(node_of(g), []).append(g)
        for node, add in per_node.items():
            self._set(node, sorted(self.free[node] + add))

    def best_fit(self, n: int, types: Iterable[str], prefer: Iterable[int] = ()) -> list[int] | None:
        """``n`` free GPUs on nodes of ``types``: first on ``prefer`` nodes,
        then the fullest single node that fits the rest, else whole nodes,
        most free first. ``None`` (nothing taken) if they have fewer free."""
        types = [t for t in dict.fromkeys(types) if t in self.buckets]
        if sum(self.count[t] for t in types) < n:
            return None
        out: list[int] = []
        for node in prefer:
            if len(out) < n and self.free[node] and self.type_of[node] in types:
                out += self.take(node, n - len(out))
        need = n - len(out)
        if need == 0:
            return out
        best = None
        for k in range(need, self.per + 1):
            for t in types:
                b = self.buckets[t][k]
                if b:
                    node = min(b)
                    best = node if best is None else min(best, node)
            if best is not None:
                return out + self.take(best, need)
        nodes = [(-len(self.free[nd]), nd) for t in types for k in range(1, self.per + 1) for nd in self.buckets[t][k]]
        for _, node in sorted(nodes):
            if len(out) == n:
                break
            out += self.take(node, n - len(out))
        return out


def place_typed(snap: Snapshot, want: Mapping[str, tuple[tuple[str, ...], int]]) -> dict[str, tuple[int, ...]]:
    """GPU ids for ``want`` (job -> (GPU types it may use, count)). Jobs left
    out, or whose GPUs are not all of their types, give back what they hold;
    a job that cannot be placed is left out of the result (it waits)."""
    c = snap.cluster
    fmap = TypedFree(c, snap.free)
    type_of = c.gpu_type_of
    placement: dict[str, tuple[int, ...]] = {}
    grow: dict[str, tuple[int, ...]] = {}
    for jid, gpus in sorted(snap.held.items()):
        w = want.get(jid)
        if w is None or any(type_of(g) not in w[0] for g in gpus):
            fmap.give(gpus)
        elif len(gpus) == w[1]:
            placement[jid] = gpus
        elif len(gpus) > w[1]:
            placement[jid] = _shrink(c, gpus, w[1], fmap)
        else:
            grow[jid] = gpus
    todo = sorted((jid for jid in want if jid not in placement), key=lambda j: (len(want[j][0]), -want[j][1], j))
    for jid in todo:
        types, n = want[jid]
        have = grow.get(jid, ())
        if n <= 0:
            continue
        extra = fmap.best_fit(n - len(have), types, prefer=sorted({c.node_of(g) for g in have}))
        if extra is not None:
            placement[jid] = tuple(sorted((*have, *extra)))
        elif have:
            placement[jid] = have  # no room to grow: it keeps what it holds
        else:
            log.debug("job %s: no room for %d GPUs of %s", jid, n, types)
    return placement


def _shrink(c: Cluster, gpus: tuple[int, ...], n: int, fmap: TypedFree) -> tuple[int, ...]:
    """Keep ``n`` of ``gpus``, giving back those on the least-used nodes."""
    per_node: dict[int, list[int]] = {}
    for g in gpus:
        per_node.setdefault(c.node_of(g), []).append(g)
    give: list[int] = []
    extra = len(gpus) - n
    for grp in sorted(per_node.values(), key=lambda x: (len(x), x[0])):
        give += grp[: extra - len(give)]
        if len(give) == extra:
            break
    fmap.give(give)
    return tuple(sorted(set(gpus) - set(give)))
