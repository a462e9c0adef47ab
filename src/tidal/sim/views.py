"""The simulator's policy-facing state, kept between rounds.

Instead of building every :class:`JobView` each round, the engine keeps them:
a waiting job's view is rebuilt only when one of its fields changes
(:meth:`ViewCache.touch`), and the running jobs' views come from their
:class:`~tidal.sim.runset.RunSet` rows in one pass. The snapshot's indexes
(GPUs held per job, counts, GPU owners) are the engine's own dicts, handed
over read-only and copied before the next change (copy-on-write), so a
snapshot never changes after it is built.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from itertools import filterfalse
from typing import Any, Mapping

from tidal.core.overhead import OverheadModel
from tidal.core.profile import ThroughputProfile
from tidal.core.topology import Cluster
from tidal.core.job import JobState
from tidal.scheduler.api import FrozenDict, JobView, Snapshot
from tidal.sim.progress import SimJob
from tidal.sim.runset import RunSet

_new_view = tuple.__new__
_set, _pop = dict.__setitem__, dict.pop


_NO_TAGS = FrozenDict()


def view_tags(job: SimJob) -> Mapping[str, Any]:
    """The read-only copy of ``job.tags`` its views carry."""
    return FrozenDict(job.tags) if job.tags else _NO_TAGS


class ViewCache:
    """Views of the active jobs (in arrival order), running rows, GPU owners."""

    def __init__(self, cluster: Cluster) -> None:
        self.rows = RunSet(cluster.num_gpus)
        self.views: dict[str, JobView] = {}
        self.tags: dict[str, Mapping[str, Any]] = {}
        self.dirty: set[str] = set()
        self.submitted: dict[str, None] = {}  # active jobs in state submitted, in arrival order
        self.owner: dict[int, str] = {}  # GPU -> job
        self.held = FrozenDict()  # job -> GPUs
        self.sizes = FrozenDict()  # job -> GPU count
        self._shared = False  # the two dicts above are in a snapshot
        self._per = per = cluster.gpus_per_node
        self.free = [tuple(range(n * per, (n + 1) * per)) for n in range(cluster.num_nodes)]
        self.by_free: list[list[int]] = [[] for _ in range(per + 1)]
        self.by_free[per] = list(range(cluster.num_nodes))

    # -- GPUs held -----------------------------------------------------------
    def _own(self) -> None:
        if self._shared:
            self.held, self.sizes = FrozenDict(self.held), FrozenDict(self.sizes)
            self._shared = False

    def hold(self, job: SimJob) -> None:
        """Record ``job.gpus`` as held by ``job``."""
        self._own()
        jid, owner = job.spec.job_id, self.owner
        for g in job.gpus:
            owner[g] = jid
        _set(self.held, jid, job.gpus)
        _set(self.sizes, jid, len(job.gpus))
        self._refree(job.gpus)

    def unhold(self, job: SimJob) -> None:
        """Forget the GPUs ``job`` holds (before they change or are freed)."""
        if not job.gpus:
            return
        self._own()
        jid, owner = job.spec.job_id, self.owner
        for g in job.gpus:
            del owner[g]
        _pop(self.held, jid, None)
        _pop(self.sizes, jid, None)
        self._refree(job.gpus)

    def _refree(self, gpus: tuple[int, ...]) -> None:
        """Update the free lists of the nodes of ``gpus``."""
        per, owner = self._per, self.owner
        for node in {g // per for g in gpus}:
            new = tuple(filterfalse(owner.__contains__, range(node * per, (node + 1) * per)))
            old = len(self.free[node])
            if len(new) != old:
                nodes = self.by_free[old]
                del nodes[bisect_left(nodes, node)]
                insort(self.by_free[len(new)], node)
            self.free[node] = new

    # -- job life ----------------------------------------------------------------
    def arrive(self, job: SimJob) -> None:
        jid = job.spec.job_id
        self.tags[jid] = view_tags(job)
        self.views[jid] = self._view(job)
        if job.state is JobState.SUBMITTED:
            self.submitted[jid] = None

    def leave(self, job: SimJob) -> None:
        """``job`` completed or was dropped."""
        jid = job.spec.job_id
        del self.views[jid], self.tags[jid]
        self.dirty.discard(jid)
        self.submitted.pop(jid, None)

    def run(self, job: SimJob, was_running: bool) -> None:
        """``job`` got new GPUs and segments: (re)load its row."""
        if was_running:
            self.rows.load(job, self.tags[job.spec.job_id])
        else:
            self.rows.add(job, self.tags[job.spec.job_id])

    def stop_running(self, job: SimJob) -> None:
        """``job`` leaves the running rows (its fields become the truth)."""
        self.rows.remove(job)
        self.dirty.add(job.spec.job_id)

    def touch(self, job: SimJob) -> None:
        """A view field of ``job`` other than its counters changed."""
        if job.gpus:
            self.rows.touch(job, self.tags[job.spec.job_id])
        else:
            self.dirty.add(job.spec.job_id)
        if job.state is not JobState.SUBMITTED:
            self.submitted.pop(job.spec.job_id, None)

    def retag(self, job: SimJob) -> None:
        """``job.tags`` changed."""
        self.tags[job.spec.job_id] = view_tags(job)
        self.touch(job)

    # -- the snapshot --------------------------------------------------------------
    def _view(self, job: SimJob) -> JobView:
        return _new_view(JobView, (job.spec, job.state, job.gpus, job.done, job.attained, job.executed,
                                   job.waiting_since, job.admitted, self.tags[job.spec.job_id], job.batch))

    def snapshot(self, now: float, cluster: Cluster, active: dict[str, SimJob], profiles: ThroughputProfile,
                 overheads: OverheadModel) -> Snapshot:
        """The policy's snapshot; the running rows must be advanced to ``now``."""
        views = self.views
        for jid in self.dirty:
            job = active.get(jid)
            if job is not None and not job.gpus:
                views[jid] = self._view(job)
        self.dirty.clear()
        if self.rows.k:
            views.update(zip(self.rows.ids, self.rows.views()))
        self._shared = True
        snap = Snapshot(now=now, cluster=cluster, jobs=tuple(views.values()), profiles=profiles,
                        overheads=overheads)
        return snap.indexed(held=self.held, sizes=self.sizes, ids=tuple(views), free=tuple(self.free),
                            by_free=tuple(map(tuple, self.by_free)),
                            submitted=tuple([views[jid] for jid in self.submitted]))
