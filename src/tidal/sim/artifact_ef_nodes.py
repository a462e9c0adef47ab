"""Node sets of the ElasticFlow artifact's ``elastic`` placement and its
trainer cache (``cluster.py`` and ``log.py`` of github.com/pkusys/ElasticFlow).

Only one thing of the placement matters to the artifact's deadline ratios:
whether a job's GPU ranks are *in the trainer cache* (a rank range used
since the last restart costs a 2 s overhead instead of a relaunch). So the
layout is modelled exactly:

- a node set is one node (or ``n / 8`` nodes for a job of ``n >= 8`` GPUs)
  listed under a size class: the class of the jobs that fit its free GPUs
  (the largest class dividing them), or, when full, the class it was filled
  by; lists are kept sorted by used GPUs;
- a job of ``n`` GPUs goes to the first set of class ``n`` if it fits, else
  into the first set of a larger class that fits (largest class first),
  else onto new nodes (lowest free node ids first);
- ranks are numbered node by node; a multi-node set's job starts at its
  first node's first GPU, jobs sharing a node are packed in joining order;
  a job's ``(first rank, GPUs)`` is in the cache if it was seen before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: the artifact's size classes
SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 88, 128, 256)


@dataclass(eq=False)
class NodeSet:
    nodes: list[int]
    capacity: int
    cls: int
    util: int = 0
    jobs: list = field(default_factory=list)


class ElasticNodes:
    """The artifact's ``elastic`` placement over node sets."""

    def __init__(self, num_nodes: int, per_node: int) -> None:
        self.per_node = per_node
        self.num_nodes = num_nodes
        self.free: list[int] = list(range(num_nodes))
        self.classes: dict[int, list[NodeSet]] = {k: [] for k in SIZES}
        self.where: dict[int, NodeSet] = {}  # job idx -> its set
        self.cache: set[tuple[int, int]] = set()

    def _home(self, ns: NodeSet) -> list[NodeSet]:
        for lst in self.classes.values():
            if any(x is ns for x in lst):
                return lst
        return []

    def _file(self, ns: NodeSet, fallback: list[NodeSet]) -> None:
        """File a set that just got a job under the class of its free GPUs
        (``ns.cls`` follows), or, when full, append it to ``fallback``."""
        free = len(ns.nodes) * self.per_node - ns.util
        if free > 0:
            for k in sorted(SIZES, reverse=True):
                if k <= free and free % k == 0:
                    ns.cls = k
                    self.classes[k].append(ns)
                    self.classes[k].sort(key=lambda s: s.util)
                    return
        fallback.append(ns)

    def _try(self, lst: list[NodeSet], job, n: int, home: list[NodeSet]) -> bool:
        ns = lst.pop(0)
        if ns.util + n > ns.capacity:
            lst.append(ns)
            return False
        ns.util += n
        ns.jobs.append(job)
        self._file(ns, home)
        home.sort(key=lambda s: s.util)
        self.where[job.idx] = ns
        return True

    def place(self, job, n: int) -> bool:
        """Place ``job`` on ``n`` GPUs (the artifact's ``elastic_placement``)."""
        home = self.classes[n]
        if home and self._try(home, job, n, home):
            return True
        for k in reversed(SIZES):
            if k <= n:
                break
            if self.classes[k] and self._try(self.classes[k], job, n, home):
                return True
        count = math.ceil(n / self.per_node)
        if count > len(self.free):
            return False
        ns = NodeSet(nodes=[self.free.pop(0) for _ in range(count)], capacity=count * self.per_node, cls=n,
                     util=n, jobs=[job])
        free = count * self.per_node - n
        if free > 0:
            for k in sorted(SIZES, reverse=True):
                if k <= free and free % k == 0:
                    self.classes[k].append(ns)  # its class stays ``n`` (as in the artifact)
                    home.sort(key=lambda s: s.util)
                    self.classes[k].sort(key=lambda s: s.util)
                    break
        else:
            home.append(ns)
            home.sort(key=lambda s: s.util)
        self.where[job.idx] = ns
        return True

    def release(self, job, n: int) -> None:
        """Take ``job`` (holding ``n`` GPUs) off its set (``release_job_res``)."""
        ns = self.where.pop(job.idx)
        ns.util -= n
        ns.jobs.remove(job)
        free = ns.capacity - ns.util
        if ns.util == 0:
            self.free.extend(ns.nodes)
            for lst in self.classes.values():
                if any(x is ns for x in lst):
                    lst.remove(ns)
            self.free.sort()
        elif free > 0:
            for k in sorted(SIZES, reverse=True):
                if k > free or free % k:
                    continue
                if free == ns.cls:
                    break
                lst = self._home(ns)
                if lst:
                    lst.remove(ns)
                ns.cls = k
                self.classes[k].append(ns)
                self.classes[k].sort(key=lambda s: s.util)
                break

    def placed(self, job) -> bool:
        return job.idx in self.where

    def mark_cache(self, gpus_of) -> None:
        """The artifact's ``scheduling_result``: walk the nodes in id order and
        set each placed job's ``in_cache`` by its ``(first rank, GPUs)``."""
        free = set(self.free)
        rank = 0
        seen: set[int] = set()
        for node in range(self.num_nodes):
            if node in free:
                rank += self.per_node
                continue
            key, ns = self._set_of(node)
            if ns is None:
                rank += self.per_node
                continue
            if key >= self.per_node:
                j0 = ns.jobs[0]
                if j0.idx not in seen:
                    self._seen(j0, (rank, gpus_of(j0)))
                    seen.add(j0.idx)
                rank += self.per_node
            else:
                used = 0
                for j in ns.jobs:
                    n = gpus_of(j)
                    self._seen(j, (rank, n))
                    rank += n
                    used += n
                rank += self.per_node - used

    def _seen(self, job, key: tuple[int, int]) -> None:
        job.in_cache = key in self.cache
        self.cache.add(key)

    def _set_of(self, node: int) -> tuple[int, NodeSet | None]:
        for k, lst in self.classes.items():
            for ns in lst:
                if node in ns.nodes:
                    return k, ns
        return 0, None
