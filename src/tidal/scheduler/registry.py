"""The built-in policies by name: ``get_policy("tiresias")``."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from tidal.scheduler.api import Policy
from tidal.scheduler.policies.backfill import Backfill
from tidal.scheduler.policies.chronus import Chronus
from tidal.scheduler.policies.edf import EDF
from tidal.scheduler.policies.elan import EFIFO, EBackfill
from tidal.scheduler.policies.elastic_tiresias import ElasticTiresias
from tidal.scheduler.policies.elasticflow import ElasticFlow
from tidal.scheduler.policies.fifo import FIFO
from tidal.scheduler.policies.gandiva import Gandiva
from tidal.scheduler.policies.gavel import Gavel
from tidal.scheduler.policies.k8s_default import K8sDefault
from tidal.scheduler.policies.optimus import Optimus
from tidal.scheduler.policies.pollux import Pollux
from tidal.scheduler.policies.reshaping import Reshaping
from tidal.scheduler.policies.termination import Termination
from tidal.scheduler.policies.themis import Themis
from tidal.scheduler.policies.tidal import Tidal
from tidal.scheduler.policies.tidal_goodput import TidalGoodput
from tidal.scheduler.policies.tidal_hetero import TidalHetero
from tidal.scheduler.policies.tiresias import Tiresias

_POLICIES: dict[str, Callable[..., Policy]] = {
    "backfill": Backfill,
    "chronus": Chronus,
    "e-backfill": EBackfill,
    "e-fifo": EFIFO,
    "edf": EDF,
    "elastic-tiresias": ElasticTiresias,
    "elasticflow": ElasticFlow,
    "fifo": FIFO,
    "gandiva": Gandiva,
    "gavel": Gavel,
    "k8s-default": K8sDefault,
    "optimus": Optimus,  # goodput study (Pollux, OSDI'21)
    "pollux": Pollux,  # goodput study
    "reshaping": Reshaping,
    "termination": Termination,
    "themis": Themis,
    "tidal": Tidal,
    "tidal-goodput": TidalGoodput,  # goodput study
    "tidal-hetero": TidalHetero,
    "tidal-hetero-agnostic": functools.partial(TidalHetero, hetero=False),
    "tiresias": Tiresias,
}


#: The public ElasticFlow artifact's ``--schedule`` names for the same policies.
ALIASES: dict[str, str] = {
    "ef-accessctrl": "elasticflow",
    "ef": "elasticflow",
    "dlas-gpu": "tiresias",
}


def canonical(name: str) -> str:
    """The registry name for ``name`` or its alias (``dlas-gpu`` -> ``tiresias``)."""
    return ALIASES.get(name, name)


def is_policy(name: str) -> bool:
    """``name`` is a policy or an alias of one."""
    return canonical(name) in _POLICIES


def get_policy(name: str, **options: Any) -> Policy:
    """A new policy object; ``options`` go to its constructor. ``name`` may be
    an alias; the policy keeps the name it was asked by."""
    try:
        factory = _POLICIES[canonical(name)]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(_POLICIES))} "
                         f"(aliases: {', '.join(sorted(ALIASES))})") from None
    policy = factory(**options)
    policy.name = name
    return policy


def get_policy_for_slot(name: str, slot: float, **options: Any) -> Policy:
    """A policy that plans in time slots (ElasticFlow, Chronus, ...) is told
    the executor's scheduling slot; others ignore it."""
    factory = _POLICIES.get(canonical(name))
    if factory is not None and slot > 0 and "slot" in inspect.signature(factory).parameters:
        options.setdefault("slot", slot)
    return get_policy(name, **options)


def policy_names() -> list[str]:
    return sorted(_POLICIES)
