"""The elastic state (Elan's RegisterState): everything a newcomer needs to
continue exactly where the others are: model, optimizer, LR scheduler, RNG
states and user extras. Hooks run after every rescale (Elan's RegisterHook).

:class:`TrainState` adds what the next step starts from besides the user's
objects (the data cursor, the step, the batch policy); its :meth:`~TrainState.
payload` is what newcomers receive (EDL §4.2) and what checkpoints hold.
:class:`StepSnapshot` is the user-side state at the start of a step, restored
when that step is dropped because a peer died (Elan §V-B).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from tidal.runtime.scaling import BatchPolicy, make_policy

RescaleHook = Callable[[int, int], None]
"""``hook(old_world_size, new_world_size)``, called after a switch on every
worker of the new generation."""


@dataclass(frozen=True)
class StepSnapshot:
    """What user code may change after a step that is then dropped: the LR
    scheduler, the extras, the torch RNG and the optimizer's param-group
    settings (a scheduler stepped after a dropped step also wrote the LR into
    the param groups; restoring the scheduler alone would not undo that)."""

    scheduler: dict[str, Any] | None
    extras: dict[str, Any]
    rng: torch.Tensor
    groups: list[dict[str, Any]] | None


class ElasticState:
    """Holds references to the user's objects; no subclassing needed.

    ``extras`` is a dict of picklable user values (e.g. a best-loss counter);
    it is replaced in place on newcomers so references stay valid.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        extras: dict[str, Any] | None = None,
        rng: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.extras = extras if extras is not None else {}
        self.rng = rng

    def state_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"model": self.model.state_dict(), "extras": dict(self.extras)}
        if self.optimizer is not None:
            d["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            d["scheduler"] = self.scheduler.state_dict()
        if self.rng:
            d["rng"] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.model.load_state_dict(d["model"])
        if self.optimizer is not None and "optimizer" in d:
            self.optimizer.load_state_dict(d["optimizer"])
        if self.scheduler is not None and "scheduler" in d:
            self.scheduler.load_state_dict(d["scheduler"])
        if self.rng and "rng" in d:
            torch.set_rng_state(d["rng"]["torch"])
            np.random.set_state(d["rng"]["numpy"])
            random.setstate(d["rng"]["python"])
        self.extras.clear()
        self.extras.update(d.get("extras", {}))

    def step_snapshot(self) -> StepSnapshot:
        """The user-side state at the start of a step (see :class:`StepSnapshot`)."""
        opt = self.optimizer
        return StepSnapshot(
            scheduler=copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None,
            extras=copy.deepcopy(self.extras),
            rng=torch.get_rng_state(),
            groups=[copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups]
            if opt is not None else None,
        )

    def restore_step_snapshot(self, snap: StepSnapshot) -> None:
        """Undo the user-side effects of a dropped step."""
        if self.scheduler is not None and snap.scheduler is not None:
            self.scheduler.load_state_dict(snap.scheduler)
        self.extras.clear()
        self.extras.update(snap.extras)
        torch.set_rng_state(snap.rng)
        if self.optimizer is not None and snap.groups is not None:
            for g, saved in zip(self.optimizer.param_groups, snap.groups):
                g.update(saved)


@dataclass
class TrainState:
    """What the next step starts from: the user's :class:`ElasticState`, the
    data cursor (one integer, the global sample position), the step count,
    the batch policy and the LR factor already applied to the optimizer.

    Owned (written) by the training thread; the heartbeat thread only reads
    ``step``/``cursor`` for its progress reports."""

    elastic: ElasticState | None = None
    policy: BatchPolicy = field(default_factory=lambda: make_policy("strong", 1))
    global_batch_size: int = 1
    cursor: int = 0
    step: int = 0
    lr_applied: float = 1.0

    def payload(self) -> dict[str, Any]:
        """Everything the next step starts from (state transfer and checkpoints)."""
        assert self.elastic is not None
        return {
            "state": self.elastic.state_dict(),
            "cursor": self.cursor,
            "step": self.step,
            "policy": self.policy.state_dict(),
            "lr_applied": self.lr_applied,
        }

    def load_payload(self, p: dict[str, Any]) -> None:
        assert self.elastic is not None
        self.elastic.load_state_dict(p["state"])
        self.cursor, self.step = int(p["cursor"]), int(p["step"])
        self.policy.load_state_dict(p["policy"])
        self.global_batch_size = self.policy.batch
        self.lr_applied = float(p["lr_applied"])

    def apply_lr(self) -> None:
        """Bring the optimizer's learning rates to the policy's factor at this step (Elan eq. 3)."""
        f = self.policy.lr_factor(self.step)
        if f != self.lr_applied and self.elastic is not None and self.elastic.optimizer is not None:
            for group in self.elastic.optimizer.param_groups:
                group["lr"] = group["lr"] * f / self.lr_applied
            self.lr_applied = f
