"""One parameter server's checkpoints: ``<dir>/<ps>/ckpt-<n>/state.pt``.

A checkpoint is written to a temporary directory and renamed, so it is either
whole or absent after a process crash (there is no fsync: a host crash may
lose the newest ones); the highest number present is the latest. It holds the
server's rows, their ranges, the layout version and the per-worker
deduplication marks (which pushes it already contains).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

_PREFIX = "ckpt-"


def _root(base: str | Path, ps: str) -> Path:
    return Path(base) / ps


def save(base: str | Path, ps: str, number: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Writes checkpoint ``number`` of ``ps`` and removes all but the ``keep`` latest."""
    root = _root(base, ps)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a writer that crashed (one writer per server)
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"{_PREFIX}{number:08d}"
    tmp = root / f".tmp-{number:08d}-{os.getpid()}"
    tmp.mkdir()
    try:
        torch.save(state, tmp / "state.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(root.glob(f"{_PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def any_checkpoint(base: str | Path) -> bool:
    """True if ``base`` holds a checkpoint of any server."""
    return Path(base).is_dir() and any(Path(base).glob(f"*/{_PREFIX}*"))


def latest(base: str | Path, ps: str) -> tuple[int, dict[str, Any]] | None:
    """``(number, state)`` of the newest whole checkpoint of ``ps``, or None."""
    found = sorted(_root(base, ps).glob(f"{_PREFIX}*"))
    if not found:
        return None
    path = found[-1]
    return int(path.name[len(_PREFIX):]), torch.load(path / "state.pt", weights_only=False)
