"""The simulator's policy-facing state, kept between rounds.

Instead of building every :class:`JobView` each round, the engine keeps them:
a waiting job's view is rebuilt only when one of its fields changes
(:meth:`ViewCache.touch`), and the running jobs' views come from a copy of
their :class:`~tidal.sim.runset.RunSet` rows, in one pass, only if the
policy reads ``snap.jobs`` (:class:`LazyJobs`; a policy that looks only at
the jobs without GPUs, through the indexes, never builds them). The
snapshot's indexes (GPUs held per job, counts, free GPUs) come from the
engine's own: read-only copies, made again only once they changed, so a
snapshot never changes after it is built; positions, which few rounds read,
the snapshot derives from its job ids when asked.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator, Sequence
from itertools import compress, filterfalse, repeat
from operator import not_
from typing import Any, Mapping

import numpy as np

from tidal.core.overhead import OverheadModel
from tidal.core.profile import ThroughputProfile
from tidal.core.topology import Cluster
from tidal.core.job import JobState
from tidal.scheduler import kernels
from tidal.scheduler.api import FrozenDict, JobView, Snapshot
from tidal.sim.progress import SimJob
from tidal.sim.runset import Rows, RunSet

_new_view = tuple.__new__


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
        self.used: np.ndarray | None = None  # GPUs held, once a policy read a snapshot's used_mask (track_used)
        self.held: dict[str, tuple[int, ...]] = {}  # job -> GPUs
        self.sizes: dict[str, int] = {}  # job -> GPU count
        self._frozen: tuple[FrozenDict, FrozenDict] | None = None  # read-only copies of the two, while unchanged
        self._idle: dict[str, None] = {}  # active jobs holding no GPUs, in arrival order (see snapshot)
        self._returned: set[str] = set()  # jobs that gave back GPUs since the last snapshot
        self.idle_ids: tuple[str, ...] = ()  # the jobs without GPUs in the last snapshot, in its order
        self._cluster = cluster
        self._num_gpus = cluster.num_gpus
        self._node_of = cluster._node_of  # GPU -> node (a tuple)
        self._node_gpus = [tuple(cluster.gpus_of_node(n)) for n in range(cluster.num_nodes)]
        self.free = list(self._node_gpus)
        self.by_free: list[list[int]] = [[] for _ in range(cluster.max_gpus_per_node + 1)]
        for n, gpus in enumerate(self.free):
            self.by_free[len(gpus)].append(n)

    # -- GPUs held -----------------------------------------------------------
    def track_used(self) -> None:
        """From now on keep the mask of held GPUs that snapshots hand over as
        ``used_mask`` (built from the owners once)."""
        if self.used is None:
            self.used = np.zeros(self._num_gpus, dtype=bool)
            if self.owner:
                self.used[list(self.owner)] = True

    def hold(self, job: SimJob) -> None:
        """Record ``job.gpus`` as held by ``job``."""
        self._frozen = None
        jid, gpus = job.spec.job_id, job.gpus
        self.held[jid] = gpus
        self.sizes[jid] = len(gpus)
        self._idle.pop(jid, None)
        if self._fast_change(gpus, jid):
            return
        if self.used is not None:
            self.used[list(gpus)] = True
        if len(gpus) == 1:  # one GPU: it leaves its node's free list
            g = gpus[0]
            self.owner[g] = jid
            node = self._node_of[g]
            f = self.free[node]
            i = f.index(g)
            self.free[node] = f[:i] + f[i + 1:]
            self._rebucket(node, len(f), len(f) - 1)
        else:
            self.owner.update(zip(gpus, repeat(jid)))
            self._refree(gpus)

    def unhold(self, job: SimJob, leaving: bool = False) -> None:
        """Forget the GPUs ``job`` holds (before they change or are freed);
        ``leaving``: it completes (:meth:`leave` follows), so it joins no index
        of the jobs without GPUs."""
        gpus = job.gpus
        if not gpus:
            return
        self._frozen = None
        jid, owner = job.spec.job_id, self.owner
        self.held.pop(jid, None)
        self.sizes.pop(jid, None)
        if not leaving:
            self._idle[jid] = None  # out of arrival order if it stays idle (see snapshot)
            self._returned.add(jid)
        if self._fast_change(gpus, None):
            return
        if self.used is not None:
            self.used[list(gpus)] = False
        if len(gpus) == 1:  # one GPU: back in its node's free list, in order
            g = gpus[0]
            del owner[g]
            node = self._node_of[g]
            f = self.free[node]
            i = bisect_left(f, g)
            self.free[node] = f[:i] + (g,) + f[i:]
            self._rebucket(node, len(f), len(f) + 1)
        else:
            for g in gpus:
                del owner[g]
            self._refree(gpus)

    def _fast_change(self, gpus: tuple[int, ...], jid: str | None) -> bool:
        """The owners, the used mask and the free lists for ``gpus`` taken by
        ``jid`` (None: given back), compiled; False if that did not run (the
        lines after the call do it)."""
        fast = kernels.fast
        return fast is not None and type(gpus) is tuple and fast.gpus_change(
            gpus, jid, self.owner, self.used, self._node_of, self.free, self._node_gpus, self.by_free
        ) is not NotImplemented

    def _rebucket(self, node: int, old: int, new: int) -> None:
        """``node`` had ``old`` free GPUs and has ``new``."""
        by_free = self.by_free
        bucket = by_free[old]
        del bucket[bisect_left(bucket, node)]
        insort(by_free[new], node)

    def _refree(self, gpus: tuple[int, ...]) -> None:
        """Update the free lists of the nodes of ``gpus``."""
        node_of, held, free, node_gpus = self._node_of, self.owner.__contains__, self.free, self._node_gpus
        for node in set(map(node_of.__getitem__, gpus)):
            new = tuple(filterfalse(held, node_gpus[node]))
            old, k = len(free[node]), len(new)
            if k != old:
                self._rebucket(node, old, k)
            free[node] = new

    # -- job life ----------------------------------------------------------------
    def arrive(self, job: SimJob) -> None:
        jid = job.spec.job_id
        self._idle[jid] = None
        self.tags[jid] = view_tags(job)
        self.views[jid] = self._view(job)
        if job.state is JobState.SUBMITTED:
            self.submitted[jid] = None

    def leave(self, job: SimJob) -> None:
        """``job`` completed or was dropped."""
        jid = job.spec.job_id
        self._idle.pop(jid, None)
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
        """The policy's snapshot; the running rows must be advanced to ``now``.
        Its running jobs' views are built only if the policy asks for them."""
        views = self.views
        for jid in self.dirty:
            job = active.get(jid)
            if job is not None and not job.gpus:
                views[jid] = self._view(job)
        self.dirty.clear()
        if self._frozen is None:  # fresh copies: compact, so the policy's own copies of them are fast
            self._frozen = (FrozenDict(self.held), FrozenDict(self.sizes))
        held, sizes = self._frozen
        ids = tuple(views)
        if self._returned and not self._returned.isdisjoint(self._idle):  # a preempted job: back in order
            self._idle = dict.fromkeys(compress(ids, map(not_, map(held.__contains__, ids))))
        self._returned.clear()
        idle = tuple(map(views.__getitem__, self._idle))
        self.idle_ids = idle_ids = tuple(self._idle)  # of the last snapshot
        from_rows: dict[str, Any] = {}  # indexes of the running rows; with none, the snapshot derives them
        jobs: Sequence[JobView] = idle
        if self.rows.k:
            rows = self.rows.capture()
            jobs = LazyJobs(ids, idle_ids, idle, rows)
            from_rows = {"view_of": _ById(jobs), "holders_running": rows.running}
        snap = Snapshot(now=now, cluster=cluster, jobs=jobs, profiles=profiles, overheads=overheads)
        snap.indexed(held=held, sizes=sizes, ids=ids, free=tuple(self.free),
                     by_free=tuple(map(tuple, self.by_free)),
                     submitted=tuple([views[jid] for jid in self.submitted]),
                     idle=idle, **from_rows)
        if self.used is not None:
            snap.indexed(used_mask=self._used_mask())
        return snap

    def _used_mask(self) -> np.ndarray:
        mask = self.used.copy()
        mask.flags.writeable = False
        return mask


class LazyJobs(Sequence[JobView]):
    """A snapshot's jobs in arrival order, equal to the tuple of every view,
    but the running jobs' views (fresh counters every round) are made only
    when the sequence is read; :meth:`view` looks one up without building
    the rest. Made from copies, so it never changes."""

    def __init__(self, ids: tuple[str, ...], idle_ids: tuple[str, ...], idle: tuple[JobView, ...],
                 rows: Rows) -> None:
        self._ids, self._idle_ids, self._idle, self.rows = ids, idle_ids, idle, rows
        self._by_id: dict[str, JobView] | None = None  # idle jobs only, until built
        self._built: tuple[JobView, ...] | None = None

    def _all(self) -> tuple[JobView, ...]:
        if self._built is None:
            d = self._by_id = dict(zip(self._idle_ids, self._idle))
            d.update(zip(*self.rows.columns()))
            self._built = tuple(map(d.__getitem__, self._ids))
        return self._built

    def view(self, jid: str) -> JobView:
        d = self._by_id
        if d is None:
            d = self._by_id = dict(zip(self._idle_ids, self._idle))
        v = d.get(jid)
        if v is None:
            v = self.rows.view(jid)
            if v is None:
                raise KeyError(jid)
        return v

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[JobView]:
        return iter(self._all())

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyJobs):
            other = other._all()
        return self._all() == other

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


class _ById(Mapping[str, JobView]):
    """Job id -> view over a :class:`LazyJobs`."""

    def __init__(self, jobs: LazyJobs) -> None:
        self._jobs = jobs

    def __getitem__(self, jid: str) -> JobView:
        return self._jobs.view(jid)

    def __iter__(self) -> Iterator[str]:
        return iter(self._jobs._ids)

    def __len__(self) -> int:
        return len(self._jobs._ids)
