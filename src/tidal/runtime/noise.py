"""The gradient noise scale, estimated online from numbers the all-reduce
already carries (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", App. A; used this way by Pollux, OSDI'21 §3.1).

Notation: ``|∇L|²`` is the squared norm of the true gradient, ``tr(Σ)`` the
trace of the per-sample gradient covariance. A gradient ``G_B`` averaged over
``B`` samples drawn independently has ``E|G_B|² = |∇L|² + tr(Σ)/B``
(App. A, eq. A.1). Two batch sizes ``B_small < B_big`` give two equations and
the unbiased estimators (App. A)::

    |∇L|²  ≈ (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small)
    tr(Σ)  ≈ (|G_small|² - |G_big|²) / (1/B_small - 1/B_big)

and the simple noise scale ``B_simple = tr(Σ) / |∇L|²``.

With data parallelism the small batches are the replicas' local batches and
the big one is the reduced global batch. Tidal's reducer weights rank ``i``'s
gradient ``g_i`` (mean over its ``b_i`` samples) by ``W_i = b_i / B_g``
(:mod:`tidal.runtime.reducer`), so its bucket holds ``v_i = W_i g_i`` and the
reduced sum is ``V = Σ v_i = (B / B_g) G`` with ``B = Σ b_i`` the samples of
the step (``B = B_g`` without accumulation; with accumulation every
micro-batch has the loader's global size ``B_g``). Uneven local batches: the
combination ``|G_small|² := Σ_i (b_i / B) |g_i|²`` has
``E = |∇L|² + tr(Σ) Σ_i (b_i/B)/b_i = |∇L|² + tr(Σ) n/B``, i.e. it is the
"small batch" of size exactly ``B/n`` for any split (``n`` ranks with a
non-empty share). Substituting ``B_small = B/n``, ``B_big = B``::

    |∇L|² ≈ (n |G|² - |G_small|²) / (n - 1)
    tr(Σ) ≈ B (|G_small|² - |G|²) / (n - 1)

Each rank sends ``|v_i|² / W_i`` (``= W_i |g_i|²``), ``W_i``, ``b_i`` and
whether its share is non-empty in the reducer's control tail; after the
reduction ``|G_small|² = Σ(|v_i|²/W_i) / ΣW_i`` and ``|G|² = |V|² / (ΣW_i)²``.

One replica (``n = 1``) gives no estimate: the smoothed values are kept as
they were (the runtime does not split an accumulation window into
micro-batch norms). Non-finite numbers (a step the AMP GradScaler skips) are
skipped. Single-step estimates are noisy (``|∇L|²`` may even come out
negative), so the numerator and the denominator are smoothed separately with
an exponential moving average (decay :data:`EMA_DECAY`, about the last 20
steps), bias-corrected like Adam's moments, and the ratio is taken of the
smoothed values (McCandlish et al. App. A.1 recommend averaging the two
separately).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: EMA decay of the two estimates per step (about the last 1/(1-0.95) = 20 steps)
EMA_DECAY = 0.95

#: the tail numbers one rank sends per step (see :func:`rank_numbers`)
RANK_NUMBERS = 4


@dataclass(frozen=True)
class StepNorms:
    """One step's reduced numbers (sums over ranks) and ``|V|²``."""

    small_sq: float  # Σ_i |v_i|² / W_i
    weight: float  # Σ_i W_i
    samples: float  # B = Σ_i b_i
    replicas: float  # n: ranks with a non-empty share
    total_sq: float  # |V|², V the reduced bucket contents

    @classmethod
    def from_tail(cls, tail: list[float], total_sq: float) -> "StepNorms":
        """From the :data:`RANK_NUMBERS` reduced numbers of :func:`rank_numbers`."""
        return cls(tail[0], tail[1], tail[2], tail[3], total_sq)

    def scaled(self, factor: float) -> "StepNorms":
        """Both squared norms divided by ``factor`` (a GradScaler's scale²)."""
        return StepNorms(self.small_sq / factor, self.weight, self.samples, self.replicas, self.total_sq / factor)


def rank_numbers(local_sq: float, weight: float, samples: int) -> list[float]:
    """What one rank adds to the control tail: ``|v_i|²/W_i``, ``W_i``,
    ``b_i`` and 1 if its share is non-empty (``local_sq = |v_i|²``)."""
    if weight <= 0.0:
        return [0.0, 0.0, 0.0, 0.0]
    return [local_sq / weight, weight, float(samples), 1.0]


def estimate(s: StepNorms) -> tuple[float, float] | None:
    """``(|∇L|², tr(Σ))`` from one step (see the module docstring); None
    with fewer than two replicas or non-finite numbers."""
    n = round(s.replicas)
    if n < 2 or s.weight <= 0.0 or s.samples <= 0.0:
        return None
    big = s.total_sq / s.weight**2
    small = s.small_sq / s.weight
    if not (math.isfinite(big) and math.isfinite(small)):
        return None
    return (n * big - small) / (n - 1), s.samples * (small - big) / (n - 1)


def efficiency(phi: float, batch: float, base: float) -> float:
    """Pollux's statistical efficiency ``E(B) = (φ + B0) / (φ + B)``
    (§3.1): progress per sample at ``B`` relative to ``B0``. ``φ = inf``
    (all noise) gives 1."""
    if math.isinf(phi):
        return 1.0
    return (max(phi, 0.0) + base) / (max(phi, 0.0) + batch)


def adascale_gain(phi: float, batch: float, base: float) -> float:
    """AdaScale's gain (Johnson et al., ICML'20) ``r = (σ² + μ²) / (σ²/S +
    μ²)`` with ``S = B / B0``, ``σ² = tr(Σ)/B0`` the variance at the base
    batch and ``μ² = |∇L|²``; with ``φ = tr(Σ)/|∇L|²`` this is
    ``S · E(B) = (B/B0) (φ + B0)/(φ + B)``, between 1 and ``S``."""
    return batch / base * efficiency(phi, batch, base)


class NoiseScale:
    """The smoothed estimates and the noise scale; a plain-number state
    (:meth:`state_dict`) that travels with the batch policy to newcomers."""

    def __init__(self, decay: float = EMA_DECAY) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"noise-scale smoothing must be in [0, 1), not {decay!r}")
        self.decay = float(decay)
        self.grad_sq = 0.0  # EMA of |∇L|² (not bias-corrected)
        self.trace = 0.0  # EMA of tr(Σ)
        self.count = 0  # estimates taken in
        self.skipped = 0  # steps without an estimate (one replica, non-finite numbers)

    def update(self, est: tuple[float, float] | None) -> bool:
        """Take in one step's estimate; False if there was none."""
        if est is None:
            self.skipped += 1
            return False
        d = self.decay
        self.grad_sq = d * self.grad_sq + (1 - d) * est[0]
        self.trace = d * self.trace + (1 - d) * est[1]
        self.count += 1
        return True

    def _corrected(self, x: float) -> float:
        return x / (1 - self.decay**self.count)

    @property
    def grad_sq_est(self) -> float | None:
        """Smoothed ``|∇L|²`` (bias-corrected), None before any estimate."""
        return self._corrected(self.grad_sq) if self.count else None

    @property
    def trace_est(self) -> float | None:
        """Smoothed ``tr(Σ)`` (bias-corrected), None before any estimate."""
        return self._corrected(self.trace) if self.count else None

    @property
    def noise_scale(self) -> float | None:
        """``B_simple = tr(Σ)/|∇L|²`` of the smoothed values; None before any
        estimate, ``inf`` while the smoothed ``|∇L|²`` is not positive, 0
        while ``tr(Σ)`` is not."""
        if not self.count:
            return None
        if self.grad_sq <= 0.0:
            return math.inf
        return max(self.trace, 0.0) / self.grad_sq

    def gain(self, batch: float, base: float) -> float:
        """AdaScale's gain at ``batch`` against ``base`` (1 before any estimate)."""
        phi = self.noise_scale
        return 1.0 if phi is None else adascale_gain(phi, batch, base)

    def efficiency(self, batch: float, base: float) -> float:
        """Pollux's ``E(B)`` (1 before any estimate)."""
        phi = self.noise_scale
        return 1.0 if phi is None else efficiency(phi, batch, base)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> "NoiseScale":
        ns = cls(float(d.get("decay", EMA_DECAY)))
        ns.__dict__.update(d)
        return ns
