"""A fitted model of a data-parallel training step's time (Pollux, OSDI'21, §3.2).

For one application on one GPU type, a step of a placement with ``N`` nodes,
``K`` replicas (GPUs) and ``m`` samples per replica takes

* compute ``Tc(m) = a_c + b_c * m`` (forward and backward pass, affine in the
  local batch);
* gradient synchronisation ``Ts(N, K)``: 0 for one replica,
  ``a_local + b_local * (K - 2)`` within one node and
  ``a_node + b_node * (K - 2)`` across nodes (ring all-reduce: a fixed cost
  plus a term growing with the replicas);
* and the two overlap (back-propagation pipelines with all-reduce):
  ``T = (Tc^g + Ts^g)^(1/g)`` with ``g >= 1`` (``g = 1``: no overlap, the
  sum; large ``g``: full overlap, the max).

Above the largest local batch that fits (:attr:`StepTimeParams.max_local_bsz`,
the largest measured) a step accumulates gradients over ``s = ceil(m / max)``
micro-steps of ``m / s`` samples; only the last one synchronises:
``T = (s - 1) * Tc(m/s) + (Tc(m/s)^g + Ts^g)^(1/g)``.

:func:`fit` finds the seven parameters by least squares on the logarithms
(relative errors) of the measured compute (single-GPU steps),
synchronisation and whole-step times at once, so each term is pinned by its own measurements and ``g`` by
how far the whole step is below their sum. Pure functions; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tidal.core.errors import InputError

#: bounds of the overlap exponent (1: none; 10: practically the max of the two)
GAMMA_BOUNDS = (1.0, 10.0)
_FLOOR = 1e-6  # seconds: the least any time term may be (keeps the logarithms finite)


@dataclass(frozen=True)
class StepRow:
    """One measurement: a placement of ``nodes`` nodes and ``replicas`` GPUs
    at ``local_bsz`` samples per GPU took ``step_time`` seconds per step, of
    which ``sync_time`` synchronising gradients."""

    nodes: int
    replicas: int
    local_bsz: float
    step_time: float
    sync_time: float


@dataclass(frozen=True)
class StepTimeParams:
    """Fitted parameters of one (application, GPU type); times in seconds."""

    a_compute: float
    b_compute: float  # per sample
    a_local: float  # sync within one node, at 2 replicas
    b_local: float  # ... per further replica
    a_node: float  # sync across nodes, at 2 replicas
    b_node: float
    gamma: float
    max_local_bsz: float  # above it: gradient accumulation
    min_local_bsz: float = 1.0  # the smallest measured (below it the model extrapolates)
    median_rel_error: float = math.nan  # over the rows it was fitted to
    rows: int = 0

    def as_vector(self) -> np.ndarray:
        return np.array([self.a_compute, self.b_compute, self.a_local, self.b_local,
                         self.a_node, self.b_node, self.gamma])


def _times(x: Sequence[float], nodes: np.ndarray, replicas: np.ndarray,
           local: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compute, sync and overlapped step times (no accumulation), vectorised."""
    a_c, b_c, a_l, b_l, a_n, b_n, g = x
    tc = a_c + b_c * local
    extra = np.maximum(replicas - 2, 0)
    ts = np.where(nodes > 1, a_n + b_n * extra, a_l + b_l * extra)
    ts = np.where(replicas > 1, ts, 0.0)
    total = (tc ** g + ts ** g) ** (1.0 / g)
    return tc, ts, total


def step_time(params: StepTimeParams, nodes: int, replicas: int, local_bsz: float) -> float:
    """Seconds per optimizer step of ``replicas`` GPUs on ``nodes`` nodes at
    ``local_bsz`` samples per GPU (with gradient accumulation above
    ``params.max_local_bsz``)."""
    if nodes < 1 or replicas < nodes:
        raise InputError(f"a placement needs 1 <= nodes <= replicas, got {nodes} nodes, {replicas} replicas",
                         field="replicas")
    if not local_bsz > 0:
        raise InputError(f"must be > 0, got {local_bsz}", field="local_bsz")
    steps = accumulation_steps(params, local_bsz)
    m = local_bsz / steps
    tc, _, total = _times(params.as_vector(), np.array(nodes), np.array(replicas), np.array(m))
    return float((steps - 1) * tc + total)


def accumulation_steps(params: StepTimeParams, local_bsz: float) -> int:
    """Micro-steps per step at ``local_bsz`` samples per GPU: 1 up to the
    largest local batch that fits, else ``ceil(local_bsz / max_local_bsz)``."""
    return max(1, math.ceil(local_bsz / params.max_local_bsz - 1e-9))


def _arrays(rows: Sequence[StepRow]) -> dict[str, np.ndarray]:
    return {
        "nodes": np.array([r.nodes for r in rows], dtype=float),
        "replicas": np.array([r.replicas for r in rows], dtype=float),
        "local": np.array([r.local_bsz for r in rows], dtype=float),
        "step": np.array([r.step_time for r in rows], dtype=float),
        "sync": np.array([r.sync_time for r in rows], dtype=float),
    }


def _initial(d: dict[str, np.ndarray]) -> np.ndarray:
    """A starting point: compute by linear least squares, sync by group means."""
    compute = np.maximum(d["step"] - d["sync"], _FLOOR)
    if len(np.unique(d["local"])) > 1:
        b_c, a_c = np.polyfit(d["local"], compute, 1)
    else:
        a_c, b_c = float(np.mean(compute)) / 2, float(np.mean(compute / d["local"])) / 2
    multi = d["replicas"] > 1
    one_node = multi & (d["nodes"] == 1)
    many = multi & (d["nodes"] > 1)
    a_l = float(np.median(d["sync"][one_node])) if one_node.any() else 0.01
    a_n = float(np.median(d["sync"][many])) if many.any() else a_l
    return np.array([max(a_c, _FLOOR), max(b_c, _FLOOR), max(a_l, _FLOOR), _FLOOR,
                     max(a_n, _FLOOR), _FLOOR, 1.5])


_LOG_RANGE = (math.log(1e-9), math.log(1e3))  # seconds: where the time terms may go


def _to_free(x: np.ndarray) -> np.ndarray:
    """Unconstrained coordinates: logarithms of the six time terms, and the
    logit of the overlap exponent within :data:`GAMMA_BOUNDS`."""
    lo, hi = GAMMA_BOUNDS
    g = min(max(x[6], lo + 1e-3), hi - 1e-3)
    return np.append(np.log(np.maximum(x[:6], _FLOOR)), math.log((g - lo) / (hi - g)))


def _from_free(z: np.ndarray) -> np.ndarray:
    lo, hi = GAMMA_BOUNDS
    return np.append(np.exp(np.clip(z[:6], *_LOG_RANGE)), lo + (hi - lo) / (1.0 + math.exp(-min(max(z[6], -50), 50))))


def fit(rows: Sequence[StepRow]) -> StepTimeParams:
    """Least-squares fit of the step-time model to measured rows (Pollux,
    OSDI'21, fits the same terms to the throughput it observes), by
    Levenberg-Marquardt on the logarithms of the terms (so they stay
    positive) and the logit of ``g`` (so it stays in :data:`GAMMA_BOUNDS`). The
    residuals are log-ratios of the model's times to the measured ones:
    compute on single-GPU rows (no sync there; elsewhere ``step - sync``
    is not the compute time when the two overlap), sync on multi-GPU rows
    and the whole step on every row. With no multi-node row the
    inter-node terms equal the intra-node ones (Sia's ``quad`` data: one node)."""
    rows = [r for r in rows if r.step_time > 0 and r.local_bsz > 0]
    if not rows:
        raise InputError("no measured rows to fit", field="rows")
    d = _arrays(rows)
    compute_obs = d["step"] - d["sync"]
    single = d["replicas"] == 1  # no sync: the step is all compute (elsewhere the two overlap)
    has_c = (compute_obs > 0) & (single if single.any() else True)
    multi = (d["replicas"] > 1) & (d["sync"] > 0)
    log_c, log_s, log_t = np.log(compute_obs[has_c]), np.log(d["sync"][multi]), np.log(d["step"])
    x0 = _initial(d)
    free = np.ones(7, dtype=bool)
    if not (d["nodes"] > 1).any():  # nothing measures the inter-node terms: they stay the intra-node ones
        free[4:6] = False
    z0 = _to_free(x0)

    def full(z: np.ndarray) -> np.ndarray:
        zz = z0.copy()
        zz[free] = z
        x = _from_free(zz)
        if not free[4]:
            x[4:6] = x[2:4]
        return x

    def residuals(z: np.ndarray) -> np.ndarray:
        tc, ts, total = _times(full(z), d["nodes"], d["replicas"], d["local"])
        return np.concatenate([np.log(tc[has_c]) - log_c, np.log(ts[multi]) - log_s, np.log(total) - log_t])

    from scipy.optimize import least_squares  # imported here: scipy.optimize takes a second to load

    x = full(least_squares(residuals, z0[free], method="lm", max_nfev=300).x)
    _, _, total = _times(x, d["nodes"], d["replicas"], d["local"])
    err = float(np.median(np.abs(total - d["step"]) / d["step"]))
    return StepTimeParams(*map(float, x), max_local_bsz=float(d["local"].max()),
                          min_local_bsz=float(d["local"].min()), median_rel_error=err,
                          rows=len(rows))


def relative_errors(params: StepTimeParams, rows: Sequence[StepRow]) -> np.ndarray:
    """``|model - measured| / measured`` of each row's whole step time."""
    d = _arrays(rows)
    _, _, total = _times(params.as_vector(), d["nodes"], d["replicas"], d["local"])
    return np.abs(total - d["step"]) / d["step"]
