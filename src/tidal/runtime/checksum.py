"""Replica checksums: the ranks of a generation compare a digest of what
must be equal on every replica of data-parallel training (the parameters,
the optimizers' state and hyper-parameters, the registered extras), so a
replica that drifted (a newcomer started from a plain Python value the
script never registered, such as an annealed learning rate used in a manual
update) fails the job at once with the names of what differs, instead of
training on silently.

The check runs in the first two synced steps of every generation (right
after a switch: the state newcomers have just received, then the first
update they made from it) and every ``$TIDAL_CHECK_EVERY`` steps. It is one small float64 all-reduce (MAX of
each digest and of its negation, so every rank learns the same maximum and
minimum) beside the step's gradient reduction; the digests are exact
integer sums over the tensors' bytes, so equal replicas always agree.

Model buffers (batch-norm statistics) are left out: data-parallel ranks see
different data and keep their own, as under DDP with
``broadcast_buffers=False``.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Sequence

import torch
import torch.distributed as dist

from tidal.runtime.rank0 import Diverged
from tidal.runtime.state import ElasticState

MOD = (1 << 40) - 87  # digests are below 2**40: exact in float64, and their negation too
SHOWN = 8  # differing items named in the error


def tensor_digest(t: torch.Tensor) -> int:
    """An integer below :data:`MOD` computed from ``t``'s bytes (its values
    exactly: -0.0 and 0.0 differ, as do two NaN payloads), shape and dtype:
    exact integer sums of its words, all of them and every seventh (one
    pass over memory each, no copy), so any changed element changes it."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() and flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    word = {2: torch.int16, 4: torch.int32, 8: torch.int32}.get(flat.element_size(), torch.uint8)
    words = flat.view(word)
    head = int.from_bytes(hashlib.blake2b(repr((tuple(t.shape), str(t.dtype))).encode(), digest_size=5).digest(),
                          "big")
    total = int(words.sum(dtype=torch.int64)) if words.numel() else 0
    some = int(words[3::7].sum(dtype=torch.int64)) if words.numel() > 3 else 0
    return (head * 1_000_003 ** 2 + total * 1_000_003 + some) % MOD


def value_digest(v: Any) -> int | None:
    """A digest of a plain value (None when it cannot be pickled)."""
    if isinstance(v, torch.Tensor):
        return tensor_digest(v)
    try:
        raw = pickle.dumps(v, protocol=4)
    except Exception:  # noqa: BLE001 - an unpicklable extra is not compared
        return None
    return int.from_bytes(hashlib.blake2b(raw, digest_size=5).digest(), "big") % MOD


def _optimizer_items(k: int, o: torch.optim.Optimizer, names: dict[int, str]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for g, group in enumerate(o.param_groups):
        for key, val in group.items():
            if key != "params" and isinstance(val, (int, float, bool, str, tuple, type(None))):
                out.append((f"optimizer {k}: param_groups[{g}]['{key}']", val))
        for p in group["params"]:
            for key, val in sorted(o.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                out.append((f"optimizer {k}: {key} of {names.get(id(p), '?')}", val))
    return out


def items(state: ElasticState) -> list[tuple[str, Any]]:
    """What every replica must hold equal, named: ``(name, value)``."""
    names = {id(p): n for n, p in state.model.named_parameters()}
    out: list[tuple[str, Any]] = [(f"parameter {n}", p) for n, p in state.model.named_parameters()]
    for k, o in enumerate(state.optimizers):
        out += _optimizer_items(k, o, names)
    out += [(f"extras['{key}']", v) for key, v in sorted(state.extras.items(), key=lambda kv: str(kv[0]))]
    out += [(f"kept variable {name}", v) for name, v in sorted(state.kept_globals().items())]
    return out


def digests(state: ElasticState) -> tuple[list[str], list[float]]:
    """Names and digests (floats holding integers below 2**40); an item
    that cannot be digested is left out."""
    names, values = [], []
    for name, v in items(state):
        d = value_digest(v)
        if d is not None:
            names.append(name)
            values.append(float(d))
    return names, values


def differing(local: Sequence[float], reduced: Sequence[float]) -> list[int]:
    """Indices whose maximum over ranks differs from their minimum;
    ``reduced`` is the MAX-reduction of ``[*local, *(-x for x in local)]``."""
    n = len(local)
    return [i for i in range(n) if reduced[i] != -reduced[n + i]]


def compare(state: ElasticState, step: int, gen: int, device: torch.device) -> None:
    """Every rank of the current group calls this at the same step: raises
    :class:`Diverged` on every rank when any replica differs."""
    names, values = digests(state)
    count = torch.tensor([float(len(values)), -float(len(values))], dtype=torch.float64, device=device)
    t = torch.tensor(values + [-v for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if count[0].item() != -count[1].item():
        raise Diverged(f"the replicas differ at step {step} (generation {gen}): they do not hold the same number "
                       f"of parameters, optimizer states and extras ({int(-count[1].item())} to "
                       f"{int(count[0].item())}); {ADVICE}")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    bad = differing(values, t.tolist())
    if bad:
        shown = ", ".join(names[i] for i in bad[:SHOWN]) + (f" and {len(bad) - SHOWN} more" if len(bad) > SHOWN else "")
        raise Diverged(f"the replicas differ at step {step} (generation {gen}): {shown}; {ADVICE}")


ADVICE = ("a value the script keeps outside the registered state (a learning rate used by hand, a best loss, a "
          "counter) was not the same on every rank, so the updates went apart: keep it with job.keep(name=value) "
          "(or job.register_state(..., extras={...})) (docs/runtime.md, State the workers share)")
