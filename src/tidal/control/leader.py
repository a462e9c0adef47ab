"""Which server replica schedules: leader election over the store.

Every replica serves the API (each request is a transaction on the shared
store, so any replica can take it); only the leader runs the scheduling
rounds. Leases register by the store's URL scheme:

* ``postgresql`` — a session-level advisory lock (``pg_try_advisory_lock``)
  held on a dedicated connection. PostgreSQL releases it when that session
  ends, so a leader killed with -9 loses it as soon as its TCP connection is
  gone; no clock, no TTL to tune, and the store the replicas already share
  is the only moving part (an etcd lease would add a second one).
* ``sqlite`` — one replica only (a SQLite file cannot be shared between
  hosts): that replica always leads.

A leader re-checks its lease before each round (:meth:`Lease.held`); even two
rounds overlapping at a hand-over cannot give a GPU twice, because GPUs are
taken with a conditional UPDATE (:meth:`tidal.control.db.Store.assign_gpus`).
"""

from __future__ import annotations

import abc
import logging
import threading
import zlib
from typing import Callable

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger(__name__)

_LEASES: dict[str, Callable[[Engine, str], "Lease"]] = {}


class Lease(abc.ABC):
    """The right to schedule. ``try_acquire`` never blocks for long."""

    @abc.abstractmethod
    def try_acquire(self) -> bool: ...

    @abc.abstractmethod
    def held(self) -> bool: ...

    @abc.abstractmethod
    def release(self) -> None: ...


def register_lease(scheme: str) -> Callable[[Callable[[Engine, str], Lease]], Callable[[Engine, str], Lease]]:
    def deco(factory: Callable[[Engine, str], Lease]) -> Callable[[Engine, str], Lease]:
        _LEASES[scheme] = factory
        return factory

    return deco


def lease_for(engine: Engine, name: str = "tidal-scheduler") -> Lease:
    """The lease for the store behind ``engine`` (by its dialect)."""
    dialect = engine.dialect.name
    if dialect not in _LEASES:
        raise ValueError(f"no leader election for a {dialect} store; known: {sorted(_LEASES)}")
    return _LEASES[dialect](engine, name)


@register_lease("sqlite")
class SoleLease(Lease):
    """A SQLite store has one replica: it always leads."""

    def __init__(self, engine: Engine, name: str) -> None:
        self._held = False

    def try_acquire(self) -> bool:
        self._held = True
        return True

    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        self._held = False


@register_lease("postgresql")
class AdvisoryLease(Lease):
    """A PostgreSQL session-level advisory lock on its own connection."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine, self.key = engine, zlib.crc32(name.encode())  # a stable 32-bit key per lock name
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.invalidate()
            except Exception:  # noqa: BLE001 - already broken
                pass
            self._conn = None

    def try_acquire(self) -> bool:
        with self._lock:
            try:
                got = bool(self._connection().execute(text("SELECT pg_try_advisory_lock(:k)"),
                                                      {"k": self.key}).scalar())
            except Exception as e:  # noqa: BLE001 - the store is away: not the leader
                log.warning("leader election: %s", e)
                self._drop()
                return False
            if not got:  # keep no idle session open while following
                self._drop()
            return got

    def held(self) -> bool:
        """The lock is still this session's (the session is alive and holds it)."""
        with self._lock:
            if self._conn is None:
                return False
            try:
                n = self._conn.execute(text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = :k "
                    "AND pid = pg_backend_pid() AND granted"), {"k": self.key}).scalar()
            except Exception as e:  # noqa: BLE001 - the session is gone, and the lock with it
                log.warning("leader lease lost: %s", e)
                self._drop()
                return False
            return bool(n)

    def release(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
                    self._conn.close()
                except Exception:  # noqa: BLE001 - the session is gone: so is the lock
                    pass
                self._conn = None


class Elector:
    """Keeps asking for the lease; ``leading()`` says whether this replica
    schedules now (checked by the coordinator before each round)."""

    def __init__(self, lease: Lease, on_change: Callable[[bool], None] | None = None) -> None:
        self.lease, self.on_change = lease, on_change
        self._leading = False

    def leading(self) -> bool:
        """Whether this replica holds the lease now (acquiring it if free)."""
        now = self.lease.held() or self.lease.try_acquire()
        if now != self._leading:
            self._leading = now
            log.warning("this server replica %s", "leads now" if now else "no longer leads")
            if self.on_change is not None:
                self.on_change(now)
        return now

    @property
    def is_leading(self) -> bool:
        """The last answer of :meth:`leading` (no I/O)."""
        return self._leading

    def close(self) -> None:
        if self._leading:
            self.lease.release()
            self._leading = False
