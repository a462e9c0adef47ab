"""A simulated job and its progress segments.

A job's progress is a list of segments ``(start, rate, idle_gpus)``: from
``start`` until the next segment it does ``rate`` iterations/s (0 while paused
by a rescale) and ``idle_gpus`` of its GPUs do no useful work (paused or
warming up, :mod:`tidal.core.overhead`). Progress is integrated exactly, and
completion times are computed, not stepped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tidal.core.job import JobSpec, JobState
from tidal.core.overhead import Segments
from tidal.scheduler.api import EMPTY, JobView


@dataclass(slots=True)
class SimJob:
    spec: JobSpec
    state: JobState = JobState.SUBMITTED
    gpus: tuple[int, ...] = ()
    done: float = 0.0
    last_t: float = 0.0
    segments: list[tuple[float, float, int]] = field(default_factory=list)
    attained: float = 0.0
    executed: float = 0.0
    waiting_since: float = 0.0
    admitted: bool = False
    tags: dict[str, Any] = field(default_factory=dict)
    start_time: float | None = None
    end_time: float | None = None
    drop_reason: str = ""
    rescales: int = 0
    preemptions: int = 0
    migrations: int = 0
    overhead_gpu_s: float = 0.0
    max_gpus: int = 0
    gpu_seconds: float = 0.0
    version: int = 0
    single_rate: float = 0.0  # iterations/s on one GPU, for cluster efficiency
    batch: int = 0  # current global batch
    alloc: list[tuple[float, int]] = field(default_factory=list)  # (time, GPUs) at each change
    row: int = field(default=-1, compare=False, repr=False)  # its slot in the engine's running rows (tidal.sim.runset), -1: none

    def view(self) -> JobView:
        return JobView(
            self.spec,
            self.state,
            self.gpus,
            self.done,
            self.attained,
            self.executed,
            self.waiting_since,
            self.admitted,
            MappingProxyType(dict(self.tags)) if self.tags else EMPTY,
            self.batch,
        )


class Progress:
    """Cluster-wide integrals: allocated GPU-seconds and useful work, the sum
    over jobs of rate / one-GPU rate (ElasticFlow §6, eq. 8)."""

    def __init__(self, t0: float) -> None:
        self.busy_gpu_s = 0.0
        self.useful = 0.0
        self._t = t0

    def account(self, t: float, used_gpus: int) -> None:
        """Allocated GPU-seconds up to ``t`` (``used_gpus`` held since the last call)."""
        dt = t - self._t
        if dt > 0:
            self.busy_gpu_s += used_gpus * dt
            self._t = t

    def advance(self, job: SimJob, t: float) -> None:
        """Bring ``job.done`` and its counters up to time ``t``."""
        terms: list[float] = []
        integrate(job, t, terms)
        for x in terms:
            self.useful += x


def integrate(job: SimJob, t: float, useful: list[float]) -> None:
    """Bring ``job``'s counters up to time ``t``; append its useful work
    (rate / one-GPU rate x seconds), one term per segment, to ``useful``."""
    if t <= job.last_t:
        return
    if not job.gpus:
        job.last_t = t
        return
    segs = job.segments
    n = len(job.gpus)
    t0 = job.last_t
    dt = t - t0
    if len(segs) == 1 and segs[0][0] <= t0:
        rate = segs[0][1]
        job.done += rate * dt
        job.overhead_gpu_s += segs[0][2] * dt
        useful.append(rate / job.single_rate * dt)
    else:
        for i, (start, rate, idle) in enumerate(segs):
            end = segs[i + 1][0] if i + 1 < len(segs) else math.inf
            a, b = max(start, t0), min(end, t)
            if b > a:
                job.done += rate * (b - a)
                job.overhead_gpu_s += idle * (b - a)
                useful.append(rate / job.single_rate * (b - a))
        # keep only the segment in force at t and later ones
        while len(segs) > 1 and segs[1][0] <= t:
            segs.pop(0)
        if job.state is JobState.RESIZING and len(segs) == 1:
            job.state = JobState.RUNNING
    job.attained += n * dt
    job.executed += dt
    job.gpu_seconds += n * dt
    job.last_t = t


def finish_time(job: SimJob) -> float:
    """When ``job`` completes if its segments stay as they are (inf: never)."""
    left = job.spec.iterations - job.done
    t = job.last_t
    segs = job.segments
    for i, (start, rate, _idle) in enumerate(segs):
        end = segs[i + 1][0] if i + 1 < len(segs) else math.inf
        a = max(start, t)
        if end <= a:
            continue
        if rate > 0:
            need = left / rate
            if a + need <= end:
                return a + need
            left -= rate * (end - a)
    return math.inf


def with_idle(segs: Segments, gpus: int, warm_idle: int) -> list[tuple[float, float, int]]:
    """Overhead segments with their idle GPUs: all of them while paused,
    ``warm_idle`` newcomers warming up in the first segment, else none."""
    if len(segs) == 1:
        start, rate = segs[0]
        return [(start, rate, gpus if rate == 0 else warm_idle)]
    return [
        (start, rate, gpus if rate == 0 else (warm_idle if i == 0 else 0))
        for i, (start, rate) in enumerate(segs)
    ]
