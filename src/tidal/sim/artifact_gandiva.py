"""The artifact's Gandiva: time-slicing over per-size node sets.

The ElasticFlow artifact (github.com/pkusys/ElasticFlow, ``scheduler/``) does
not run Gandiva (Xiao et al., OSDI'18) as a Snapshot -> Plan policy: its
Gandiva lives in the cluster model (``cluster.py``: node-set placement,
demand-share rebalancing, time-slicing) and is driven by its own loop
(``scheduler.py``). A ``Plan`` gives a GPU to one job at a time, so this
module models that mechanism as an executor path of ``--fidelity artifact``
(:class:`GandivaNodeSetSimulator`), reproducing the artifact's behaviour:

- **node sets**: jobs of ``n`` GPUs share node sets of ``ceil(n / 8)`` nodes
  (capacity ``8 ceil(n/8) / n`` concurrently running jobs); a new job joins
  the least-loaded set of its size if its load stays *below* the capacity,
  else opens a set on free nodes, else is time-sliced into the least-loaded
  set beyond its capacity, else (no set of its size) waits;
- **load** counts every job ever added to a set and is only reset when the
  sets of a size are rebalanced (completions do not lower it);
- **rebalancing** at every round: each size's node sets target its share
  of the GPU demand (``floor(demand / total * GPUs)``, at most its demand);
  sets are added on free nodes or removed (their jobs moved to the
  least-loaded remaining set). Jobs are re-spread only when the set
  counter of the artifact's loop ends positive (so not after adding
  one-node sets, which then stay empty and are freed at once);
- **time-slicing**: the first ``capacity`` jobs of a set run; they rotate
  to the back of the set only at rounds whose time is a multiple of 60 s;
- **rounds**: at arrivals (an arrival less than a slot after the last round
  is merged into the round a slot later, except the very last one), then
  every slot; waiting jobs are retried only when a node set was freed,
  and, as in the artifact's loop, the job after each started one is
  skipped in that pass;
- **progress**: a running job's executed time grows by the interval minus
  its overhead (:func:`artifact_overhead`: ``2 + 2 (log2 n + 1)`` s, ``+27`` s
  every 60th arrival round; 5 s and 20 s more on clusters of 256+ GPUs;
  charged only after arrival rounds); it ends when the executed time
  reaches the trace's duration, at ``now - excess``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterable

from tidal.core.job import JobSpec, JobState
from tidal.core.profile import ThroughputProfile
from tidal.core.topology import Cluster
from tidal.sim.engine import SimResult
from tidal.sim.progress import SimJob

_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 88, 128, 256)  # the artifact's size classes


@dataclass
class NodeSet:
    """Nodes reserved for jobs of one size, shared by time-slicing."""

    nodes: int
    capacity: int
    load: float = 0.0
    jobs: list[str] = field(default_factory=list)


class GandivaNodeSetSimulator:
    """Gandiva under the artifact's executor (see the module docstring)."""

    def __init__(self, cluster: Cluster, jobs: Iterable[JobSpec], profiles: ThroughputProfile,
                 slot: float = 60.0, restart_every: int = 60, rotate_every: float = 60.0) -> None:
        self.c, self.slot, self.restart_every, self.rotate_every = cluster, slot, restart_every, rotate_every
        # stable sort by submit time only: ties keep trace order, as the artifact's sort_all_jobs
        specs = sorted(jobs, key=lambda s: s.submit_time)
        self.jobs = {s.job_id: SimJob(spec=s, last_t=s.submit_time, batch=s.batch_size) for s in specs}
        self.duration = {s.job_id: _duration(s, profiles) for s in specs}
        self.events: list[list] = []
        for s in specs:
            if self.events and self.events[-1][0] == s.submit_time:
                self.events[-1][1].append(s.job_id)
            else:
                self.events.append([s.submit_time, [s.job_id]])
        self.sets: dict[int, list[NodeSet]] = {n: [] for n in _SIZES}
        self.free_nodes = cluster.num_nodes
        self.pending: list[str] = []
        self.running: list[str] = []
        self.was_pending: set[str] = set()
        self.overhead: dict[str, float] = {}
        self.executed: dict[str, float] = {}
        self.arrival_rounds = 0
        self.rounds = 0
        self.busy_gpu_s = 0.0
        self.timeline: list[tuple[float, int]] = []

    # -- placement -------------------------------------------------------------
    def _size(self, jid: str) -> int:
        return self.jobs[jid].spec.requested_gpus

    def _new_set(self, n: int) -> NodeSet:
        nodes = math.ceil(n / self.c.gpus_per_node)
        self.free_nodes -= nodes
        return NodeSet(nodes=nodes, capacity=int(nodes * self.c.gpus_per_node / n))

    def _place(self, jid: str) -> bool:
        """The artifact's node-set placement of a new or waiting job."""
        n = self._size(jid)
        sets = self.sets[n]
        if sets:
            ns = sets.pop(0)
            sets.append(ns)
            if ns.load + 1 < ns.capacity:
                self._join(sets, ns, jid)
                return True
        if math.ceil(n / self.c.gpus_per_node) <= self.free_nodes:
            ns = self._new_set(n)
            sets.append(ns)
            self._join(sets, ns, jid)
            return True
        if sets:
            ns = sets.pop(0)
            sets.append(ns)
            self._join(sets, ns, jid)
            return True
        return False

    @staticmethod
    def _join(sets: list[NodeSet], ns: NodeSet, jid: str) -> None:
        ns.load += 1
        ns.jobs.append(jid)
        sets.sort(key=lambda s: s.load)

    # -- rebalancing (the artifact's node-set adjust) --------------------------
    def _adjust(self) -> None:
        demand = {n: sum(len(s.jobs) for s in sets) * n for n, sets in self.sets.items()}
        held = {n: sum(s.nodes for s in sets) * self.c.gpus_per_node for n, sets in self.sets.items()}
        total = sum(demand.values())
        if total == 0:
            return
        for n, sets in self.sets.items():
            if demand[n] == 0:
                continue
            target = min(math.floor(demand[n] / total * self.c.num_gpus), demand[n])
            diff = target - held[n]
            if diff > 0:
                self._expand(n, sets, math.ceil(diff / n))
            elif diff < 0:
                self._shrink(sets, math.ceil(-diff / n))

    def _expand(self, n: int, sets: list[NodeSet], count: int) -> None:
        nodes = math.ceil(n / self.c.gpus_per_node)
        counter = 0
        for k in range(1, count + 1):
            counter = k
            if nodes <= self.free_nodes:
                sets.append(self._new_set(n))
                counter = nodes - 1  # the artifact's loop variable, reused by its inner loop
        if counter > 0:
            moved = [j for s in sets for j in s.jobs]
            for s in sets:
                if s.jobs:
                    s.jobs, s.load = [], 0.0
            for jid in moved:
                self._join(sets, sets[0], jid)

    def _shrink(self, sets: list[NodeSet], count: int) -> None:
        count = min(count, len(sets) - 1)
        moved: list[str] = []
        for _ in range(count):
            ns = sets.pop(0)
            moved.extend(ns.jobs)
            self.free_nodes += ns.nodes
        for jid in moved:
            self._join(sets, sets[0], jid)

    # -- execution (the artifact's time-slicing execute) -----------------------
    def _execute(self, now: float, dt: float) -> bool:
        """Progress of the running share of every set over ``dt``; returns
        whether a node set was freed."""
        rotate = int(now % self.rotate_every) == 0
        released = False
        for n, sets in self.sets.items():
            for ns in list(sets):
                conc = min(len(ns.jobs), ns.capacity)
                used = n if len(ns.jobs) * n > self.c.gpus_per_node else len(ns.jobs) * n
                self.busy_gpu_s += used * dt
                ended = [jid for jid in ns.jobs[:max(conc, 1)] if self._run(jid, now, dt, n)]
                if rotate and len(ns.jobs) > conc:
                    ns.jobs = ns.jobs[conc:] + ns.jobs[:conc]
                for jid in ended:
                    ns.jobs.remove(jid)
                    self.running.remove(jid)
                if not ns.jobs:
                    self.free_nodes += ns.nodes
                    sets.remove(ns)
                    released = True
        return released

    def _run(self, jid: str, now: float, dt: float, n: int) -> bool:
        job = self.jobs[jid]
        run = max(dt - self.overhead.get(jid, 0.0), 0.0)
        self.overhead[jid] = 0.0
        ex = self.executed.get(jid, 0.0) + run
        self.executed[jid] = ex
        job.executed += run
        job.attained += run * n
        job.gpu_seconds += n * dt
        if ex < self.duration[jid]:
            return False
        job.done, job.state = job.spec.iterations, JobState.COMPLETED
        job.end_time = now - (ex - self.duration[jid])
        return True

    # -- the loop --------------------------------------------------------------
    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        now = self.events[0][0] if self.events else 0.0
        dt, start = 0.0, now
        horizon = max((s.spec.deadline or s.spec.submit_time for s in self.jobs.values()), default=0.0)
        while self.events or self.pending or self.running:
            self._round(now, dt)
            if not self.events:
                if now > horizon + self.slot:
                    break  # what still runs can no longer meet a deadline
                now, dt = now + self.slot, self.slot
                continue
            self._charge()
            nxt = self._merge(now)
            now, dt = nxt, nxt - now
        return SimResult(
            policy="gandiva", cluster=self.c, jobs=list(self.jobs.values()),
            timeline=self.timeline or [(now, 0)], start=start, end=now, busy_gpu_s=self.busy_gpu_s,
            useful_norm_s=0.0, rounds=self.rounds, wall_seconds=time.perf_counter() - wall0,
        )

    def _round(self, now: float, dt: float) -> None:
        self.rounds += 1
        self._adjust()
        released = self._execute(now, dt)
        for jid in self.was_pending:
            self.overhead[jid] = 0.0
        if self.events and self.events[0][0] == now:
            for jid in self.events.pop(0)[1]:
                self.jobs[jid].admitted = True
                if self._place(jid):
                    self._start(jid, now)
                else:
                    self.pending.append(jid)
                    self.was_pending.add(jid)
                    self.jobs[jid].state = JobState.PENDING
        if released:
            i = 0
            while i < len(self.pending):  # the artifact removes while iterating: the next one is skipped
                if self._place(self.pending[i]):
                    self._start(self.pending.pop(i), now)
                i += 1
        used = sum(s.nodes for sets in self.sets.values() for s in sets) * self.c.gpus_per_node
        if not self.timeline or self.timeline[-1][1] != used:
            self.timeline.append((now, used))

    def _start(self, jid: str, now: float) -> None:
        job = self.jobs[jid]
        job.state, job.start_time = JobState.RUNNING, now
        job.max_gpus = self._size(jid)
        self.running.append(jid)

    def _charge(self) -> None:
        """Overheads for the next interval, set after each arrival round."""
        restart = self.arrival_rounds > 0 and self.arrival_rounds % self.restart_every == 0
        self.arrival_rounds += 1
        for jid in self.running:
            n = self._size(jid)
            self.overhead[jid] = artifact_overhead(n, restart, self.c.num_gpus)

    def _merge(self, now: float) -> float:
        """The artifact's event merge: an arrival within a slot of ``now``
        moves to ``now + slot`` and absorbs the arrivals up to then."""
        ev = self.events
        while ev[0][0] - now <= self.slot and len(ev) > 1:
            ev[0][0] = now + self.slot
            if ev[1][0] - now > self.slot:
                break
            ev[0][1].extend(ev[1][1])
            del ev[1]
        return ev[0][0]


def artifact_overhead(n: int, restart: bool, cluster_gpus: int, cached: bool = False) -> float:
    """The artifact's ``estimate_overhead``: 2 s per round (7 s on clusters of
    256+ GPUs); unless the job's ranks are cached, plus ``2 (log2 n + 1)`` s
    to relaunch and, on a restart round, 27 s (47 s on 256+ GPUs)."""
    big = cluster_gpus >= 256
    ovh = 7.0 if big else 2.0
    if cached:
        return ovh
    if restart:
        ovh += 47.0 if big else 27.0
    return ovh + 2.0 * (math.log2(n) + 1)


def _duration(spec: JobSpec, profiles: ThroughputProfile) -> float:
    """The trace's duration at the requested count (the artifact's ``duration``
    column), else iterations over the profiled throughput."""
    meta = dict(spec.meta)
    if "duration" in meta:
        return float(int(float(meta["duration"])))
    rate = profiles.throughput(spec.model, spec.batch_size, spec.requested_gpus) or 1.0
    return float(math.ceil(spec.iterations / rate))
