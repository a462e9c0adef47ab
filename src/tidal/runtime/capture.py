"""Finding the training objects a newcomer needs, so that a script does not
have to register them (Elan's RegisterState, done for the user).

When a worker joins its job (the first ``job.epochs()`` or batch), every
optimizer over the model's parameters, every LR scheduler of those optimizers
and every enabled AMP GradScaler alive in the process is added to the elastic
state, in an order every worker computes alike (the same script builds the
same objects). An optimizer over the model's parameters that appears later,
once training runs, is refused by name at its first ``step()``: its state
could not reach a newcomer.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tidal.runtime.state import ElasticState

log = logging.getLogger(__name__)


def _param_rank(model: torch.nn.Module) -> dict[int, int]:
    return {id(p): i for i, p in enumerate(model.parameters())}


def _order_key(obj: Any) -> str:
    """A key equal on every worker for objects built alike."""
    try:
        sd = obj.state_dict()
    except Exception:  # noqa: BLE001 - a state_dict that cannot be taken yet sorts by class only
        sd = {}
    items = sorted((k, repr(v)) for k, v in sd.items() if not isinstance(v, (dict, list, torch.Tensor)))
    return f"{type(obj).__qualname__}:{items}"


def find_optimizers(model: torch.nn.Module, objs: list[Any]) -> list[torch.optim.Optimizer]:
    """Optimizers holding any of the model's parameters, by their first parameter's position."""
    ranks = _param_rank(model)

    def first(o: torch.optim.Optimizer) -> int:
        return min((ranks[id(p)] for g in o.param_groups for p in g["params"] if id(p) in ranks), default=-1)

    found = [o for o in objs if issubclass(type(o), torch.optim.Optimizer) and first(o) >= 0]
    return sorted(found, key=lambda o: (first(o), _order_key(o)))


def find_schedulers(optimizers: list[torch.optim.Optimizer], objs: list[Any]) -> list[Any]:
    """LR schedulers of those optimizers (SequentialLR's parts included)."""
    index = {id(o): i for i, o in enumerate(optimizers)}
    found = [s for s in objs if issubclass(type(s), LRScheduler)
             and id(getattr(s, "optimizer", None)) in index]
    return sorted(found, key=lambda s: (index[id(s.optimizer)], _order_key(s)))


def find_scalers(objs: list[Any]) -> list[Any]:
    """Enabled AMP GradScalers (``torch.amp`` and ``torch.cuda.amp``)."""
    found = [s for s in objs if issubclass(type(s), torch.amp.GradScaler) and s.is_enabled()]
    return sorted(found, key=_order_key)


def complete(state: ElasticState) -> list[str]:
    """Add what the user did not register; returns what was added (logged)."""
    kinds = (torch.optim.Optimizer, LRScheduler, torch.amp.GradScaler)
    # one pass over the heap; type() rather than isinstance, which would touch lazy modules' __class__
    objs = [o for o in gc.get_objects() if issubclass(type(o), kinds)]
    added: list[str] = []
    if not state.optimizers:
        state.optimizers = find_optimizers(state.model, objs)
        added += [f"optimizer {type(o).__name__}" for o in state.optimizers]
    if not state.schedulers and state.optimizers:
        state.schedulers = find_schedulers(state.optimizers, objs)
        added += [f"LR scheduler {type(s).__name__}" for s in state.schedulers]
    if state.scaler is None:
        scalers = find_scalers(objs)
        if len(scalers) > 1:
            raise RuntimeError(f"{len(scalers)} GradScalers are alive; register the one training uses: "
                               "job.register_state(model, scaler=scaler)")
        if scalers:
            state.scaler = scalers[0]
            added.append("GradScaler")
    if added:
        log.info("elastic state: found %s", ", ".join(added))
    return added


class LateOptimizerGuard:
    """Refuses, at its first step, an optimizer over the model's parameters
    that is not in the elastic state; calls ``stepped`` after every step of
    one that is (the step boundary). While ``dropped()`` (a peer died in
    this step's all-reduce) a known optimizer's step changes nothing: its
    parameters' zeroed gradients are hidden from it for that call (momentum,
    weight decay and Adam's moments would move the parameters even on zero
    gradients), and are there again for the script afterwards."""

    def __init__(self, state: ElasticState, stepped: Callable[[], None],
                 dropped: Callable[[], bool] = lambda: False) -> None:
        self.state, self.stepped, self.dropped = state, stepped, dropped
        self._params = {id(p) for p in state.model.parameters()}
        self._known = {id(o) for o in state.optimizers}
        self._hidden: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._handles = [register_optimizer_step_pre_hook(self._check)]
        self._handles += [o.register_step_post_hook(self._post) for o in state.optimizers]

    def _check(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(opt) in self._known:
            if self.dropped():
                hidden = [(p, p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None]
                for p, _ in hidden:
                    p.grad = None
                self._hidden[id(opt)] = hidden
            return
        if any(id(p) in self._params for g in opt.param_groups for p in g["params"]):
            raise RuntimeError(
                f"{type(opt).__name__} over the model's parameters was created after the job started, so its "
                "state cannot reach a worker that joins later. Create it before the training loop "
                "(before job.epochs() or the first batch), or pass it to job.register_state(model, optimizer)")

    def _post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for p, grad in self._hidden.pop(id(opt), ()):
            p.grad = grad
        self.stepped()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
