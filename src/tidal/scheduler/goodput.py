"""Goodput: system throughput times statistical efficiency (Pollux, OSDI'21, §3).

Pollux measures a training job's progress in samples *at the efficiency of
its initial batch* ``M0``: at a global batch ``M`` one sample is worth

    E(M) = (phi + M0) / (phi + M)                      (Pollux §3.1, eq. 4)

samples at ``M0``, where ``phi`` is the gradient noise scale (McCandlish et
al.: ``tr(Sigma) / |g|^2``, in samples) at the job's current progress. A
job's **goodput** on a placement ``a`` at batch ``M`` is

    GOODPUT(a, M) = THROUGHPUT(a, M) * E(M)            (§3, eq. 1)

with ``THROUGHPUT`` in samples/s from a step-time model (§3.2: the global
batch split over the replicas, gradient accumulation above the largest local
batch that fits; :mod:`tidal.core.steptime` fits it to measurements). This
module counts progress in *steps at M0* (``GOODPUT / M0``): the unit of the
Pollux data's ``progress`` column, whose last value ends training.

* :class:`NoiseCurve` — ``phi`` over progress for one application, read from
  the per-batch validation runs (see :meth:`NoiseCurve.phi`).
* :class:`GoodputModel` — throughput, goodput, the best batch of an
  allocation (``argmax_M GOODPUT`` over a geometric grid of batches in
  ``[M0, max batch]``) and Pollux's ``SPEEDUP`` (§4.1: goodput at the best
  batch over goodput on one GPU at its best batch), cached per (application,
  nodes, GPUs) and per noise-scale bucket.
* :class:`GoodputProfile` — a :class:`~tidal.core.profile.ThroughputProfile`
  that also carries a model, so that a :class:`~tidal.scheduler.api.Snapshot`
  hands it to the policies and the simulator counts goodput jobs' progress
  with it (:func:`is_goodput_job`).

Pure: no I/O, no clock (the simulator's :mod:`tidal.sim.goodput` reads the
data files and builds the model).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tidal.core.errors import InputError
from tidal.core.job import JobSpec
from tidal.core.profile import ThroughputProfile

#: JobSpec.meta key marking a job whose ``iterations`` and progress are in
#: steps at its application's M0 (statistical-efficiency units)
GOODPUT_META = "progress_unit"
GOODPUT_UNIT = "efficiency"
#: noise-scale buckets per factor e (decisions cached per bucket: ~1% apart)
PHI_BUCKETS_PER_E = 100
#: batches tried per allocation, geometrically spaced over [M0, max batch]
GRID_POINTS = 24
_PHI_CAP = 1e12  # samples: where grad_sqr is 0 the noise scale is "infinite"; E is then 1

StepFn = Callable[[int, int, float], float]  # (nodes, replicas, local batch) -> seconds per step


def efficiency(phi: float, m0: float, m: float) -> float:
    """Pollux eq. 4: samples at ``M0`` one sample at batch ``m`` is worth."""
    return (phi + m0) / (phi + m)


#: The view tag a live executor fills with a job's own reported numbers
#: (``noise_scale``, ``base_batch``, ``max_batch``...: the runtime's goodput
#: scaling, measured online); policies only read it.
REPORT_TAG = "goodput"


def reported_noise(tags: Mapping[str, Any]) -> tuple[float, int, int] | None:
    """``(noise scale, base batch, largest batch)`` a running job reported
    (its ``REPORT_TAG``), or None without a usable estimate."""
    rep = tags.get(REPORT_TAG)
    if not isinstance(rep, Mapping):
        return None
    phi, m0 = rep.get("noise_scale"), rep.get("base_batch")
    if not isinstance(phi, (int, float)) or not isinstance(m0, int) or not math.isfinite(phi) or phi <= 0 or m0 < 1:
        return None
    top = rep.get("max_batch")
    return float(phi), m0, int(top) if isinstance(top, int) and top >= m0 else 8 * m0


def best_reported(throughput: Callable[[int], float], phi: float, m0: int, top: int, points: int = 16
                  ) -> tuple[int, float]:
    """The batch in ``[m0, top]`` (a geometric grid) with the most goodput, in
    steps at ``m0`` per second, from ``throughput(batch)`` (iterations/s at
    that global batch on the allocation): Pollux §3.1's goodput with the
    job's measured noise scale ``phi``."""
    best_b, best_g = m0, 0.0
    for b in sorted({int(round(m0 * (top / m0) ** (i / (points - 1)))) for i in range(points)}):
        g = throughput(b) * b / m0 * efficiency(phi, m0, b)
        if g > best_g:
            best_b, best_g = b, g
    return best_b, best_g


def local_batch_throughput(profile: ThroughputProfile, model: str, batch: float, n: int) -> float:
    """Iterations/s of ``model`` at global ``batch`` on ``n`` GPUs from a
    profile measured at other batches: each GPU runs at the per-GPU speed the
    profile measured at the same local batch (``batch / n``), on its largest
    batch (weak scaling; a local batch above every measured one runs at the
    largest measured local batch's per-sample speed)."""
    if n < 1 or batch <= 0:
        return 0.0
    bp = max(profile.batch_sizes(model))
    k = max(1.0, bp * n / batch)  # the profile's count with this local batch
    per_gpu = profile.throughput(model, bp, k) * bp / k  # samples/s of one GPU there
    return n * per_gpu / batch


def is_goodput_job(spec: JobSpec) -> bool:
    """Whether ``spec``'s progress counts in statistical-efficiency units."""
    return any(k == GOODPUT_META and v == GOODPUT_UNIT for k, v in spec.meta)


@dataclass(frozen=True)
class NoiseCurve:
    """The gradient noise scale of one application over training progress.

    ``runs`` holds, per validation run at global batch ``B`` (ascending),
    the progress points and ``grad_var / grad_sqr`` there. The data's
    ``grad_var`` is normalised to ``M0`` (each run's progress increments
    equal ``(r + 1) / (r * M0 / B + 1)`` per step with ``r`` that ratio), so
    ``phi = M0 * r`` in samples, comparable across runs."""

    app: str
    m0: int  # initial batch: the smallest validation run's (its progress equals its steps)
    max_batch: int  # the largest validation run's batch
    end: float  # progress that ends training: the M0 run's last row
    runs: tuple[tuple[int, np.ndarray, np.ndarray], ...]  # (batch, progress points, r)

    def __post_init__(self) -> None:
        if not self.runs:
            raise InputError("no validation runs", field=self.app)
        if not (self.m0 > 0 and self.end > 0 and self.max_batch >= self.m0):
            raise InputError(f"bad noise curve: M0 {self.m0}, max batch {self.max_batch}, end {self.end}",
                             field=self.app)

    @classmethod
    def from_runs(cls, app: str, runs: Mapping[int, tuple[Sequence[float], Sequence[float], Sequence[float]]]
                  ) -> "NoiseCurve":
        """From ``batch -> (progress, grad_sqr, grad_var)`` columns."""
        out = []
        for b in sorted(runs):
            prog, sqr, var = (np.asarray(x, dtype=float) for x in runs[b])
            if len(prog) == 0:
                continue
            order = np.argsort(prog, kind="stable")
            with np.errstate(divide="ignore", invalid="ignore"):
                r = np.where(sqr > 0, var / np.where(sqr > 0, sqr, 1.0), _PHI_CAP)
            r = np.clip(np.nan_to_num(r, nan=0.0, posinf=_PHI_CAP), 0.0, _PHI_CAP)
            out.append((int(b), prog[order], r[order]))
        if not out:
            raise InputError("no validation rows", field=app)
        m0 = out[0][0]
        return cls(app, m0, out[-1][0], float(out[0][1][-1]), tuple(out))

    def phi(self, progress: float, batch: float | None = None) -> float:
        """Noise scale (samples) at ``progress`` for a job training at
        ``batch`` (default ``M0``): each run's ratio interpolated linearly in
        progress (held flat before its first and after its last row), then
        between the two runs whose batches bracket ``batch``, linearly in
        (log batch, log ratio); outside the runs' batches, the nearest run."""
        runs = self.runs
        b = self.m0 if batch is None else batch
        batches = [x[0] for x in runs]
        if b <= batches[0] or len(runs) == 1:
            return self.m0 * _interp(progress, runs[0])
        if b >= batches[-1]:
            return self.m0 * _interp(progress, runs[-1])
        i = bisect.bisect_left(batches, b)
        if batches[i] == b:
            return self.m0 * _interp(progress, runs[i])
        lo, hi = runs[i - 1], runs[i]
        r0, r1 = _interp(progress, lo), _interp(progress, hi)
        w = math.log(b / lo[0]) / math.log(hi[0] / lo[0])
        if r0 <= 0 or r1 <= 0:
            return self.m0 * (r0 + w * (r1 - r0))
        return self.m0 * math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))


def _interp(progress: float, run: tuple[int, np.ndarray, np.ndarray]) -> float:
    return float(np.interp(progress, run[1], run[2]))


@dataclass(frozen=True)
class AppModel:
    """What goodput needs of one application: its noise curve, its step time
    (``step(nodes, replicas, local_batch)`` seconds, with accumulation above
    ``max_local``) and the local batches a replica may run (``min_local`` the
    smallest measured: below it the fitted model is extrapolated)."""

    curve: NoiseCurve
    step: StepFn
    max_local: float
    min_local: float = 1.0


@dataclass
class GoodputModel:
    """Goodput of the applications on a cluster of ``gpus_per_node``-GPU nodes.

    Allocations are (nodes, GPUs); where only a count is given the GPUs are
    packed onto ``ceil(n / gpus_per_node)`` nodes. Caches fill as it is used
    (a cache only: the answers are the same without it)."""

    apps: Mapping[str, AppModel]
    gpus_per_node: int
    grid_points: int = GRID_POINTS
    _tables: dict = field(default_factory=dict, repr=False)
    _best: dict = field(default_factory=dict, repr=False)
    _tput: dict = field(default_factory=dict, repr=False)

    def app(self, name: str) -> AppModel:
        try:
            return self.apps[name]
        except KeyError:
            raise InputError(f"no goodput data for application {name!r}; known: {', '.join(sorted(self.apps))}",
                             field="model") from None

    def nodes_for(self, n: int) -> int:
        return max(1, -(-n // self.gpus_per_node))

    def batch_grid(self, name: str) -> np.ndarray:
        """Candidate global batches: ``grid_points`` geometric steps from M0
        to the largest validated batch, rounded, distinct."""
        c = self.app(name).curve
        pts = np.geomspace(c.m0, c.max_batch, self.grid_points) if c.max_batch > c.m0 else np.array([c.m0])
        return np.unique(np.round(pts).astype(np.int64))

    def throughput(self, name: str, nodes: int, n: int, batch: float) -> float:
        """Samples/s of ``n`` GPUs on ``nodes`` nodes at global ``batch`` (0 if
        a replica would get less than the smallest local batch)."""
        key = (name, nodes, n, batch)
        hit = self._tput.get(key)
        if hit is None:
            a = self.app(name)
            if n < 1 or batch / n < a.min_local - 1e-9:
                hit = 0.0
            else:
                hit = batch / a.step(nodes, n, batch / n)
            if len(self._tput) > 200_000:
                self._tput.clear()
            self._tput[key] = hit
        return hit

    def _table(self, name: str, nodes: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(batches, samples/s) over the grid for an allocation; batches a
        replica cannot split are left out."""
        key = (name, nodes, n)
        hit = self._tables.get(key)
        if hit is None:
            grid = self.batch_grid(name)
            tput = np.array([self.throughput(name, nodes, n, float(b)) for b in grid])
            ok = tput > 0
            hit = self._tables[key] = (grid[ok], tput[ok])
        return hit

    def progress_rate(self, name: str, nodes: int, n: int, batch: float, phi: float) -> float:
        """Progress (steps at M0) per second at ``batch`` with noise scale ``phi``."""
        c = self.app(name).curve
        return self.throughput(name, nodes, n, batch) * efficiency(phi, c.m0, batch) / c.m0

    def best(self, name: str, n: int, phi: float, nodes: int | None = None) -> tuple[int, float]:
        """(best global batch, progress rate there) for ``n`` GPUs at noise
        scale ``phi``: the grid batch of highest goodput; ``(0, 0.0)`` if no
        batch splits over ``n`` GPUs."""
        nodes = self.nodes_for(n) if nodes is None else nodes
        key = (name, nodes, n, phi_bucket(phi))
        hit = self._best.get(key)
        if hit is None:
            batches, tput = self._table(name, nodes, n)
            if len(batches) == 0:
                hit = (0, 0.0)
            else:
                m0 = self.app(name).curve.m0
                good = tput * (phi + m0) / (phi + batches) / m0
                i = int(np.argmax(good))
                hit = (int(batches[i]), float(good[i]))
            if len(self._best) > 200_000:
                self._best.clear()
            self._best[key] = hit
        return hit

    def speedup(self, name: str, n: int, phi: float, nodes: int | None = None) -> float:
        """Pollux's SPEEDUP (§4.1): best goodput on ``n`` GPUs over best goodput on one."""
        if n < 1:
            return 0.0
        one = self.best(name, 1, phi)[1]
        return self.best(name, n, phi, nodes)[1] / one if one > 0 else 0.0

    def phi(self, name: str, progress: float, batch: float | None = None) -> float:
        return self.app(name).curve.phi(progress, batch)

    def end(self, name: str) -> float:
        """Progress (steps at M0) that ends training."""
        return self.app(name).curve.end


def phi_bucket(phi: float) -> int:
    """The cache bucket of a noise scale: about 1% wide."""
    return int(round(math.log(max(phi, 1e-9)) * PHI_BUCKETS_PER_E))


@dataclass(frozen=True)
class GoodputProfile(ThroughputProfile):
    """A throughput profile carrying a :class:`GoodputModel` (``goodput``):
    the rates of goodput jobs (:func:`is_goodput_job`) come from it, in steps
    at M0 per second; other jobs use the profile as before."""

    goodput: GoodputModel | None = field(default=None, compare=False)

    _flags: dict = field(default_factory=dict, compare=False, repr=False)  # job id -> is a goodput job

    def owns(self, spec: JobSpec) -> bool:
        """Whether ``spec`` is a goodput job this profile rates (cached by job id)."""
        hit = self._flags.get(spec.job_id)
        if hit is None or hit[0] is not spec:
            hit = self._flags[spec.job_id] = (spec, self.goodput is not None and is_goodput_job(spec)
                                              and spec.model in self.goodput.apps)
        return hit[1]

    def job_rate(self, spec: JobSpec, n: int, batch: int, done: float, nodes: int | None = None) -> float:
        """Progress/s of goodput job ``spec`` on ``n`` GPUs (on ``nodes``
        nodes, default packed) at global ``batch`` after ``done`` progress,
        with the noise scale of a run at that batch (:meth:`NoiseCurve.phi`)."""
        gp = self.goodput
        if gp is None or n < 1:
            return 0.0
        nodes = gp.nodes_for(n) if nodes is None else nodes
        return gp.progress_rate(spec.model, nodes, n, batch, gp.phi(spec.model, done, batch))


def with_goodput(profile: ThroughputProfile, model: GoodputModel) -> GoodputProfile:
    """``profile`` (its curves, per-type sub-profiles and settings) plus ``model``."""
    return GoodputProfile(profile.curves, profile.cross_node_penalty, profile.source,
                          by_type=profile.by_type, goodput=model)
