"""Which server replica schedules: leader election over the store.

Every replica serves the API (each request is a transaction on the shared
store, so any replica can take it); only the leader runs the scheduling
rounds. Leases register by the store's URL scheme:

* ``postgresql`` — a session-level advisory lock (``pg_try_advisory_lock``)
  held on a dedicated connection. PostgreSQL releases it when that session
  ends: at once when the leader's process dies (its kernel closes the TCP
  connection), and within the lease bound ``TIDAL_LEADER_LEASE_S`` (L) when
  its host goes silent (powered off, link cut: no FIN, no reset), because
  every store connection carries TCP keepalives and a TCP user timeout on
  both ends (:func:`tcp_bounds`; libpq's ``keepalives*`` and
  ``tcp_user_timeout`` on the client, the same-named ``tcp_*`` GUCs set per
  session on the server, PostgreSQL >= 12). Without them a silent peer's
  session lives until the kernel's keepalive default (``tcp_keepalive_time``
  7,200 s), and with it the lock.
* ``sqlite`` — one replica only (a SQLite file cannot be shared between
  hosts): that replica always leads.

The leader steps down on its own (:class:`Elector`): it trusts its lock for
``TRUST * L`` after the start of its last confirmation, which is less than
the ``USER_TIMEOUT * L`` PostgreSQL waits after the last byte it heard from
the leader, so a cut-off leader stops scheduling before a follower can lead.
:func:`fence` makes that hold inside a round too: the scheduling threads'
statements and commits are refused once the trust has lapsed. A leader whose
scheduling loop is stuck hands the lock on as well. Two rounds overlapping at
a hand-over (a write already on the wire) still cannot give a GPU twice:
GPUs are taken with a conditional UPDATE
(:meth:`tidal.control.db.Store.assign_gpus`).
"""

from __future__ import annotations

import abc
import logging
import math
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable

from sqlalchemy import event, text
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger(__name__)

_LEASES: dict[str, Callable[[Engine, str], "Lease"]] = {}

#: the shortest lease bound accepted (keepalive settings are whole seconds)
MIN_LEASE_S = 5.0
#: fractions of the lease bound L: the TCP user timeout of both ends, and how
#: long a leader trusts a confirmation (less: it stops before PostgreSQL drops it)
USER_TIMEOUT, TRUST = 0.5, 0.4
#: the execution option marking the lease's own connection (never fenced)
LEASE_OPTION = "tidal_lease"


class LeaseLost(RuntimeError):
    """A scheduling thread wrote after its replica's lease lapsed (refused)."""


@dataclass(frozen=True)
class TcpBounds:
    """TCP settings that end a connection to a silent peer within the lease:
    keepalive probes after ``idle_s`` quiet seconds, every ``interval_s``,
    ``count`` of them, and unacknowledged data (or probes) given up after
    ``user_timeout_ms`` (Linux ``TCP_USER_TIMEOUT``, which also bounds the
    keepalive probing)."""

    idle_s: int
    interval_s: int
    count: int
    user_timeout_ms: int
    connect_timeout_s: int

    def client_args(self) -> dict[str, int]:
        """libpq connection parameters (psycopg passes them as connect args)."""
        return {"keepalives": 1, "keepalives_idle": self.idle_s, "keepalives_interval": self.interval_s,
                "keepalives_count": self.count, "tcp_user_timeout": self.user_timeout_ms,
                "connect_timeout": self.connect_timeout_s}

    def server_settings(self) -> dict[str, int]:
        """PostgreSQL's per-session GUCs for the server's end of the connection."""
        return {"tcp_keepalives_idle": self.idle_s, "tcp_keepalives_interval": self.interval_s,
                "tcp_keepalives_count": self.count, "tcp_user_timeout": self.user_timeout_ms}


def lease_bound(lease_s: float | None = None) -> float:
    """The lease bound L in seconds: ``lease_s`` or ``TIDAL_LEADER_LEASE_S``, at least :data:`MIN_LEASE_S`."""
    from tidal import settings

    value = settings.LEADER_LEASE_S.get() if lease_s is None else lease_s
    if not math.isfinite(value) or value < MIN_LEASE_S:
        log.warning("leader lease %.1f s raised to %.0f s", value, MIN_LEASE_S)
        return MIN_LEASE_S
    return float(value)


def tcp_bounds(lease_s: float | None = None) -> TcpBounds:
    """Keepalives from L/5 of silence, every L/10, 3 probes (L/2 in all), and a
    user timeout of L/2: either end drops a silent peer's connection between
    L/2 and 0.6 L after the last byte it heard."""
    lease = lease_bound(lease_s)
    return TcpBounds(idle_s=max(1, round(lease / 5)), interval_s=max(1, round(lease / 10)), count=3,
                     user_timeout_ms=int(USER_TIMEOUT * lease * 1000),
                     connect_timeout_s=max(2, round(lease / 4)))


class Lease(abc.ABC):
    """The right to schedule. ``try_acquire`` never blocks for long.
    ``shared``: other replicas may take it (handing it on helps)."""

    shared = False

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
    """A PostgreSQL session-level advisory lock on its own connection (one
    of ``engine``'s, so it carries the engine's TCP bounds:
    :func:`tidal.control.db.make_engine`)."""

    shared = True

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine, self.key = engine, zlib.crc32(name.encode())  # a stable 32-bit key per lock name
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT",
                                                                 **{LEASE_OPTION: True})
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
                    self._drop()
                self._conn = None


class Elector:
    """Keeps asking for the lease; ``leading()`` says whether this replica
    schedules now (the coordinator asks before each round, and the threads
    that ask are the scheduling threads :func:`fence` guards). While it leads,
    a renewal thread confirms the lock every ``TRUST * L / 4``. A confirmation
    is trusted for ``TRUST * L`` from the moment it was asked for; past that
    the replica no longer leads (``is_leading``), even while the confirmation
    hangs on a dead link. ``stuck()`` true while leading (its scheduling loop
    is stuck) makes it release a shared lock and leave it to the followers for L."""

    def __init__(self, lease: Lease, on_change: Callable[[bool], None] | None = None, *,
                 lease_s: float | None = None, stuck: Callable[[], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lease, self.on_change = lease, on_change
        self.lease_s = lease_bound(lease_s)
        self.trust_s = TRUST * self.lease_s
        self.stuck = stuck or (lambda: False)
        self._clock = clock
        self._leading = False
        self._confirmed = -math.inf  # when the last confirmation that succeeded was asked for
        self._hold_off = -math.inf  # no acquiring before (after handing the lead on)
        self._scheduling: set[int] = set()
        self._state = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def leading(self) -> bool:
        """Whether this replica holds the lease now (acquiring it if free)."""
        self._scheduling.add(threading.get_ident())
        return self._check(acquire=True)

    def _check(self, acquire: bool) -> bool:
        if self._clock() < self._hold_off:
            self._set(False)
            return False
        asked = self._clock()
        ok = self.lease.held() or (acquire and self.lease.try_acquire())
        if ok:
            with self._state:
                self._confirmed = max(self._confirmed, asked)
        self._set(ok)
        if ok and self.lease.shared and self.stuck():
            self.step_down("its scheduling loop completed no round for too long")
            return False
        return self.is_leading

    def _set(self, now: bool) -> None:
        with self._state:
            if now == self._leading:
                return
            self._leading = now
            if now and self._renewer is None:
                self._renewer = threading.Thread(target=self._renew, name="tidal-lease", daemon=True)
                self._renewer.start()
        log.warning("this server replica %s", "leads now" if now else "no longer leads")
        if self.on_change is not None:
            self.on_change(now)

    def _renew(self) -> None:
        """The renewal thread: confirms the lock while leading."""
        while not self._stop.wait(self.trust_s / 4):
            if not self._leading:
                continue
            try:
                self._check(acquire=False)
            except Exception:  # noqa: BLE001 - the renewal must go on; not confirmed means not leading
                log.exception("renewing the leader lease failed")

    def step_down(self, reason: str) -> None:
        """Stop leading, release the lock and acquire nothing for L."""
        log.error("this server replica hands the lead on: %s", reason)
        self._hold_off = self._clock() + self.lease_s
        self._set(False)
        self.lease.release()

    @property
    def is_leading(self) -> bool:
        """Leads, by a confirmation younger than the trust (no I/O)."""
        return self._leading and self._clock() - self._confirmed < self.trust_s

    def fenced(self) -> bool:
        """The calling thread schedules and this replica's lead has lapsed."""
        return threading.get_ident() in self._scheduling and not self.is_leading

    def close(self) -> None:
        self._stop.set()
        if self._leading:
            self.lease.release()
            self._leading = False


def fence(engine: Engine, elector: Elector) -> None:
    """Refuse the scheduling threads' statements and commits on ``engine``
    once ``elector``'s lead has lapsed (:class:`LeaseLost`; the round fails and
    the next one asks the lease first). The lease's own connection is exempt.
    PostgreSQL only: a SQLite store's only replica always leads."""
    if engine.dialect.name != "postgresql":
        return

    def refused(conn: Connection) -> bool:
        return not conn.get_execution_options().get(LEASE_OPTION) and elector.fenced()

    def statement(conn: Connection, *_: Any) -> None:
        if refused(conn):
            raise LeaseLost("this replica's leader lease lapsed: the scheduling round stops here")

    def commit(conn: Connection) -> None:
        if refused(conn):
            conn.invalidate()  # the transaction ends with its session, uncommitted, whatever comes next
            raise LeaseLost("this replica's leader lease lapsed: its transaction is not committed")

    event.listen(engine, "before_cursor_execute", statement)
    event.listen(engine, "commit", commit)


class LoopClock:
    """How long the scheduling loop has gone without starting a round,
    sampled from the coordinator's ``rounds`` counter: a sample that finds it
    changed restarts the clock. ``reset`` when leadership changes (a follower
    runs no rounds); ``stuck`` past ``bound_s``."""

    def __init__(self, rounds: Callable[[], int], bound_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rounds, self.bound_s, self._clock = rounds, bound_s, clock
        self._seen: int | None = None
        self._since = clock()
        self._lock = threading.Lock()

    def reset(self, *_: Any) -> None:
        with self._lock:
            self._seen = None

    def age(self) -> float:
        """Seconds since the counter was last seen to change."""
        with self._lock:
            now, n = self._clock(), self.rounds()
            if n != self._seen:
                self._seen, self._since = n, now
            return now - self._since

    def stuck(self) -> bool:
        return self.age() > self.bound_s
