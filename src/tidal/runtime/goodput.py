"""Goodput-maximising batch size and the learning-rate rules that go with it
(Pollux, OSDI'21 §3-4; AdaScale, Johnson et al. ICML'20). Pure functions:
the batch policy that uses them is ``scaling="goodput"``
(:class:`tidal.runtime.scaling.GoodputScaling`).

Pollux's goodput is ``THROUGHPUT(B, n) × EFFICIENCY(B)``: samples per second
at global batch ``B`` on ``n`` workers, times the progress each sample makes
relative to the base batch ``B0``, ``E(B) = (φ + B0) / (φ + B)`` with ``φ``
the gradient noise scale (:mod:`tidal.runtime.noise`).

Throughput comes from a step-time model fitted to what this job measured
(:func:`fit_step_time`), simpler than Pollux's (no overlap exponent, no
accumulation term): ``T(n, b) = α + β b + o(n)``, compute affine in the local
batch ``b = B/n`` (least squares over every measured ``(b, compute time)``;
with a single measured local batch, compute proportional to it: ``α = 0``),
plus a per-world-size overhead ``o(n)`` = the measured step time minus the
compute time (the gradient sync left after overlap, the optimizer step,
data loading, the script's own per-step code), taken at the nearest measured
world size for a size never measured (the larger one on a tie), 0 before
any measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from tidal.runtime.noise import adascale_gain, efficiency

#: the learning-rate rules, as functions of (noise scale, B, B0)
LR_RULES = ("adascale", "sqrt", "linear")

#: more candidate batches than this are searched on a geometric grid
_EXHAUSTIVE = 4096


@dataclass(frozen=True)
class StepSample:
    """Mean measurements at one configuration: ``world`` ranks, mean local
    batch ``local``, ``count`` steps, their mean compute time (start of the
    step to the end of backward, averaged over ranks) and step time."""

    world: int
    local: float
    count: int
    compute_s: float
    step_s: float


@dataclass(frozen=True)
class StepTimeModel:
    """``T(n, b) = alpha + beta * b + overhead(n)`` (see the module docstring)."""

    alpha: float = 0.0
    beta: float = 0.0
    overheads: dict[int, float] = field(default_factory=dict)

    def overhead(self, world: int) -> float:
        if not self.overheads:
            return 0.0
        near = min(self.overheads, key=lambda n: (abs(n - world), -n))
        return self.overheads[near]

    def step_time(self, world: int, local: float) -> float:
        return max(self.alpha + self.beta * local, 0.0) + self.overhead(world)

    def throughput(self, world: int, batch: float) -> float:
        """Samples per second at global batch ``batch`` on ``world`` ranks."""
        t = self.step_time(world, batch / world)
        return batch / t if t > 0 else math.inf


def fit_step_time(samples: Sequence[StepSample]) -> StepTimeModel:
    """The step-time model of the measured ``samples`` (weighted by their
    step counts); an empty model (every step free) without samples."""
    pts = [s for s in samples if s.count > 0 and s.local > 0]
    if not pts:
        return StepTimeModel()
    w = [float(s.count) for s in pts]
    tw = sum(w)
    mx = sum(wi * s.local for wi, s in zip(w, pts)) / tw
    my = sum(wi * s.compute_s for wi, s in zip(w, pts)) / tw
    sxx = sum(wi * (s.local - mx) ** 2 for wi, s in zip(w, pts))
    sxy = sum(wi * (s.local - mx) * (s.compute_s - my) for wi, s in zip(w, pts))
    if sxx > 1e-12 * max(mx * mx, 1.0) and sxy > 0:
        beta = sxy / sxx
        alpha = max(my - beta * mx, 0.0)
    else:  # one local batch measured (or compute not growing with it): proportional
        alpha, beta = 0.0, my / mx
    over: dict[int, list[float]] = {}
    for wi, s in zip(w, pts):
        acc = over.setdefault(s.world, [0.0, 0.0])
        acc[0] += wi * max(s.step_s - s.compute_s, 0.0)
        acc[1] += wi
    return StepTimeModel(alpha, beta, {n: a / c for n, (a, c) in over.items()})


def batch_limit(base: int, max_batch: int, max_local: int | None, world: int) -> int:
    """The largest global batch allowed on ``world`` ranks: ``max_batch``,
    at most ``max_local`` per rank, never below ``base``."""
    hi = max_batch if max_local is None else min(max_batch, max_local * world)
    return max(base, hi)


def _candidates(lo: int, hi: int) -> list[int]:
    if hi - lo <= _EXHAUSTIVE:
        return list(range(lo, hi + 1))
    k = _EXHAUSTIVE
    grid = {int(round(lo * (hi / lo) ** (i / k))) for i in range(k + 1)}
    return sorted({lo, hi, *grid})


def goodput(phi: float, batch: int, base: int, world: int, model: StepTimeModel) -> float:
    """Pollux's goodput (§3.1): throughput × statistical efficiency."""
    return model.throughput(world, batch) * efficiency(phi, batch, base)


def choose_batch(phi: float, base: int, max_batch: int, max_local: int | None, world: int,
                 model: StepTimeModel) -> int:
    """The global batch in ``[base, batch_limit(...)]`` with the highest
    goodput on ``world`` ranks (the smallest one on a tie)."""
    hi = batch_limit(base, max_batch, max_local, world)
    best, best_g = base, -math.inf
    for b in _candidates(base, hi):
        g = goodput(phi, b, base, world, model)
        if g > best_g * (1 + 1e-12):
            best, best_g = b, g
    return best


def lr_factor(rule: str, phi: float | None, batch: float, base: float) -> float:
    """The factor on the learning rate tuned for ``base`` at ``batch``:
    AdaScale's gain (``adascale``; 1 while the noise scale is unknown),
    ``sqrt(B/B0)`` or ``B/B0`` (``linear``, Goyal et al.)."""
    s = batch / base
    if rule == "linear":
        return s
    if rule == "sqrt":
        return math.sqrt(s)
    if rule == "adascale":
        return 1.0 if phi is None else adascale_gain(phi, batch, base)
    raise ValueError(f"lr_rule must be one of {', '.join(LR_RULES)}, not {rule!r}")
