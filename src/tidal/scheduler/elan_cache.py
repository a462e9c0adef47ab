"""Per-job tables of the Elan policies, kept across decisions.

Used only by :mod:`tidal.scheduler.policies.elan`. A job's GPU range, its
progress rate and batch at each count (Elan §VI-C, Algorithm 1) and its step
sequence under the allocation rule depend only on its spec, the profiles, the
cluster size and the policy's options, not on the job's progress. Consecutive
decisions see mostly the same jobs, so each table is built once and kept
while those inputs stay the same. The cache never changes a decision: an entry
is used only for the spec it was built from (the same object, or an equal
one, ``meta`` included; specs are immutable), and a change of profiles,
cluster size or options empties it. It holds at most ``limit`` jobs; when
full, the oldest half is dropped. Jobs of the same shape (model, batch, GPU
range, hybrid scaling) have the same counts, rates and steps: a new job's are
copied from the first table of its shape.
"""

from __future__ import annotations

from typing import Any, Iterable

from tidal.core.job import JobSpec


class JobTable:
    """One job's tables (filled by the policy's :class:`Rates`)."""

    __slots__ = ("spec", "counts", "ctup", "rates", "one", "rate_at", "steps", "tops", "hybrid", "shape")

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec  # the spec the tables were built from
        self.counts: list[int] | None = None  # counts the job may run at, ascending
        self.ctup: tuple[int, ...] = ()  # the same, as a tuple
        self.rates: tuple[float, ...] | None = None  # progress rate at each of ``counts``
        self.one: float | None = None  # one-GPU rate at the spec's batch
        self.rate_at: dict[int, tuple[float, int]] = {}  # count -> (progress rate, batch)
        self.steps: dict[int, tuple] = {}  # lookahead -> uncapped steps (elan_order.step_arrays)
        self.tops: dict[int, int] = {}  # lookahead -> the count after the last of those steps
        self.hybrid = False  # hybrid scaling: the batch depends on the count
        self.shape: JobTable = self  # the table its counts and rates were copied from


class ElanCache:
    """Bounded map spec -> :class:`JobTable`, valid for one context (profiles,
    cluster size, policy options)."""

    def __init__(self, limit: int = 20_000) -> None:
        self.limit = limit
        self._profiles: Any = None
        self._context: tuple = ()
        self._jobs: dict[str, JobTable] = {}  # job id -> tables
        # what a job's counts and rates depend on (model, batch, range, hybrid) -> the first
        # table built for it: a job of the same shape shares its counts, rates and steps
        self.shapes: dict[tuple, JobTable] = {}
        # (lookahead, the jobs' tables, the step order built on them): a decision
        # over the very same jobs reuses the order's job-independent part
        self.last_order: tuple[int, list[JobTable], Any] | None = None

    def bind(self, profiles: Any, *context: Any) -> None:
        """Use the tables for ``profiles`` (by identity) and ``context``;
        anything else empties the cache."""
        if profiles is not self._profiles or context != self._context:
            self._jobs.clear()
            self.shapes.clear()
            self.last_order = None
            self._profiles, self._context = profiles, context

    def table(self, spec: JobSpec) -> JobTable:
        """The job's tables (a new, empty one on a miss)."""
        jobs = self._jobs
        hit = jobs.get(spec.job_id)
        if hit is not None:
            if hit.spec is spec:
                return hit
            if hit.spec == spec and hit.spec.meta == spec.meta:  # an executor that rebuilds its specs
                hit.spec = spec
                return hit
            del jobs[spec.job_id]
        elif len(jobs) >= self.limit:
            for key in list(jobs)[: max(1, len(jobs) // 2)]:
                del jobs[key]
            self.shapes.clear()
        hit = jobs[spec.job_id] = JobTable(spec)
        return hit

    def tables(self, specs: Iterable[JobSpec]) -> list[JobTable]:
        """:meth:`table` of each of ``specs``."""
        get, table, out = self._jobs.get, self.table, []
        for spec in specs:
            hit = get(spec.job_id)
            out.append(hit if hit is not None and hit.spec is spec else table(spec))
        return out

    def __len__(self) -> int:
        return len(self._jobs)
