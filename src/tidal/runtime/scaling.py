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

Policies registered in :data:`POLICIES`; state is a JSON-able dict so it can be
sent to newcomers with the rest of the elastic state.
"""

from __future__ import annotations

import abc
from typing import Any


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

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)


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


POLICIES: dict[str, type[BatchPolicy]] = {p.name: p for p in (StrongScaling, WeakScaling, HybridScaling)}


def make_policy(name: str, batch_size: int, **kw: Any) -> BatchPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown scaling {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name](batch_size, **kw)
