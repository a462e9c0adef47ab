"""Tidal's elastic runtime: stop-free rescaling of plain PyTorch jobs with
exactly-once data and fixed-run equivalence. See ``docs/runtime.md``.

Worker side: :func:`init`, :class:`Job`, :class:`ElasticState`.
Job master: :class:`JobMaster`, :class:`MasterServer`, :class:`MasterClient`.
Operations: :func:`profile` (a job's scaling curve), :func:`assign_sources`
(who sends newcomers their state).

Names are loaded on first use (PEP 562), so that importing a light module of
this package (``tidal.runtime.spawner``, ``tidal.runtime.client``) does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "client": ("MasterClient", "MasterUnavailable"),
    "data": ("ShardManager", "ShardReader", "epoch_permutation", "split_sizes", "step_slice"),
    "loader": ("ElasticLoader",),
    "master": ("JobMaster",),
    "server": ("MasterServer",),
    "messages": ("Generation", "SwitchPlan", "ScaleAnswer", "Status"),
    "reducer": ("GradReducer",),
    "persistence": ("StateBackend", "open_backend", "register_backend"),
    "profiling": ("ProfileResult", "profile"),
    "replication": ("Location", "assign_sources"),
    "scaling": ("BatchPolicy", "HybridScaling", "StrongScaling", "WeakScaling", "make_policy"),
    "state": ("ElasticState",),
    "worker": ("Job", "init"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tidal.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tidal.runtime.{module}"), name)
    globals()[name] = value
    return value
