"""The elastic state (Elan's RegisterState): everything a newcomer needs to
continue exactly where the others are: model, optimizer, LR scheduler, RNG
states and user extras. Hooks run after every rescale (Elan's RegisterHook)."""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import torch

RescaleHook = Callable[[int, int], None]
"""``hook(old_world_size, new_world_size)``, called after a switch on every
worker of the new generation."""


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
