"""Elastic-Tiresias: Tiresias plus compaction and expansion.

Wu et al., "Elastic Deep Learning in Multi-Tenant GPU Clusters" (EDL, TPDS
2021), §5.1, Algorithm 1. Every round:

1. **Tiresias** (:func:`tidal.scheduler.policies.tiresias.tiresias_allocation`):
   discretised 2D-LAS over queues G_0, G_1, G_2 (quanta 500 and 10,000 GPU·s);
   running jobs keep their current count, waiting jobs ask for their
   requested count P_j.
2. **Compaction**, when more than ``max_waiting`` (N = 10) jobs still wait:
   for each waiting job in Tiresias order, find P_j GPUs on at most
   ⌈P_j/m⌉ machines (m GPUs per machine; the locality rule) made of free GPUs
   and GPUs released by scaling in the elastic jobs of G_i, i ≠ 0 that this
   round runs (a job of G_i about to resume counts too: it resumes smaller), each
   keeping p_j − r_j ≥ min_j. The r_j are chosen to maximise the gain in GPU
   efficiency: GPUs are released one at a time from the job whose throughput
   (normalised by its one-GPU throughput) drops least, and the compaction is
   done only if the waiting job's normalised throughput exceeds the total
   loss. Compaction stops once at most N jobs wait.
3. **Expansion**, when no job waits: each free GPU goes to the running
   elastic job with the largest relative throughput gain
   (S(p_j+1) − S(p_j)) / S(p_j) > 0, up to its max count; by the locality
   rule a job takes a GPU on a machine it already uses unless its new count
   needs one more machine.

Jobs marked inelastic (``JobSpec.elastic`` False) are neither compacted nor
expanded. The policy places GPUs itself (it needs machine-level free lists).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import defaultdict

from tidal.scheduler.api import JobView, Plan, Policy, Snapshot
from tidal.scheduler.estimate import rigid_count
from tidal.scheduler.placement import place_consolidated
from tidal.scheduler.policies.tiresias import queue_of, tiresias_allocation


def _speed(snap: Snapshot, job: JobView, n: int) -> float:
    """Throughput normalised by the one-GPU throughput (a job's speedup)."""
    one = snap.throughput(job, 1)
    return snap.throughput(job, n) / one if one > 0 else 0.0


def _next_down(job: JobView, n: int) -> int:
    """The next smaller count the job may run at (0 if none)."""
    spec = job.spec
    if spec.allowed_gpus is not None:
        i = bisect.bisect_left(spec.allowed_gpus, n)
        return spec.allowed_gpus[i - 1] if i > 0 else 0
    return n - 1 if spec.elastic and n - 1 >= spec.lo else 0


def _next_up(job: JobView, n: int, cap: int) -> int:
    """The next larger count the job may run at, at most ``cap`` (0 if none)."""
    spec = job.spec
    if spec.allowed_gpus is not None:
        i = bisect.bisect_right(spec.allowed_gpus, n)
        return spec.allowed_gpus[i] if i < len(spec.allowed_gpus) and spec.allowed_gpus[i] <= cap else 0
    return n + 1 if spec.elastic and n + 1 <= spec.hi(cap) else 0


class _State:
    """GPU ids per job and free GPUs per machine while the plan is edited."""

    def __init__(self, snap: Snapshot, placement: dict[str, tuple[int, ...]]) -> None:
        c = snap.cluster
        self.m = c.max_gpus_per_node  # the paper's m, GPUs per machine (the largest, with mixed sizes)
        self.node_of = c.node_of
        self.gpus: dict[str, list[int]] = {jid: sorted(g) for jid, g in placement.items()}
        used = {g for gs in placement.values() for g in gs}
        self.free: dict[int, list[int]] = defaultdict(list)
        if len(used) < c.num_gpus:
            for g in sorted(c.all_gpus - used):
                self.free[self.node_of(g)].append(g)

    def on_node(self, jid: str) -> dict[int, list[int]]:
        out: dict[int, list[int]] = defaultdict(list)
        for g in self.gpus[jid]:
            out[self.node_of(g)].append(g)
        return out


class _Speeds:
    """:func:`_speed` memoised by (job, count) for one round."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        self._memo: dict[tuple[str, int], float] = {}

    def __call__(self, job: JobView, n: int) -> float:
        key = (job.job_id, n)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = _speed(self.snap, job, n)
        return hit


def _donor_releases(
    speed: _Speeds, d: JobView, n: int, on: dict[int, list[int]], nodes: set[int] | None
) -> dict[int, list[tuple[float, str]]]:
    """One donor's releases per machine, each with the drop in its normalised
    throughput; one GPU at a time, down to its min count, counting its
    releases over all ``nodes`` together (``None``: each machine from p_j)."""
    out: dict[int, list[tuple[float, str]]] = {}
    cur = n
    for node, gs in sorted(on.items(), key=lambda x: (len(x[1]), x[0])):
        if nodes is not None and node not in nodes:
            continue
        got = []
        for _ in gs:
            down = _next_down(d, cur)
            if down != cur - 1 or down < d.spec.lo:
                break
            got.append((speed(d, cur) - speed(d, down), d.job_id))
            cur = down
        if got:
            out[node] = got
        if nodes is None:
            cur = n  # machines are alternatives: count each from p_j
    return out


class _Releases:
    """Per machine, the GPUs donors could release (sorted by loss), kept up
    to date as compaction scales donors in: only changed donors are redone."""

    def __init__(self, snap: Snapshot, st: _State, donors: dict[str, JobView]) -> None:
        self.st, self.donors = st, donors
        self.speed = _Speeds(snap)
        self.nodes_of: dict[str, dict[int, list[int]]] = {}
        self.on: dict[int, set[str]] = defaultdict(set)  # machine -> donors with GPUs there
        self.per_node: dict[int, list[tuple[float, str]]] = defaultdict(list)
        for jid in donors:
            self._add(jid)
        for v in self.per_node.values():
            v.sort()

    def _add(self, jid: str) -> set[int]:
        on = self.nodes_of[jid] = self.st.on_node(jid)
        for node in on:
            self.on[node].add(jid)
        got = _donor_releases(self.speed, self.donors[jid], len(self.st.gpus[jid]), on, None)
        for node, entries in got.items():
            self.per_node[node].extend(entries)
        return set(got)

    def changed(self, jids: set[str]) -> set[int]:
        """Donors ``jids`` gave GPUs away; returns the machines whose
        releases changed."""
        nodes: set[int] = set()
        for jid in jids:
            for node in self.nodes_of[jid]:
                self.on[node].discard(jid)
                nodes.add(node)
        for node in nodes:
            self.per_node[node] = [e for e in self.per_node[node] if e[1] not in jids]
        for jid in jids:
            nodes |= self._add(jid)
        for node in nodes:
            self.per_node[node].sort()
        return nodes

    def within(self, nodes: set[int]) -> list[tuple[float, int, str]]:
        """(loss, machine, donor) of the releases over ``nodes`` together, sorted."""
        jids = set().union(*(self.on.get(n, ()) for n in nodes))
        return sorted(
            (loss, node, jid)
            for jid in jids
            for node, v in _donor_releases(
                self.speed, self.donors[jid], len(self.st.gpus[jid]), self.nodes_of[jid], nodes
            ).items()
            for loss, _ in v
        )


class _Options:
    """Per machine, the GPUs a waiting job could get there (free ones plus
    releases, at most m) and the free ones; and per count p, each machine's
    cost of giving p GPUs (the cheapest releases beyond its free GPUs). Kept
    up to date machine by machine as compaction changes them."""

    def __init__(self, st: _State, per_node: dict[int, list[tuple[float, str]]]) -> None:
        self.st, self.per_node = st, per_node
        self.avail: dict[int, tuple[int, int, int]] = {}  # machine -> (GPUs available, free, machine)
        self.cost: dict[int, dict[int, tuple[float, int, int]]] = {}  # p -> machine -> (loss, -free, machine)
        self.update(set(st.free) | set(per_node))

    def update(self, nodes: set[int]) -> None:
        """Machines ``nodes`` changed."""
        for node in nodes:
            free = len(self.st.free.get(node, ()))
            avail = min(self.st.m, free + len(self.per_node.get(node, ())))
            if avail:
                self.avail[node] = (avail, free, node)
            else:
                self.avail.pop(node, None)
            for p, costs in self.cost.items():
                self._cost(p, costs, node)

    def _cost(self, p: int, costs: dict[int, tuple[float, int, int]], node: int) -> None:
        o = self.avail.get(node)
        if o is None or o[0] < p:
            costs.pop(node, None)
            return
        free = o[1]
        costs[node] = (sum(x[0] for x in self.per_node.get(node, [])[: max(0, p - free)]), -free, node)

    def machines(self, p: int) -> list[int]:
        """The machines a waiting job of ``p`` GPUs would use: on one machine,
        the one that gives p GPUs with the least loss; else the fewest
        machines (⌈p/m⌉) with the most GPUs available. Empty if they do not
        suffice."""
        k = math.ceil(p / self.st.m)
        if k == 1:
            costs = self.cost.get(p)
            if costs is None:
                costs = self.cost[p] = {}
                for node in self.avail:
                    self._cost(p, costs, node)
            return [min(costs.values())[2]] if costs else []
        top = sorted(self.avail.values(), key=lambda o: (-o[0], -o[1], o[2]))[:k]
        return [o[2] for o in top] if sum(o[0] for o in top) >= p else []


def compaction(
    snap: Snapshot, plan: Plan, st: _State, waiting: list[JobView], donors: dict[str, JobView], max_waiting: int
) -> None:
    """EDL Algorithm 1, compaction: start waiting jobs on GPUs released by
    scaling in ``donors`` (running elastic jobs of G_i, i != 0). Until a
    compaction is done nothing it reads changes, so the machines, GPUs and
    releases found for a count serve every waiting job of that count (only
    the job's own throughput, set against the loss, differs)."""
    left = len(waiting)
    rel = _Releases(snap, st, donors)
    options = _Options(st, rel.per_node)
    found: dict[int, tuple[list[int], list[int], list[tuple[float, int, str]], float] | None] = {}
    for w in waiting:
        if left <= max_waiting:
            break
        p = rigid_count(w.spec, snap.cluster.num_gpus)
        if p not in found:
            found[p] = None
            chosen = options.machines(p)
            if chosen:
                # free GPUs first, then the cheapest releases over the chosen machines
                take: list[int] = []
                for node in chosen:
                    take += st.free.get(node, [])[: p - len(take)]
                need = p - len(take)
                releases = rel.within(set(chosen))[:need]
                if len(releases) >= need:
                    found[p] = (chosen, take, releases, sum(x[0] for x in releases))
        hit = found[p]
        if hit is None or rel.speed(w, p) <= hit[3]:
            continue
        chosen, take, releases, _ = hit
        take = list(take)
        found.clear()  # the machines change only when a compaction is done
        taken = set(take)
        for node in chosen:
            st.free[node] = [g for g in st.free.get(node, []) if g not in taken]
        picked: dict[tuple[str, int], int] = defaultdict(int)
        for _, node, jid in releases:
            picked[(jid, node)] += 1
        for (jid, node), r in sorted(picked.items()):
            give = st.on_node(jid)[node][-r:]
            take += give
            gone = set(give)
            st.gpus[jid] = [g for g in st.gpus[jid] if g not in gone]
            plan.allocation[jid] = len(st.gpus[jid])
        options.update(rel.changed({jid for jid, _ in picked}) | set(chosen))
        st.gpus[w.job_id] = sorted(take)
        plan.allocation[w.job_id] = p
        left -= 1


def expansion(snap: Snapshot, plan: Plan, st: _State, jobs: list[JobView]) -> None:
    """EDL Algorithm 1, expansion: each free GPU to the running job with the
    largest relative throughput gain, under the locality rule."""
    m = st.m
    cap = snap.cluster.num_gpus
    heap: list[tuple[float, str, int]] = []
    by_id = {j.job_id: j for j in jobs}

    def push(j: JobView) -> None:
        n = len(st.gpus[j.job_id])
        up = _next_up(j, n, cap)
        if not up:
            return
        s = snap.throughput(j, n)
        gain = (snap.throughput(j, up) - s) / s / (up - n) if s > 0 else 0.0
        if gain > 1e-12:
            heapq.heappush(heap, (-gain, j.job_id, up))

    free = sum(len(v) for v in st.free.values())
    if not free:
        return
    # only jobs on a machine with free GPUs, or whose next count needs one more
    # machine, can grow (free GPUs only get fewer below)
    owner = {g: jid for jid, gs in st.gpus.items() for g in gs}
    near = {owner[g] for node, f in st.free.items() if f for g in snap.cluster.gpus_of_node(node) if g in owner}
    for j in jobs:
        n = len(st.gpus[j.job_id])
        if j.job_id in near or n % m == 0:
            push(j)
    while heap and free > 0:
        _, jid, up = heapq.heappop(heap)
        n = len(st.gpus[jid])
        need = up - n
        mine = st.on_node(jid)
        got: list[int] = []
        for node in sorted(mine, key=lambda x: (-len(st.free.get(x, ())), x)):
            got += st.free.get(node, [])[: need - len(got)]
        if len(got) < need:
            # a new machine only when the new count needs one more (locality)
            for _ in range(math.ceil(up / m) - len(mine)):
                others = [(len(f), -node) for node, f in st.free.items() if f and node not in mine]
                if not others or len(got) >= need:
                    break
                node = -max(others)[1]
                mine[node] = []
                got += st.free[node][: need - len(got)]
        if len(got) < need:
            continue  # free GPUs only shrink: this job cannot grow any more
        taken = set(got)
        for node in {st.node_of(g) for g in got}:
            st.free[node] = [g for g in st.free[node] if g not in taken]
        st.gpus[jid] = sorted(st.gpus[jid] + got)
        free -= len(got)
        plan.allocation[jid] = up
        push(by_id[jid])


class ElasticTiresias(Policy):
    def __init__(
        self,
        thresholds: tuple[float, ...] = (500.0, 10_000.0),
        promote_knob: float = 8.0,
        max_waiting: int = 10,
    ) -> None:
        self.thresholds = tuple(thresholds)
        self.promote_knob = promote_knob
        self.max_waiting = max_waiting

    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        order = tiresias_allocation(snap, plan, self.thresholds, self.promote_knob)
        st = _State(snap, place_consolidated(snap, plan.allocation))
        waiting = [j for j in order if j.job_id not in plan.allocation]
        if len(waiting) > self.max_waiting:
            donors = {
                j.job_id: j
                for j in order
                if j.job_id in plan.allocation and j.spec.elastic and queue_of(j, self.thresholds) > 0
            }
            compaction(snap, plan, st, waiting, donors, self.max_waiting)
        elif not waiting:
            elastic = [j for j in order if j.job_id in plan.allocation and j.spec.elastic]
            expansion(snap, plan, st, elastic)
        plan.placement = {jid: tuple(st.gpus[jid]) for jid, n in plan.allocation.items() if n > 0}

    def placement(self, snap: Snapshot, plan: Plan) -> None:
        """Placed in :meth:`allocation` (compaction and expansion are machine-aware)."""
