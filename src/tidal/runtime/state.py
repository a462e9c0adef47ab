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
from typing import Any, Callable, Sequence

import numpy as np
import torch

from tidal.runtime.scaling import BatchPolicy, make_policy

RescaleHook = Callable[[int, int], None]
"""``hook(old_world_size, new_world_size)``, called after a switch on every
worker of the new generation."""


@dataclass(frozen=True)
class StepSnapshot:
    """What user code may change after a step that is then dropped: the LR
    schedulers, the GradScaler, the extras, the torch RNG and the optimizers'
    param-group settings (a scheduler stepped after a dropped step also wrote
    the LR into the param groups; restoring the scheduler alone would not
    undo that)."""

    schedulers: list[dict[str, Any]]
    scaler: dict[str, Any] | None
    extras: dict[str, Any]
    rng: torch.Tensor
    groups: list[list[dict[str, Any]]]
    globals_: dict[str, Any] = field(default_factory=dict)  # the kept module-level variables


def bind_globals(module: dict[str, Any], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{name: module}`` for ``job.keep("name", ...)``; a name the module
    does not define is refused by name."""
    if missing := [n for n in names if n not in module]:
        raise NameError(f"job.keep: {', '.join(missing)} is not a module-level variable of "
                        f"{module.get('__file__', 'the script')} (define it before the call, or pass name=value)")
    return {n: module for n in names}


class Kept:
    """``job.keep(...)``'s values by attribute (``keep.lr``) or key
    (``keep["lr"]``): a view of the registered extras, so they travel with
    the model to newcomers and are restored when a step is dropped."""

    def __init__(self, values: Callable[[], dict[str, Any]]) -> None:
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values()[name]
        except KeyError:
            raise AttributeError(f"job.keep has no value {name!r}; kept: {sorted(self._values())}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self._values()[name] = value

    def __getitem__(self, name: str) -> Any:
        return self._values()[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self._values()[name] = value

    def __repr__(self) -> str:
        return f"Kept({self._values()!r})"


class ElasticState:
    """Holds references to the user's objects; no subclassing needed.

    ``optimizers`` and ``schedulers`` are lists (a GAN has two optimizers);
    ``scaler`` an AMP GradScaler. ``extras`` is a dict of picklable user values
    (e.g. a best-loss counter); it is replaced in place on newcomers so
    references stay valid. :mod:`tidal.runtime.capture` finds what the user
    did not register.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = (),
        schedulers: Any | Sequence[Any] | None = (),
        extras: dict[str, Any] | None = None,
        scaler: Any | None = None,
        rng: bool = True,
    ) -> None:
        self.model = model
        self.optimizers: list[torch.optim.Optimizer] = as_list(optimizers)
        self.schedulers: list[Any] = as_list(schedulers)
        self.scaler = scaler
        self.extras = extras if extras is not None else {}
        self.rng = rng
        self.bound: dict[str, dict[str, Any]] = {}  # job.keep("name"): a module-level variable and its module's dict

    def kept_globals(self) -> dict[str, Any]:
        """The current values of the module-level variables kept by name."""
        return {n: g[n] for n, g in self.bound.items() if n in g}

    def set_globals(self, values: dict[str, Any]) -> None:
        for n, v in values.items():
            if n in self.bound:
                self.bound[n][n] = v

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.optimizers[0] if self.optimizers else None

    @property
    def scheduler(self) -> Any | None:
        return self.schedulers[0] if self.schedulers else None

    def state_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"model": self.model.state_dict(), "extras": dict(self.extras),
                             "optimizers": [o.state_dict() for o in self.optimizers],
                             "schedulers": [s.state_dict() for s in self.schedulers]}
        if self.scaler is not None:
            d["scaler"] = self.scaler.state_dict()
        if self.rng:
            d["rng"] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if self.bound:
            d["globals"] = self.kept_globals()
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.model.load_state_dict(d["model"])
        _load_all("optimizer", self.optimizers, d.get("optimizers", []))
        _load_all("LR scheduler", self.schedulers, d.get("schedulers", []))
        if self.scaler is not None and "scaler" in d:
            self.scaler.load_state_dict(d["scaler"])
        if self.rng and "rng" in d:
            torch.set_rng_state(d["rng"]["torch"])
            np.random.set_state(d["rng"]["numpy"])
            random.setstate(d["rng"]["python"])
        self.extras.clear()
        self.extras.update(d.get("extras", {}))
        self.set_globals(d.get("globals", {}))

    def step_snapshot(self) -> StepSnapshot:
        """The user-side state at the start of a step (see :class:`StepSnapshot`).
        Taken at every step, so immutable values are shared, not copied."""
        return StepSnapshot(
            schedulers=[_copy_value(s.state_dict()) for s in self.schedulers],
            scaler=_copy_value(self.scaler.state_dict()) if self.scaler is not None else None,
            extras=_copy_value(self.extras) if self.extras else {},
            rng=torch.get_rng_state(),
            groups=[[_copy_group(g) for g in o.param_groups] for o in self.optimizers],
            globals_=_copy_value(self.kept_globals()) if self.bound else {},
        )

    def restore_step_snapshot(self, snap: StepSnapshot) -> None:
        """Undo the user-side effects of a dropped step."""
        for s, saved in zip(self.schedulers, snap.schedulers):
            s.load_state_dict(saved)
        if self.scaler is not None and snap.scaler is not None:
            self.scaler.load_state_dict(snap.scaler)
        self.extras.clear()
        self.extras.update(snap.extras)
        torch.set_rng_state(snap.rng)
        self.set_globals(snap.globals_)
        for o, groups in zip(self.optimizers, snap.groups):
            for g, saved in zip(o.param_groups, groups):
                g.update(saved)


_IMMUTABLE = (int, float, bool, str, bytes, type(None))
_PLAIN = frozenset(_IMMUTABLE)  # exact types, for a set lookup instead of isinstance


def _copy_group(group: dict[str, Any]) -> dict[str, Any]:
    """An optimizer param group's settings without its parameters, copied
    as :func:`_copy_value` does (taken every step: the plain numbers, nearly
    all of a group, are shared without a call each)."""
    return {k: v if type(v) in _PLAIN else _copy_value(v) for k, v in group.items() if k != "params"}


def _copy_value(v: Any) -> Any:
    """A copy of ``v`` that later in-place changes cannot reach: scalars and
    tuples of them shared, dicts and lists copied level by level, anything
    else (tensors, objects) deep-copied."""
    if isinstance(v, _IMMUTABLE):
        return v
    if type(v) is dict:
        return {k: _copy_value(x) for k, x in v.items()}
    if type(v) is list:
        return [_copy_value(x) for x in v]
    if type(v) is tuple and all(isinstance(x, _IMMUTABLE) for x in v):
        return v
    return copy.deepcopy(v)


def as_list(x: Any) -> list[Any]:
    """None, one object or a sequence of them, as a list."""
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _load_all(what: str, objs: list[Any], states: list[dict[str, Any]]) -> None:
    """Load states into objects, refusing a count mismatch by name."""
    if len(objs) != len(states):
        raise RuntimeError(f"the state has {len(states)} {what}(s) but this worker has {len(objs)}: every worker "
                           f"must build the same training objects (register them with job.register_state)")
    for o, st in zip(objs, states):
        o.load_state_dict(st)


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
    carried: dict[str, Any] | None = None  # every stream's carried state at a rescale (runtime.sequence)

    def payload(self) -> dict[str, Any]:
        """Everything the next step starts from (state transfer and checkpoints)."""
        assert self.elastic is not None
        return {
            "state": self.elastic.state_dict(),
            "cursor": self.cursor,
            "step": self.step,
            "policy": self.policy.state_dict(),
            "lr_applied": self.lr_applied,
            **({"carried": self.carried} if self.carried is not None else {}),
        }

    def load_payload(self, p: dict[str, Any]) -> None:
        assert self.elastic is not None
        self.elastic.load_state_dict(p["state"])
        self.cursor, self.step = int(p["cursor"]), int(p["step"])
        self.policy.load_state_dict(p["policy"])
        self.global_batch_size = self.policy.batch
        self.lr_applied = float(p["lr_applied"])
        self.carried = p.get("carried")

    def apply_lr(self) -> None:
        """Bring the optimizer's learning rates to the policy's factor at this step (Elan eq. 3)."""
        f = self.policy.lr_factor(self.step)
        if f != self.lr_applied and self.elastic is not None and self.elastic.optimizers:
            for opt in self.elastic.optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * f / self.lr_applied
            self.lr_applied = f
