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
from operator import attrgetter, is_not
from typing import Any

import numpy as np

from tidal.core.job import JobState
from tidal.scheduler.api import JobView
from tidal.sim.progress import Progress, SimJob, integrate

# row columns: done, overhead_gpu_s, attained, gpu_seconds, executed, (useful: scratch)
_NCOL = 6
_new_view = tuple.__new__
_JOB_ID = attrgetter("job_id")
_RUNNING, _RESIZING = JobState.RUNNING, JobState.RESIZING
_COMPACT_MIN = 32  # holes tolerated whatever the rows (and up to half as many as rows)


def steady(job: SimJob) -> bool:
    """One segment, already in force: the per-round fast path applies."""
    segs = job.segments
    return len(segs) == 1 and segs[0][0] <= job.last_t


def _bad(static: tuple) -> bool:
    """A row whose job is not admitted, or neither running nor resizing."""
    state = static[1]
    return not static[4] or (state is not _RUNNING and state is not _RESIZING)


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
        # per slot, the static view fields: spec, state, gpus, waiting_since, admitted, tags, batch
        self.statics: list[tuple | None] = []
        self.slow: dict[int, SimJob] = {}  # slot -> job, for the jobs in a rescale
        self.bad = 0  # rows not admitted or neither running nor resizing (see all_running)

    def __contains__(self, jid: str) -> bool:
        return any(j is not None and j.spec.job_id == jid for j in self.jobs)

    @property
    def ids(self) -> list[str]:
        """The rows' job ids, in running order."""
        return [j.spec.job_id for j in self.jobs if j is not None]

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
        self.statics.append(None)
        job.row = pos
        self.load(job, view_tags, pos)

    def remove(self, job: SimJob) -> None:
        """Drop ``job``'s row; its fields are brought up to date first."""
        pos = job.row
        if self.slow.pop(pos, None) is None:
            job.done, job.overhead_gpu_s, job.attained, job.gpu_seconds, job.executed, _ = self.S[pos].tolist()
            job.last_t = float(self.L[pos])
            self.M[pos] = 0.0
        job.row = -1
        self.jobs[pos] = None
        if _bad(self.statics[pos]):
            self.bad -= 1
        self.statics[pos] = None
        self.k -= 1
        n = self.n
        if pos == n - 1:  # trailing holes go at once
            jobs = self.jobs
            while n and jobs[n - 1] is None:
                n -= 1
            del jobs[n:], self.statics[n:]
            self.n = n
        elif 2 * (n - self.k) > max(self.k, 2 * _COMPACT_MIN):
            self._compact()

    def _compact(self) -> None:
        """Close the holes, keeping the rows' order."""
        n = self.n
        keep = [j is not None for j in self.jobs]
        if all(keep):
            return
        idx = np.flatnonzero(np.array(keep, dtype=bool))
        k = len(idx)
        for a in (self.S, self.M, self.L):
            a[:k] = a[idx]
        self.M[k:n] = 0.0
        self.jobs = list(compress(self.jobs, keep))
        self.statics = list(compress(self.statics, keep))
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
        self.S[pos] = (job.done, job.overhead_gpu_s, job.attained, job.gpu_seconds, job.executed, 0.0)
        self.L[pos] = job.last_t
        segs = job.segments
        if len(segs) == 1 and segs[0][0] <= job.last_t:  # steady
            _start, rate, idle = segs[0]
            n = float(len(job.gpus))
            self.M[pos] = (rate, idle, n, n, 1.0, rate / job.single_rate)
            self.slow.pop(pos, None)
        else:
            self.M[pos] = 0.0
            self.slow[pos] = job
        self.touch(job, view_tags, pos)

    def touch(self, job: SimJob, view_tags: Any, pos: int | None = None) -> None:
        """Refresh the row's view fields that are not counters."""
        if pos is None:
            pos = job.row
        st = (job.spec, job.state, job.gpus, job.waiting_since, job.admitted, view_tags, job.batch)
        old = self.statics[pos]
        self.bad += _bad(st) - (old is not None and _bad(old))
        self.statics[pos] = st

    # -- the round -------------------------------------------------------------
    def advance(self, now: float, progress: Progress, view_tags: dict[str, Any]) -> None:
        """Bring every row to ``now``, adding the useful work to ``progress`` in
        running order (one addition per job and segment, as the per-job code;
        a hole adds ``0.0``, which changes no sum)."""
        if not self.k:
            return
        n = self.n
        L = self.L[:n]
        gain = self.M[:n] * (now - L)[:, None]
        self.S[:n] += gain
        L.fill(now)
        terms = gain[:, 5]
        if not self.slow:
            terms[0] += progress.useful
            progress.useful = float(terms.cumsum()[-1])
            return
        seq: list[Any] = terms.tolist()
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
        return Rows(self.statics[:n], self.S[:n, 0:5:2].copy(), self.bad == 0)


class Rows:
    """A copy of the running rows' view fields, made into views on demand."""

    __slots__ = ("statics", "counters", "running", "_pos")

    def __init__(self, statics: list[tuple | None], counters: np.ndarray, running: bool) -> None:
        self.statics, self.counters, self.running = statics, counters, running
        self._pos: dict[str, int] | None = None

    def _live(self) -> tuple[list[tuple], list[float], list[float], list[float]]:
        """The rows' static fields and counters (done, attained, executed), holes left out."""
        statics = self.statics
        done, attained, executed = self.counters.T.tolist()
        if None in statics:
            keep = list(map(is_not, statics, repeat(None)))
            statics = list(compress(statics, keep))
            done, attained, executed = (list(compress(c, keep)) for c in (done, attained, executed))
        return statics, done, attained, executed

    @property
    def ids(self) -> list[str]:
        """The rows' job ids, in running order."""
        return [st[0].job_id for st in self.statics if st is not None]

    def columns(self) -> tuple[list[str], list[JobView]]:
        """The rows' job ids and a :class:`JobView` per row, in running order."""
        statics, done, attained, executed = self._live()
        if not statics:
            return [], []
        spec, state, gpus, since, admitted, tags, batch = zip(*statics)
        views = list(map(_new_view, repeat(JobView),
                         zip(spec, state, gpus, done, attained, executed, since, admitted, tags, batch)))
        return list(map(_JOB_ID, spec)), views

    def views(self) -> list[JobView]:
        """A :class:`JobView` per row, in running order."""
        return self.columns()[1]

    def view(self, jid: str) -> JobView | None:
        """The view of one row's job, or None if ``jid`` has no row."""
        if self._pos is None:
            self._pos = {st[0].job_id: i for i, st in enumerate(self.statics) if st is not None}
        pos = self._pos.get(jid)
        if pos is None:
            return None
        st = self.statics[pos]
        done, attained, executed = self.counters[pos].tolist()
        return _new_view(JobView, (st[0], st[1], st[2], done, attained, executed, st[3], st[4], st[5], st[6]))

    def all_running(self) -> bool:
        """Every row is admitted and running or resizing."""
        return self.running

