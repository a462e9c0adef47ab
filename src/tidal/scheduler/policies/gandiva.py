"""Gandiva: introspective packing and migration for rigid DL jobs.

Xiao et al., "Gandiva: Introspective Cluster Scheduling for Deep Learning",
OSDI'18. §4.1 (mechanisms: suspend-resume / time-slicing, packing,
migration) and §4.2 (scheduling policy): in the reactive mode nodes take an
*affinity* for the job size they host; a new job goes to a node of its own
affinity, else to a free node, else affinity is relaxed; in the introspective
mode, when fragmentation keeps a job from getting GPUs on one node, running
jobs are *migrated* to make room (defragmentation), and a job that had to be
spread is migrated back onto one node once that is possible (locality).

ElasticFlow's evaluation (§6.1) runs Gandiva as a rigid, deadline-unaware
baseline: jobs start in submission order at their requested count, and a job
that does not fit is skipped, not blocking later ones. As run here, per round:

    allocation: running jobs keep their GPUs (non-preemptive);
                waiting jobs, oldest first, start if their count fits the free GPUs
    placement, for each starting job of n GPUs:
        n <= GPUs/node: a node of affinity {n} with room (best fit),
                        else an empty node, else any node with room (best fit),
                        else migrate: on the node where the fewest GPUs (then jobs)
                        must move, move jobs to other nodes (one node each) — then
                        place; else spread over the most-free nodes
        n >  GPUs/node: whole empty nodes (one switch if possible) + best-fit
                        remainder, else vacate the least-used nodes by migration,
                        else spread
        introspection:  a spread job of <= GPUs/node moves to one node when one has room

The simulator charges each moved job its migration overhead (same count, new
GPUs). Gandiva's GPU time-slicing and memory-sharing packing (several jobs on
one GPU) are not modelled: the simulator gives a GPU to one job at a time.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import combinations

from tidal.core.topology import Cluster
from tidal.scheduler.api import Plan, Policy, Snapshot
from tidal.scheduler.estimate import keep_running
from tidal.scheduler.policies.themis import runnable_count

_MAX_SUBSET_JOBS = 10  # jobs considered for moving off one node (2^10 subsets at most)


def gandiva_allocation(snap: Snapshot, plan: Plan) -> None:
    """Running jobs keep their count; waiting jobs start oldest first if they fit."""
    free, queue = keep_running(snap, plan)
    for j in queue:
        n = runnable_count(snap, j)
        if 0 < n <= free:
            plan.allocation[j.job_id] = n
            free -= n


class _Layout:
    """Who holds which GPU, node by node, while a round's placement is built."""

    def __init__(self, cluster: Cluster) -> None:
        self.c = cluster
        self.owner: dict[int, str] = {}
        self.gpus: dict[str, list[int]] = {}
        self.size: dict[str, int] = {}
        self._free = {node: cluster.node_gpus(node) for node in range(cluster.num_nodes)}  # GPUs no one owns

    def hold(self, jid: str, gpus: list[int]) -> None:
        self.gpus[jid] = sorted(gpus)
        self.size[jid] = len(gpus)
        owner, free, node_of = self.owner, self._free, self.c.node_of
        for g in gpus:
            if g not in owner:
                free[node_of(g)] -= 1
            owner[g] = jid

    def release(self, jid: str) -> list[int]:
        gpus = self.gpus.pop(jid)
        owner, free, node_of = self.owner, self._free, self.c.node_of
        for g in gpus:
            del owner[g]
            free[node_of(g)] += 1
        return gpus

    def free_on(self, node: int) -> list[int]:
        return [g for g in self.c.gpus_of_node(node) if g not in self.owner]

    def jobs_on(self, node: int) -> set[str]:
        return {self.owner[g] for g in self.c.gpus_of_node(node) if g in self.owner}

    def affinity(self, node: int) -> set[int]:
        return {self.size[jid] for jid in self.jobs_on(node)}

    def local(self, jid: str) -> bool:
        """The job's GPUs are all on one node."""
        return len({self.c.node_of(g) for g in self.gpus[jid]}) == 1

    # -- choosing nodes ---------------------------------------------------------
    def pick_node(self, n: int, free_count: dict[int, int], exclude: frozenset[int] = frozenset()) -> int | None:
        """Node for a job of ``n`` GPUs: same affinity, then empty, then any;
        best fit (fewest free GPUs) within each class."""
        best = None
        for node, f in free_count.items():
            if node in exclude or f < n:
                continue
            aff = self.affinity(node)
            cls = 0 if aff == {n} else 1 if not aff else 2
            key = (cls, f, node)
            if best is None or key < best:
                best = key
        return best[2] if best else None

    def free_counts(self) -> dict[int, int]:
        """Free GPUs per node (a copy: callers change it)."""
        return dict(self._free)

    def relocate(self, movers: list[str], exclude: frozenset[int]) -> dict[str, int] | None:
        """Target node for each mover (largest first), none in ``exclude``; None if impossible."""
        counts = self.free_counts()
        out: dict[str, int] = {}
        for jid in sorted(movers, key=lambda x: (-self.size[x], x)):
            node = self.pick_node(self.size[jid], counts, exclude)
            if node is None:
                return None
            counts[node] -= self.size[jid]
            out[jid] = node
        return out

    def move(self, targets: dict[str, int]) -> None:
        for jid in targets:
            self.release(jid)
        for jid, node in sorted(targets.items(), key=lambda x: (-self.size[x[0]], x[0])):
            self.hold(jid, self.free_on(node)[: self.size[jid]])

    # -- placing one job ----------------------------------------------------------
    def place_small(self, jid: str, n: int, migrate: bool) -> bool:
        node = self.pick_node(n, self.free_counts())
        if node is None and migrate:
            node = self.defragment_node(n)
        if node is None:
            return False
        self.hold(jid, self.free_on(node)[:n])
        return True

    def defragment_node(self, n: int) -> int | None:
        """Free ``n`` GPUs on one node by moving the fewest GPUs (then jobs)."""
        counts = self.free_counts()
        best: tuple[tuple[int, int, int], dict[str, int]] | None = None
        for node in range(self.c.num_nodes):
            need = n - counts[node]
            if need <= 0:
                continue
            movable = sorted(j for j in self.jobs_on(node) if self.local(j))
            if sum(self.size[j] for j in movable) < need or len(movable) > _MAX_SUBSET_JOBS:
                continue
            options = []
            for k in range(1, len(movable) + 1):
                for sub in combinations(movable, k):
                    moved = sum(self.size[j] for j in sub)
                    if moved >= need:
                        options.append((moved, k, sub))
            for moved, k, sub in sorted(options):
                if best is not None and (moved, k, node) >= best[0]:
                    break
                targets = self.relocate(list(sub), frozenset({node}))
                if targets is not None:
                    best = ((moved, k, node), targets)
                    break
        if best is None:
            return None
        self.move(best[1])
        return best[0][2]

    def place_large(self, jid: str, n: int, migrate: bool) -> bool:
        whole = n // self.c.max_gpus_per_node
        counts = self.free_counts()
        nodes = self._whole_nodes(whole, counts)
        if nodes is not None:
            gpus = [g for node in nodes for g in self.c.gpus_of_node(node)]
            rest = n - len(gpus)  # n % GPUs per node on nodes of one size
            if rest:
                node = self.pick_node(rest, counts, frozenset(nodes))
                if node is None:
                    nodes = None
                else:
                    gpus += self.free_on(node)[:rest]
            if nodes is not None:
                self.hold(jid, gpus)
                return True
        if migrate and self.vacate_nodes(n):
            return self.place_large(jid, n, migrate=False) or self._spread(jid, n)
        return False

    def _whole_nodes(self, k: int, counts: dict[int, int]) -> list[int] | None:
        empty: dict[int, list[int]] = defaultdict(list)
        for node, f in counts.items():
            if f == self.c.node_gpus(node):
                empty[self.c.switch_of_node(node)].append(node)
        fits = sorted((len(v), sw) for sw, v in empty.items() if len(v) >= k)
        if fits:
            return sorted(empty[fits[0][1]])[:k]
        pool = sorted(node for v in empty.values() for node in v)
        return pool[:k] if len(pool) >= k else None

    def vacate_nodes(self, n: int) -> bool:
        """Empty the ``n // GPUs-per-node`` least-used nodes (holding no part of
        a multi-node job) by moving their jobs to other nodes (Gandiva's
        defragmentation); the remainder then goes best-fit."""
        whole = n // self.c.max_gpus_per_node
        counts = self.free_counts()
        cands = [node for node in range(self.c.num_nodes) if all(self.local(j) for j in self.jobs_on(node))]
        cands.sort(key=lambda node: (-counts[node], node))
        chosen = cands[:whole]
        if len(chosen) < whole:
            return False
        movers = sorted({j for node in chosen for j in self.jobs_on(node)})
        targets = self.relocate(movers, frozenset(chosen))
        if targets is None:
            return False
        self.move(targets)
        return True

    def _spread(self, jid: str, n: int) -> bool:
        counts = self.free_counts()
        gpus: list[int] = []
        for node in sorted(counts, key=lambda x: (-counts[x], x)):
            gpus += self.free_on(node)[: n - len(gpus)]
            if len(gpus) == n:
                self.hold(jid, gpus)
                return True
        return False

    def place(self, jid: str, n: int, migrate: bool) -> None:
        small = n <= self.c.max_gpus_per_node
        ok = self.place_small(jid, n, migrate) if small else self.place_large(jid, n, migrate)
        if not ok and not self._spread(jid, n):
            raise ValueError(f"cannot place {n} GPUs for {jid}")

    def consolidate(self, jid: str) -> None:
        """Introspection: move a spread single-node-sized job onto one node."""
        n = self.size[jid]
        mine = self.release(jid)
        node = self.pick_node(n, self.free_counts())
        self.hold(jid, self.free_on(node)[:n] if node is not None else mine)


def gandiva_placement(snap: Snapshot, allocation: dict[str, int], migrate: bool = True) -> dict[str, tuple[int, ...]]:
    lay = _Layout(snap.cluster)
    for j in snap.jobs:
        if j.gpus and allocation.get(j.job_id, 0) == j.size:
            lay.hold(j.job_id, list(j.gpus))
    for jid, n in allocation.items():  # allocation order: running, then FIFO
        if n > 0 and jid not in lay.gpus:
            lay.place(jid, n, migrate)
    if migrate:
        per = snap.cluster.max_gpus_per_node
        for jid in sorted(lay.gpus):
            if lay.size[jid] <= per and not lay.local(jid):
                lay.consolidate(jid)
    return {jid: tuple(g) for jid, g in lay.gpus.items()}


class Gandiva(Policy):
    """Rigid FIFO-with-skip, affinity packing and migration (Gandiva, OSDI'18 §4.1-4.2)."""

    def __init__(self, migrate: bool = True) -> None:
        self.migrate = migrate

    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        gandiva_allocation(snap, plan)

    def placement(self, snap: Snapshot, plan: Plan) -> None:
        plan.placement = gandiva_placement(snap, plan.allocation, self.migrate)
