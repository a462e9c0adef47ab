"""The running jobs' progress counters as numpy rows, advanced together.

Between events a running job with one progress segment gains, per second,
``rate`` iterations, ``idle`` overhead GPU-s, ``n`` attained GPU-s and ``n``
GPU-s, one executed second and ``rate / one-GPU rate`` useful work. Each
round advances every such row in one vector step: the elementwise products
and sums are the same IEEE operations the per-job code did, so the counters
are bit-identical. A job in a rescale (several segments) is "slow": its
``SimJob`` fields stay the truth and :func:`integrate` advances it in Python.

Rows are kept in running order (the order jobs started), which is the order
the useful-work integral is summed in. A job's row is its slot
(``SimJob.row``): a job that stops leaves a hole (all gains zero, so it adds
exactly ``0.0`` to the sum and nothing else), and the slots are compacted, in
order, once holes are half as many as rows; so every operation on one job is
O(1). For a steady job the row is the truth and the ``SimJob`` fields are
stale until :meth:`RunSet.flush`.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import is_not
from typing import Any

import numpy as np

from tidal.core.job import JobState
from tidal.scheduler import kernels
from tidal.scheduler.api import JobView
from tidal.sim.progress import Progress, SimJob, integrate

# row columns: done, overhead_gpu_s, attained, gpu_seconds, executed, (useful: scratch)
_NCOL = 6
_new_view = tuple.__new__
_RUNNING, _RESIZING = JobState.RUNNING, JobState.RESIZING
_COMPACT_MIN = 32  # holes tolerated whatever the rows (and up to half as many as rows)


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
        self.M = np.zeros((cap, _NCOL))  # gains per second (zero for slow jobs and holes)
        self.L = np.zeros(cap)  # time of the last update
        self.n = 0  # slots in use, holes included
        self.k = 0  # rows (jobs)
        self.jobs: list[SimJob | None] = []  # per slot (None: a hole)
        # per slot (None in a hole), the static view fields:
        # job id, spec, state, gpus, waiting_since, admitted, tags, batch
        self.cols: list[list[Any]] = [[] for _ in range(8)]
        self.slow: dict[int, SimJob] = {}  # slot -> job, for the jobs in a rescale
        self.bad = 0  # rows not admitted or neither running nor resizing (see all_running)

    def __contains__(self, jid: str) -> bool:
        return jid in self.cols[0]

    @property
    def ids(self) -> list[str]:
        """The rows' job ids, in running order."""
        return [jid for jid in self.cols[0] if jid is not None]

    # -- membership ----------------------------------------------------------
    def add(self, job: SimJob, view_tags: Any) -> None:
        """Append ``job`` (just started) as the last row, from its fields."""
        if self.n == len(self.L):
            if 2 * self.k <= self.n:
                self._compact()
            else:
                self._grow()
        pos = self.n
        self.n = pos + 1
        self.k += 1
        self.jobs.append(job)
        job.row = pos
        c = self.cols
        state, admitted = job.state, job.admitted
        c[0].append(job.spec.job_id)
        c[1].append(job.spec)
        c[2].append(state)
        c[3].append(job.gpus)
        c[4].append(job.waiting_since)
        c[5].append(admitted)
        c[6].append(view_tags)
        c[7].append(job.batch)
        if not admitted or (state is not _RUNNING and state is not _RESIZING):
            self.bad += 1
        self._counters(job, pos)

    def remove(self, job: SimJob) -> None:
        """Drop ``job``'s row; its fields are brought up to date first. The
        hole keeps its other view fields until it is closed (only the job
        id column marks holes)."""
        pos = job.row
        if self.slow.pop(pos, None) is None:
            job.done, job.overhead_gpu_s, job.attained, job.gpu_seconds, job.executed, _ = self.S[pos].tolist()
            job.last_t = float(self.L[pos])
            self.M[pos] = 0.0
        job.row = -1
        cols = self.cols
        state = cols[2][pos]
        if not cols[5][pos] or (state is not _RUNNING and state is not _RESIZING):
            self.bad -= 1
        self.jobs[pos] = cols[0][pos] = None
        self.k -= 1
        n = self.n
        if pos == n - 1:  # trailing holes go at once
            jobs = self.jobs
            while n and jobs[n - 1] is None:
                n -= 1
            del jobs[n:]
            for col in cols:
                del col[n:]
            self.n = n
        elif 2 * (n - self.k) > max(self.k, 2 * _COMPACT_MIN):
            self._compact()

    def _compact(self) -> None:
        """Close the holes, keeping the rows' order."""
        n = self.n
        keep = list(map(is_not, self.jobs, repeat(None)))
        if all(keep):
            return
        idx = np.flatnonzero(np.array(keep, dtype=bool))
        k = len(idx)
        for a in (self.S, self.M, self.L):
            a[:k] = a[idx]
        self.M[k:n] = 0.0
        self.jobs = list(compress(self.jobs, keep))
        self.cols = [list(compress(col, keep)) for col in self.cols]
        for pos, job in enumerate(self.jobs):
            job.row = pos
        self.slow = {job.row: job for job in self.slow.values()}
        self.n = k

    def _grow(self) -> None:
        n = 2 * len(self.L)
        self.S = np.concatenate([self.S, np.zeros_like(self.S)])[:n]
        self.M = np.concatenate([self.M, np.zeros_like(self.M)])[:n]
        self.L = np.concatenate([self.L, np.zeros_like(self.L)])[:n]

    # -- rows <-> SimJob fields ----------------------------------------------
    def flush(self, job: SimJob) -> None:
        """Write ``job``'s row back to its fields (a no-op for a slow job)."""
        pos = job.row
        if pos in self.slow:
            return
        job.done, job.overhead_gpu_s, job.attained, job.gpu_seconds, job.executed, _ = self.S[pos].tolist()
        job.last_t = float(self.L[pos])

    def flush_all(self) -> None:
        for job in self.jobs:
            if job is not None:
                self.flush(job)

    def load(self, job: SimJob, view_tags: Any, pos: int | None = None) -> None:
        """Copy ``job``'s fields (counters, segments, view fields) to its row."""
        if pos is None:
            pos = job.row
        self._counters(job, pos)
        self.touch(job, view_tags, pos)

    def _counters(self, job: SimJob, pos: int) -> None:
        """Copy ``job``'s counters and, if steady, its gains per second to row ``pos``."""
        self.S[pos] = (job.done, job.overhead_gpu_s, job.attained, job.gpu_seconds, job.executed, 0.0)
        self.L[pos] = job.last_t
        segs = job.segments
        if len(segs) == 1 and segs[0][0] <= job.last_t:  # steady
            _start, rate, idle = segs[0]
            n = float(len(job.gpus))
            self.M[pos] = (rate, idle, n, n, 1.0, rate / job.single_rate)
            if self.slow:
                self.slow.pop(pos, None)
        else:
            self.M[pos] = 0.0
            self.slow[pos] = job

    def touch(self, job: SimJob, view_tags: Any, pos: int | None = None) -> None:
        """Refresh the row's view fields that are not counters."""
        if pos is None:
            pos = job.row
        c = self.cols
        old_state, old_admitted = c[2][pos], c[5][pos]
        state, admitted = job.state, job.admitted
        c[1][pos], c[2][pos], c[3][pos] = job.spec, state, job.gpus
        c[4][pos], c[5][pos], c[6][pos], c[7][pos] = job.waiting_since, admitted, view_tags, job.batch
        # rows not admitted or neither running nor resizing
        self.bad += ((not admitted or (state is not _RUNNING and state is not _RESIZING))
                     - (not old_admitted or (old_state is not _RUNNING and old_state is not _RESIZING)))

    # -- the round -------------------------------------------------------------
    def advance(self, now: float, progress: Progress, view_tags: dict[str, Any]) -> None:
        """Bring every row to ``now``, adding the useful work to ``progress`` in
        running order (one addition per job and segment, as the per-job code;
        a hole adds ``0.0``, which changes no sum)."""
        if not self.k:
            return
        n = self.n
        fast = kernels.fast
        if fast is not None:  # the arithmetic below, compiled
            got = fast.advance_rows(self.S, self.M, self.L, n, now, None if self.slow else progress.useful)
            if type(got) is float:
                progress.useful = got
                return
            if got is not NotImplemented:
                self._advance_slow(now, progress, view_tags, got)
                return
        L = self.L[:n]
        gain = self.M[:n] * (now - L)[:, None]
        self.S[:n] += gain
        L.fill(now)
        terms = gain[:, 5]
        if not self.slow:
            terms[0] += progress.useful
            progress.useful = float(terms.cumsum()[-1])
            return
        self._advance_slow(now, progress, view_tags, terms.tolist())

    def _advance_slow(self, now: float, progress: Progress, view_tags: dict[str, Any], seq: list[Any]) -> None:
        """The slow rows, integrated job by job into ``seq`` (the steady rows'
        gains, in row order), then summed into ``progress``."""
        for pos in sorted(self.slow, reverse=True):
            job = self.slow[pos]
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
        n = self.n
        return Rows([col[:n] for col in self.cols], self.S[:n, 0:5:2].copy(), self.bad == 0, n != self.k)


class Rows:
    """A copy of the running rows' view fields, made into views on demand."""

    __slots__ = ("cols", "counters", "running", "holes", "_pos")

    def __init__(self, cols: list[list[Any]], counters: np.ndarray, running: bool, holes: bool) -> None:
        self.cols, self.counters, self.running, self.holes = cols, counters, running, holes
        self._pos: dict[str, int] | None = None

    @property
    def ids(self) -> list[str]:
        """The rows' job ids, in running order."""
        return [jid for jid in self.cols[0] if jid is not None]

    def columns(self) -> tuple[list[str], list[JobView]]:
        """The rows' job ids and a :class:`JobView` per row, in running order."""
        fast = kernels.fast
        if fast is not None:
            got = fast.row_views(JobView, self.cols, self.counters)
            if got is not NotImplemented:
                return got  # the lines below, compiled
        jid, spec, state, gpus, since, admitted, tags, batch = self.cols
        done, attained, executed = self.counters.T.tolist()
        # a view per slot (a hole's, from the fields its job left, is dropped below)
        views = list(map(_new_view, repeat(JobView),
                         zip(spec, state, gpus, done, attained, executed, since, admitted, tags, batch)))
        if self.holes:
            keep = list(map(is_not, jid, repeat(None)))
            return list(compress(jid, keep)), list(compress(views, keep))
        return jid, views

    def views(self) -> list[JobView]:
        """A :class:`JobView` per row, in running order."""
        return self.columns()[1]

    def view(self, jid: str) -> JobView | None:
        """The view of one row's job, or None if ``jid`` has no row."""
        if self._pos is None:
            ids = self.cols[0]
            self._pos = dict(zip(ids, range(len(ids))))
            self._pos.pop(None, None)  # type: ignore[call-overload]
        pos = self._pos.get(jid)
        if pos is None:
            return None
        c = self.cols
        done, attained, executed = self.counters[pos].tolist()
        return _new_view(JobView, (c[1][pos], c[2][pos], c[3][pos], done, attained, executed,
                                   c[4][pos], c[5][pos], c[6][pos], c[7][pos]))

    def all_running(self) -> bool:
        """Every row is admitted and running or resizing."""
        return self.running
