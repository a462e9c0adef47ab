"""The running jobs' progress counters as numpy rows, advanced together.

Between events a running job with one progress segment gains, per second,
``rate`` iterations, ``idle`` overhead GPU-s, ``n`` attained GPU-s and ``n``
GPU-s, one executed second and ``rate / one-GPU rate`` useful work. Each
round advances every such row in one vector step: the elementwise products
and sums are the same IEEE operations the per-job code did, so the counters
are bit-identical. A job in a rescale (several segments) is "slow": its
``SimJob`` fields stay the truth and :func:`integrate` advances it in Python.

Rows are kept in running order (the order jobs started), which is the order
the useful-work integral is summed in. For a steady job the row is the truth
and the ``SimJob`` fields are stale until :meth:`RunSet.flush`.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

import numpy as np

from tidal.core.job import JobState
from tidal.scheduler.api import JobView
from tidal.sim.progress import Progress, SimJob, integrate

# row columns: done, overhead_gpu_s, attained, gpu_seconds, executed, (useful: scratch)
_NCOL = 6
_new_view = tuple.__new__
_RUNNING, _RESIZING = JobState.RUNNING, JobState.RESIZING


def steady(job: SimJob) -> bool:
    """One segment, already in force: the per-round fast path applies."""
    segs = job.segments
    return len(segs) == 1 and segs[0][0] <= job.last_t


class RunSet:
    """Rows for the running jobs: counters, per-second gains, last update time,
    and the fields of their :class:`JobView` that do not change every round."""

    def __init__(self, capacity: int) -> None:
        cap = max(capacity, 1)
        self.S = np.zeros((cap, _NCOL))  # counters
        self.M = np.zeros((cap, _NCOL))  # gains per second (zero for slow jobs)
        self.L = np.zeros(cap)  # time of the last update
        self.k = 0
        self.jobs: list[SimJob] = []
        self.ids: list[str] = []
        self.slow: set[str] = set()
        # static view fields: spec, state, gpus, waiting_since, admitted, tags, batch
        self.cols: list[list[Any]] = [[] for _ in range(7)]

    def __contains__(self, jid: str) -> bool:
        return jid in self.ids

    # -- membership ----------------------------------------------------------
    def add(self, job: SimJob, view_tags: Any) -> None:
        """Append ``job`` (just started) as the last row, from its fields."""
        if self.k == len(self.L):
            self._grow()
        self.jobs.append(job)
        self.ids.append(job.spec.job_id)
        for col in self.cols:
            col.append(None)
        self.k += 1
        self.load(job, view_tags, self.k - 1)

    def remove(self, job: SimJob) -> None:
        """Drop ``job``'s row; its fields are brought up to date first."""
        pos = self.ids.index(job.spec.job_id)
        self._flush_at(pos)
        k = self.k
        for a in (self.S, self.M, self.L):
            a[pos:k - 1] = a[pos + 1:k]
        self.k = k - 1
        del self.jobs[pos], self.ids[pos]
        for col in self.cols:
            del col[pos]
        self.slow.discard(job.spec.job_id)

    def _grow(self) -> None:
        n = 2 * len(self.L)
        self.S = np.concatenate([self.S, np.zeros_like(self.S)])[:n]
        self.M = np.concatenate([self.M, np.zeros_like(self.M)])[:n]
        self.L = np.concatenate([self.L, np.zeros_like(self.L)])[:n]

    # -- rows <-> SimJob fields ----------------------------------------------
    def flush(self, job: SimJob) -> None:
        """Write ``job``'s row back to its fields (a no-op for a slow job)."""
        self._flush_at(self.ids.index(job.spec.job_id))

    def _flush_at(self, pos: int) -> None:
        job = self.jobs[pos]
        if job.spec.job_id in self.slow:
            return
        job.done, job.overhead_gpu_s, job.attained, job.gpu_seconds, job.executed, _ = self.S[pos].tolist()
        job.last_t = float(self.L[pos])

    def flush_all(self) -> None:
        for pos in range(self.k):
            self._flush_at(pos)

    def load(self, job: SimJob, view_tags: Any, pos: int | None = None) -> None:
        """Copy ``job``'s fields (counters, segments, view fields) to its row."""
        if pos is None:
            pos = self.ids.index(job.spec.job_id)
        self.S[pos] = (job.done, job.overhead_gpu_s, job.attained, job.gpu_seconds, job.executed, 0.0)
        self.L[pos] = job.last_t
        if steady(job):
            _start, rate, idle = job.segments[0]
            n = float(len(job.gpus))
            self.M[pos] = (rate, idle, n, n, 1.0, rate / job.single_rate)
            self.slow.discard(job.spec.job_id)
        else:
            self.M[pos] = 0.0
            self.slow.add(job.spec.job_id)
        self.touch(job, view_tags, pos)

    def touch(self, job: SimJob, view_tags: Any, pos: int | None = None) -> None:
        """Refresh the row's view fields that are not counters."""
        if pos is None:
            pos = self.ids.index(job.spec.job_id)
        c = self.cols
        c[0][pos], c[1][pos], c[2][pos] = job.spec, job.state, job.gpus
        c[3][pos], c[4][pos], c[5][pos], c[6][pos] = job.waiting_since, job.admitted, view_tags, job.batch

    # -- the round -------------------------------------------------------------
    def advance(self, now: float, progress: Progress, view_tags: dict[str, Any]) -> None:
        """Bring every row to ``now``, adding the useful work to ``progress`` in
        running order (one addition per job and segment, as the per-job code)."""
        k = self.k
        if not k:
            return
        L = self.L[:k]
        gain = self.M[:k] * (now - L)[:, None]
        self.S[:k] += gain
        L.fill(now)
        terms = gain[:, 5]
        if not self.slow:
            terms[0] += progress.useful
            progress.useful = float(terms.cumsum()[-1])
            return
        seq: list[Any] = terms.tolist()
        for pos in sorted((self.ids.index(j) for j in self.slow), reverse=True):
            job = self.jobs[pos]
            sub: list[float] = []
            integrate(job, now, sub)
            seq[pos:pos + 1] = sub
            self.load(job, view_tags[job.spec.job_id], pos)
        u = progress.useful
        for x in seq:
            u += x
        progress.useful = u

    def capture(self) -> Rows:
        """The rows' view fields as they are now (copies: later changes to the
        rows do not reach them)."""
        k = self.k
        return Rows(self.ids[:], [col[:] for col in self.cols], self.S[:k, 0:5:2].copy())


class Rows:
    """A copy of the running rows' view fields, made into views on demand."""

    __slots__ = ("ids", "cols", "counters", "_pos")

    def __init__(self, ids: list[str], cols: list[list[Any]], counters: np.ndarray) -> None:
        self.ids, self.cols, self.counters = ids, cols, counters
        self._pos: dict[str, int] | None = None

    def views(self) -> list[JobView]:
        """A :class:`JobView` per row, in running order."""
        done, attained, executed = self.counters.T.tolist()
        c = self.cols
        return list(map(_new_view, repeat(JobView),
                        zip(c[0], c[1], c[2], done, attained, executed, c[3], c[4], c[5], c[6])))

    def view(self, jid: str) -> JobView | None:
        """The view of one row's job, or None if ``jid`` has no row."""
        if self._pos is None:
            self._pos = dict(zip(self.ids, range(len(self.ids))))
        pos = self._pos.get(jid)
        if pos is None:
            return None
        c = self.cols
        done, attained, executed = self.counters[pos].tolist()
        return _new_view(JobView, (c[0][pos], c[1][pos], c[2][pos], done, attained, executed,
                                   c[3][pos], c[4][pos], c[5][pos], c[6][pos]))

    def all_running(self) -> bool:
        """Every row is admitted and running or resizing."""
        states = self.cols[1]
        return all(self.cols[4]) and states.count(_RUNNING) + states.count(_RESIZING) == len(states)
