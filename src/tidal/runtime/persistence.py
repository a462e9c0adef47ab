"""Pluggable persistence of the job master's state, so a restarted master
resumes (Elan §V-D). Backends register by URL scheme: ``file://PATH``
(JSON, atomic rename) and ``sqlite://PATH``; etcd can be added later with
:func:`register_backend`."""

from __future__ import annotations

import abc
import json
import os
import sqlite3
import tempfile
import threading
from typing import Any, Callable

_REGISTRY: dict[str, Callable[[str], "StateBackend"]] = {}


class StateBackend(abc.ABC):
    """Stores one JSON document: the master's snapshot."""

    @abc.abstractmethod
    def save(self, snapshot: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def load(self) -> dict[str, Any] | None: ...

    def close(self) -> None:  # pragma: no cover - trivial
        pass


def register_backend(scheme: str) -> Callable[[Callable[[str], StateBackend]], Callable[[str], StateBackend]]:
    """Class decorator: ``@register_backend("etcd")``."""

    def deco(factory: Callable[[str], StateBackend]) -> Callable[[str], StateBackend]:
        _REGISTRY[scheme] = factory
        return factory

    return deco


def open_backend(url: str) -> StateBackend:
    """``file:///tmp/job.json``, ``sqlite:///tmp/job.db`` or a bare path (file)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
    if scheme not in _REGISTRY:
        raise ValueError(f"unknown state backend {scheme!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[scheme](rest)


@register_backend("file")
class FileBackend(StateBackend):
    """JSON file written atomically (write to a temp file, then rename)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def save(self, snapshot: dict[str, Any]) -> None:
        d = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(d, exist_ok=True)
        with self._lock:
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".tidal-master-")
            with os.fdopen(fd, "w") as f:
                json.dump(snapshot, f)
            os.replace(tmp, self.path)

    def load(self) -> dict[str, Any] | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None


@register_backend("sqlite")
class SQLiteBackend(StateBackend):
    """One-row table in an SQLite database."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        with self._connect() as c:
            c.execute("CREATE TABLE IF NOT EXISTS master_state (id INTEGER PRIMARY KEY, doc TEXT NOT NULL)")

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=10)

    def save(self, snapshot: dict[str, Any]) -> None:
        with self._lock, self._connect() as c:
            c.execute("INSERT OR REPLACE INTO master_state (id, doc) VALUES (1, ?)", (json.dumps(snapshot),))

    def load(self) -> dict[str, Any] | None:
        with self._lock, self._connect() as c:
            row = c.execute("SELECT doc FROM master_state WHERE id = 1").fetchone()
        return None if row is None else json.loads(row[0])
