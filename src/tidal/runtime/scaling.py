"""How the global batch and learning rate follow the number of workers.

* ``strong`` (default): the global batch ``B`` is fixed; local batches may be
  uneven and gradients are weighted by local batch size, so every update is the
  fixed-size update (Elan §V-B serial semantics).
* ``weak``: the local batch ``b`` is fixed, ``B = b * n``, and the learning rate
  is scaled linearly with ``B`` (Goyal et al.).
* ``hybrid``: Elan's hybrid scaling (Algorithm 1): keep ``B`` while the local
  batch stays in ``[min_local, max_local]``; otherwise move ``B`` to
  ``n * clip(B / n)`` and scale the learning rate linearly, progressively over
  ``warmup_steps`` steps (eq. 3: ``lr_t = lr_0 + (lr_1 - lr_0) * t / T``).
* ``goodput``: Pollux's co-adaptation (OSDI'21 §3-4): at every switch (and
  when the measured noise scale drifts by more than ``drift``) the global
  batch moves to the one in ``[B0, max_batch]`` with the highest goodput on
  the new world size, and the learning rate follows by ``lr_rule``
  (AdaScale's gain, sqrt or linear; :mod:`tidal.runtime.goodput`).

Any policy measures the gradient noise scale (:mod:`tidal.runtime.noise`)
when made with ``noise_scale=True`` (``goodput`` always does).

Policies registered in :data:`POLICIES`; state is a JSON-able dict so it can be
sent to newcomers with the rest of the elastic state.
"""

from __future__ import annotations

import abc
import logging
import math
from typing import Any

from tidal.runtime.goodput import LR_RULES, StepSample, choose_batch, fit_step_time, lr_factor
from tidal.runtime.noise import EMA_DECAY, NoiseScale, StepNorms, estimate

log = logging.getLogger(__name__)

#: smoothed estimates needed before the noise scale's drift changes the batch between switches
#: (the EMA's window, 1/(1 - EMA_DECAY)); a switch uses whatever estimate there is
DRIFT_AFTER = 20


class BatchPolicy(abc.ABC):
    """Global batch size and LR factor as functions of the world size."""

    name = "base"

    def __init__(self, batch_size: int) -> None:
        self.base_batch = int(batch_size)
        self.batch = int(batch_size)
        # progressive LR: factor moves linearly from lr_from to lr_to over [t0, t0+T)
        self.lr_from = 1.0
        self.lr_to = 1.0
        self.t0 = 0
        self.warmup = 0
        self.noise: NoiseScale | None = None  # the gradient noise scale, when measured

    @abc.abstractmethod
    def start(self, world_size: int) -> int:
        """Global batch for the first generation."""

    @abc.abstractmethod
    def rescale(self, step: int, old_world: int, new_world: int) -> int:
        """New global batch after a switch at ``step``; may retarget the LR."""

    def lr_factor(self, step: int) -> float:
        """Multiplier on the user's learning rate at ``step`` (eq. 3)."""
        if self.warmup <= 0 or step >= self.t0 + self.warmup:
            return self.lr_to
        frac = max(0.0, (step - self.t0) / self.warmup)
        return self.lr_from + (self.lr_to - self.lr_from) * frac

    def _retarget(self, step: int, factor: float, warmup: int) -> None:
        self.lr_from, self.lr_to, self.t0, self.warmup = self.lr_factor(step), factor, step, warmup

    def observe(self, norms: StepNorms | None, timing: StepSample | None) -> None:
        """One synced step's reduced numbers (equal on every rank): the
        gradient norms (when the noise scale is measured) and, when every
        rank measured it, the step's timing."""
        if self.noise is not None and norms is not None:
            self.noise.update(estimate(norms))

    def revise(self, step: int, world: int) -> int | None:
        """At a step boundary without a switch: a new global batch, or None
        to keep it (only ``goodput`` ever changes it there)."""
        return None

    def report(self, step: int) -> dict[str, Any]:
        """The numbers a script and the master see (``job.goodput``)."""
        ns = self.noise
        phi = ns.noise_scale if ns is not None else None
        return {"scaling": self.name, "batch": self.batch, "base_batch": self.base_batch,
                "lr_factor": self.lr_factor(step), "noise_scale": phi,
                "grad_sq": ns.grad_sq_est if ns is not None else None,
                "trace": ns.trace_est if ns is not None else None,
                "estimates": ns.count if ns is not None else 0,
                "efficiency": ns.efficiency(self.batch, self.base_batch) if ns is not None else None,
                "gain": ns.gain(self.batch, self.base_batch) if ns is not None else None}

    def state_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["noise"] = self.noise.state_dict() if self.noise is not None else None
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        d = dict(d)
        noise = d.pop("noise", None)
        self.__dict__.update(d)
        self.noise = NoiseScale.from_state(noise) if noise is not None else None


class StrongScaling(BatchPolicy):
    name = "strong"

    def start(self, world_size: int) -> int:
        return self.batch

    def rescale(self, step: int, old_world: int, new_world: int) -> int:
        return self.batch


class WeakScaling(BatchPolicy):
    """``batch_size`` is the *local* batch; LR scales linearly with ``B``."""

    name = "weak"

    def __init__(self, batch_size: int, ref_world: int | None = None) -> None:
        super().__init__(batch_size)
        self.local = int(batch_size)
        self.ref_world = ref_world

    def start(self, world_size: int) -> int:
        if self.ref_world is None:
            self.ref_world = world_size
        self.batch = self.local * world_size
        self.lr_from = self.lr_to = world_size / self.ref_world
        return self.batch

    def rescale(self, step: int, old_world: int, new_world: int) -> int:
        self.batch = self.local * new_world
        assert self.ref_world is not None
        self._retarget(step, new_world / self.ref_world, 0)
        return self.batch


class HybridScaling(BatchPolicy):
    """Elan Algorithm 1 with progressive linear LR scaling (eq. 3)."""

    name = "hybrid"

    def __init__(self, batch_size: int, min_local: int = 1, max_local: int | None = None, warmup_steps: int = 100) -> None:
        super().__init__(batch_size)
        self.min_local = int(min_local)
        self.max_local = int(max_local) if max_local is not None else int(batch_size)
        self.warmup_steps = int(warmup_steps)

    def start(self, world_size: int) -> int:
        return self.batch

    def rescale(self, step: int, old_world: int, new_world: int) -> int:
        local = self.batch / new_world
        if self.min_local <= local <= self.max_local:
            return self.batch  # strong scaling is efficient enough: keep B
        clipped = min(max(local, self.min_local), self.max_local)
        new_batch = int(round(clipped * new_world))
        self._retarget(step, new_batch / self.base_batch, self.warmup_steps)
        self.batch = new_batch
        return self.batch


class GoodputScaling(BatchPolicy):
    """Pollux's batch-size co-adaptation (OSDI'21 §3-4) in the runtime:
    ``batch_size`` is the base batch ``B0`` (the one the learning rate is
    tuned for, and the smallest batch used). At every switch the global
    batch moves to :func:`~tidal.runtime.goodput.choose_batch` on the new
    world size, under ``max_batch`` (default ``8 * B0``) and ``max_local`` per rank (no automatic
    gradient accumulation: the cap is the limit), and the LR factor to
    ``lr_rule`` at that batch (held until the batch changes again). Between
    switches the batch is re-chosen when the noise scale moved by more than
    a factor ``drift`` since the last choice (``drift=None``: at switches
    only). Until the noise scale is measured (two replicas, one synced
    step) the batch stays where it is."""

    name = "goodput"

    def __init__(self, batch_size: int, max_batch: int | None = None, max_local: int | None = None,
                 lr_rule: str = "adascale", drift: float | None = 2.0, smoothing: float = EMA_DECAY) -> None:
        super().__init__(batch_size)
        check_goodput_args(int(batch_size), max_batch, max_local, lr_rule, drift)
        self.max_batch = int(max_batch) if max_batch is not None else 8 * self.base_batch
        self.max_local = int(max_local) if max_local is not None else None
        self.lr_rule = lr_rule
        self.drift = float(drift) if drift else None
        self.noise = NoiseScale(smoothing)
        self.timings: dict[str, list[float]] = {}  # "world:batch" -> [world, batch, steps, Σ compute, Σ step]
        self.chosen_at: float | None = None  # the noise scale of the last choice
        self.choices = 0

    def start(self, world_size: int) -> int:
        return self.batch

    def rescale(self, step: int, old_world: int, new_world: int) -> int:
        self._choose(step, new_world)
        return self.batch

    def revise(self, step: int, world: int) -> int | None:
        ns, at = self.noise, self.chosen_at
        phi = ns.noise_scale if ns is not None else None
        if self.drift is None or phi is None or ns is None or ns.count < DRIFT_AFTER:
            return None
        if not drifted(at, phi, self.drift):
            return None
        old = self.batch
        self._choose(step, world)
        return self.batch if self.batch != old else None

    def observe(self, norms: StepNorms | None, timing: StepSample | None) -> None:
        super().observe(norms, timing)
        if timing is None:
            return
        key = f"{timing.world}:{self.batch}"
        rec = self.timings.setdefault(key, [float(timing.world), float(self.batch), 0.0, 0.0, 0.0])
        rec[2] += 1
        rec[3] += timing.compute_s
        rec[4] += timing.step_s

    def report(self, step: int) -> dict[str, Any]:
        """The base numbers and the largest batch it may choose (a scheduler
        rates the job's larger allocations with it)."""
        return {**super().report(step), "max_batch": self.max_batch}

    def samples(self) -> list[StepSample]:
        """The measured configurations, as the model's input."""
        return [StepSample(int(n), b / n, int(c), sc / c, ss / c) for n, b, c, sc, ss in self.timings.values() if c]

    def _choose(self, step: int, world: int) -> None:
        phi = self.noise.noise_scale if self.noise is not None else None
        self.choices += 1
        if phi is None:
            log.info("goodput: no noise-scale estimate yet: global batch stays %d on %d workers", self.batch, world)
            return
        model = fit_step_time(self.samples())
        new = choose_batch(phi, self.base_batch, self.max_batch, self.max_local, world, model)
        self.chosen_at = phi
        factor = lr_factor(self.lr_rule, phi, new, self.base_batch)
        if new != self.batch or factor != self.lr_to:
            log.info("goodput: noise scale %.4g on %d workers: global batch %d -> %d, LR factor %.4g (%s)",
                     phi, world, self.batch, new, factor, self.lr_rule)
        self.batch = new
        self._retarget(step, factor, 0)


def drifted(chosen_at: float | None, phi: float, factor: float) -> bool:
    """The noise scale ``phi`` moved by more than ``factor`` from the one the
    batch was chosen with (values below 1 count as 1: the batch is ``B0``
    there anyway); True if no choice used an estimate yet."""
    if chosen_at is None:
        return True
    a, p = max(chosen_at, 1.0), max(phi, 1.0)
    if math.isinf(a) or math.isinf(p):
        return a != p
    return not p / factor <= a <= p * factor


def check_goodput_args(batch: int, max_batch: int | None, max_local: int | None, lr_rule: str,
                       drift: float | None) -> None:
    """ValueError naming the first bad argument of ``scaling="goodput"``."""
    if batch < 1:
        raise ValueError(f"goodput scaling: batch_size must be at least 1, not {batch}")
    if max_batch is not None and int(max_batch) < batch:
        raise ValueError(f"goodput scaling: max_batch ({max_batch}) is below batch_size ({batch})")
    if max_local is not None and int(max_local) < 1:
        raise ValueError(f"goodput scaling: max_local must be at least 1, not {max_local}")
    if lr_rule not in LR_RULES:
        raise ValueError(f"goodput scaling: lr_rule must be one of {', '.join(LR_RULES)}, not {lr_rule!r}")
    if drift is not None and drift != 0 and not float(drift) > 1.0:
        raise ValueError(f"goodput scaling: drift must be a factor above 1 (or None), not {drift!r}")


POLICIES: dict[str, type[BatchPolicy]] = {p.name: p for p in (StrongScaling, WeakScaling, HybridScaling,
                                                                GoodputScaling)}


def make_policy(name: str, batch_size: int, noise_scale: bool = False, **kw: Any) -> BatchPolicy:
    """The policy ``name``; ``noise_scale=True`` also measures the gradient
    noise scale (always on for ``goodput``)."""
    if name not in POLICIES:
        raise ValueError(f"unknown scaling {name!r}; known: {sorted(POLICIES)}")
    try:
        policy = POLICIES[name](batch_size, **kw)
    except TypeError as e:
        raise ValueError(f"scaling {name!r}: {e}") from None
    if noise_scale and policy.noise is None:
        policy.noise = NoiseScale()
    return policy
