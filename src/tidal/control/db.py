"""The control plane's persistent store (SQLAlchemy 2).

SQLite file by default, PostgreSQL by URL. Tables follow the SideCar paper's
in-memory database (nodes, GPUs, jobs, throughput profiles — its
Tables II–V) plus an audit trail of events, the desired process set that
agents reconcile against, and each job's phase and change in flight
(DLRover/Elan: the master's state machine lives in a store, so a restarted
server resumes).

Invariant: a GPU row has at most one ``job_id``; :meth:`Store.assign_gpus`
takes GPUs with a conditional UPDATE (``WHERE job_id IS NULL``) inside one
transaction and writes ``gpu.assign`` / ``gpu.release`` audit events.

SQLite: every session is one serializable transaction begun with ``BEGIN
IMMEDIATE`` (it takes the write lock up front, waiting up to
:data:`SQLITE_BUSY_TIMEOUT_S` for it), so concurrent read-modify-write
sessions never lose an update and never fail with "database is locked" when a
reader turns writer; ``session(write=False)`` reads a snapshot without the lock.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    create_engine,
    false,
    event,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from tidal import settings
from tidal.net import LOOPBACK
from tidal.control.interrupts import Shielded

_log = logging.getLogger(__name__)


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "users"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)


class Node(Base):
    __tablename__ = "nodes"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    ordinal: Mapped[int] = mapped_column(Integer, unique=True)  # position in the topology
    address: Mapped[str] = mapped_column(String(256), default=LOOPBACK)
    num_gpus: Mapped[int] = mapped_column(Integer)
    virtual: Mapped[bool] = mapped_column(Boolean, default=False)
    state: Mapped[str] = mapped_column(String(16), default="up")  # up | down
    last_heartbeat: Mapped[float] = mapped_column(Float, default=0.0)
    # the agent's --label KEY=VALUE pairs; ``switch`` places the node in the topology
    labels: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True, default=dict)
    memory: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")  # bytes (0: unknown)


class GPU(Base):
    __tablename__ = "gpus"
    gid: Mapped[int] = mapped_column(Integer, primary_key=True)  # cluster-wide index
    node: Mapped[str] = mapped_column(ForeignKey("nodes.name"), index=True)
    index: Mapped[int] = mapped_column(Integer)  # index on its node (CUDA_VISIBLE_DEVICES)
    state: Mapped[str] = mapped_column(String(16), default="free")  # free | in_use
    job_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    util: Mapped[float] = mapped_column(Float, default=0.0)
    # early initialisation (SideCar §III-C): the job that gets this GPU once its
    # holder releases it; that job's workers may start (not compute) meanwhile
    reserved_for: Mapped[str | None] = mapped_column(String(64), nullable=True)


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    submit_time: Mapped[float] = mapped_column(Float)
    start_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    end_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    admitted: Mapped[bool] = mapped_column(Boolean, default=False)
    drop_reason: Mapped[str] = mapped_column(Text, default="")
    target: Mapped[int] = mapped_column(Integer, default=0)  # GPUs the policy wants
    master_url: Mapped[str] = mapped_column(String(256), default="")
    progress: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    done: Mapped[float] = mapped_column(Float, default=0.0)
    attained: Mapped[float] = mapped_column(Float, default=0.0)
    executed: Mapped[float] = mapped_column(Float, default=0.0)
    waiting_since: Mapped[float] = mapped_column(Float, default=0.0)
    tags: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    rescales: Mapped[int] = mapped_column(Integer, default=0)
    exit_info: Mapped[str] = mapped_column(Text, default="")
    # the coordinator's phase machine (tidal.control.phases): the phase and the
    # change in flight (GPUs, worker ids, when it began), so a restarted server resumes
    phase: Mapped[str] = mapped_column(String(16), default="submitted", server_default="submitted")
    change: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    batch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # the policy's global batch (0: the spec's)
    # the submission's Idempotency-Key: a retry with the same key finds this job (unique per user)
    idempotency_key: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # auto-configuration (tidal.control.autoconf): its stage, samples, fitted model and plan; None: not auto
    autoconf: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)

    # the job's number among all jobs ever submitted (unique): an agent with --run-as LO-HI runs the job as
    # uid LO + slot mod (HI - LO + 1) on every host, so no two jobs of the last HI - LO + 1 share a uid
    slot: Mapped[int | None] = mapped_column(Integer, nullable=True)
    __table_args__ = (Index("ix_jobs_user_idempotency_key", "user", "idempotency_key", unique=True),
                      Index("ix_jobs_slot", "slot", unique=True))


class Process(Base):
    """Desired and observed processes of jobs (a job's master and its
    workers); agents reconcile against it."""

    __tablename__ = "processes"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(64))  # runtime worker id (w0, w1, ...) or "master"
    kind: Mapped[str] = mapped_column(String(16), default="worker")  # worker | master
    node: Mapped[str] = mapped_column(String(128), index=True)
    gpu: Mapped[int | None] = mapped_column(Integer, nullable=True)  # cluster-wide gid
    desired: Mapped[str] = mapped_column(String(16), default="run")  # run | stop
    state: Mapped[str] = mapped_column(String(16), default="pending")  # pending | running | exited | failed
    pid: Mapped[int] = mapped_column(Integer, default=0)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    env: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    argv: Mapped[list[str]] = mapped_column(JSON, default=list)
    cwd: Mapped[str] = mapped_column(Text, default="")
    gated: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # warm up, wait before training
    # a master started on another host of the job after its own host died: it
    # continues the incarnation (the workers before it are still the job's)
    relocated: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # a worker's limits ({"memory": bytes, "cpus": n}) and, once it ran out of memory, "oom":
    # {"limit", "peak", "backend"} as its agent reported it (docs/resources.md)
    resources: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True, default=dict)
    # why the process ended as its agent saw it, when its exit code does not say: the OS error of
    # a launch that failed ("launch failed: [Errno 7] Argument list too long"); "" otherwise
    error: Mapped[str] = mapped_column(Text, default="", server_default="")


class Event(Base):
    """Audit trail: every state change, in order."""

    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    time: Mapped[float] = mapped_column(Float, index=True)
    kind: Mapped[str] = mapped_column(String(32), index=True)
    job_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    node: Mapped[str | None] = mapped_column(String(128), nullable=True)
    gpu: Mapped[int | None] = mapped_column(Integer, nullable=True)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class MasterState(Base):
    """A job master's latest snapshot (Elan §V-D keeps it in etcd): a master
    restarted on another host, after its own died, continues from it.
    ``seq`` only grows, so a late write of an older master never wins."""

    __tablename__ = "master_states"
    job_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer)
    doc: Mapped[str] = mapped_column(Text)
    updated: Mapped[float] = mapped_column(Float)


class ThroughputRow(Base):
    """Measured throughput (SideCar Tables II-III): iterations/s, per GPU
    type (``""``: untyped)."""

    __tablename__ = "throughput"
    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    batch: Mapped[int] = mapped_column(Integer, primary_key=True)
    gpus: Mapped[int] = mapped_column(Integer, primary_key=True)
    gpu_type: Mapped[str] = mapped_column(String(64), primary_key=True, default="", server_default="")
    value: Mapped[float] = mapped_column(Float)
    source: Mapped[str] = mapped_column(String(256), default="")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def default_url() -> str:
    home = settings.home()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'tidal.db'}"


SQLITE_BUSY_TIMEOUT_S = 30.0  # how long a SQLite transaction waits for the write lock
_BEGIN = "tidal_sqlite_begin"  # execution option: how a SQLite session begins (IMMEDIATE | DEFERRED)
_HOLDS = "tidal_holds_write_lock"  # connection info: it began with BEGIN IMMEDIATE (value: queued on the lock)
_held = threading.local()  # per thread: the SQLite databases it holds the write lock of


def _held_by_thread() -> set[str]:
    if not hasattr(_held, "urls"):
        _held.urls = set()
    return _held.urls


def make_engine(url: str, lease_s: float | None = None) -> Engine:
    """The store's engine: SQLite (:func:`_sqlite_engine`), or PostgreSQL with
    every connection bounded for a silent peer (:func:`_postgres_engine`)."""
    if url.startswith("sqlite"):
        return _sqlite_engine(url)
    return _postgres_engine(url, lease_s)


def _postgres_engine(url: str, lease_s: float | None) -> Engine:
    """Every connection ends within the leader lease bound ``lease_s``
    (default ``TIDAL_LEADER_LEASE_S``) once the other end goes silent
    (:func:`tidal.control.leader.tcp_bounds`): libpq's keepalives and TCP
    user timeout on this end (connect args; a parameter the URL gives wins),
    and the same through PostgreSQL's per-session ``tcp_*`` settings on the
    server's end, so that the server drops a dead leader's session, and its
    advisory lock, without waiting for the kernel's 2 h keepalive default."""
    from sqlalchemy.engine import make_url

    from tidal.control.leader import tcp_bounds

    bounds = tcp_bounds(lease_s)
    given = make_url(url).query
    eng = create_engine(url, pool_pre_ping=True,
                        connect_args={k: v for k, v in bounds.client_args().items() if k not in given})
    gucs = bounds.server_settings()

    def connect(dbapi_conn: Any, _rec: Any) -> None:
        was, dbapi_conn.autocommit = dbapi_conn.autocommit, True  # each SET on its own, nothing left open
        try:
            cur = dbapi_conn.cursor()
            for name, value in gucs.items():
                try:
                    cur.execute(f"SET {name} = {int(value)}")
                except Exception as e:  # noqa: BLE001 - an older server lacks one: the others still apply
                    _log.warning("store session: SET %s refused (%s); a silent peer may hold it longer", name, e)
            cur.close()
        finally:
            dbapi_conn.autocommit = was

    event.listen(eng, "connect", connect)
    return eng


def _sqlite_engine(url: str) -> Engine:
    """SQLite with SQLAlchemy, not the driver, beginning transactions (the
    SQLAlchemy 2 recipe for pysqlite): ``BEGIN IMMEDIATE`` unless the session
    only reads, or this thread already holds the write lock in an enclosing
    session (which would wait for itself). This process's writers queue on a
    lock first, which wakes the next at once; SQLite's busy handler, which
    polls with sleeps of up to 100 ms, is left to writers of other processes."""
    eng = create_engine(url, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_S})
    db = str(eng.url)
    writers = threading.Lock()

    def connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None  # the driver emits no BEGIN of its own
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    def begin(conn: Connection) -> None:
        held = _held_by_thread()
        if conn.get_execution_options().get(_BEGIN, "IMMEDIATE") != "IMMEDIATE" or db in held:
            conn.exec_driver_sql("BEGIN")
            return
        queued = writers.acquire(timeout=SQLITE_BUSY_TIMEOUT_S)  # on a timeout SQLite's own lock still guards
        try:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        except BaseException:
            if queued:
                writers.release()
            raise
        conn.info[_HOLDS] = queued
        held.add(db)

    def end(info: dict[Any, Any]) -> None:
        queued = info.pop(_HOLDS, None)
        if queued is not None:
            _held_by_thread().discard(db)
            if queued:
                writers.release()

    event.listen(eng, "connect", connect)
    event.listen(eng, "begin", begin)
    event.listen(eng, "commit", lambda conn: end(conn.info))
    event.listen(eng, "rollback", lambda conn: end(conn.info))
    event.listen(eng, "checkin", lambda _dbapi_conn, rec: end(rec.info))  # whatever ended the transaction
    return eng


MIGRATION_LOCK = 0x7D1DA1  # the advisory lock replicas take around a migration


def migrate(url: str) -> None:
    """Bring the schema to the newest revision (alembic ``upgrade head``)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).with_name("migrations")))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if not url.startswith("postgresql"):
        command.upgrade(cfg, "head")
        return
    # server replicas starting together over one PostgreSQL: one migrates, the others wait for it
    eng = create_engine(url)
    try:
        with eng.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK})
            try:
                command.upgrade(cfg, "head")
            finally:
                c.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK})
    finally:
        eng.dispose()


def _interrupt_behind(e: BaseException) -> BaseException | None:
    """``e`` if it is a KeyboardInterrupt (or another non-``Exception``),
    else the one ``e`` was raised while handling, if any: SQLAlchemy's own
    rollback inside a flush can fail after an interrupt and raise
    PendingRollbackError instead."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if not isinstance(cur, Exception):
            return cur
        seen.add(id(cur))
        cur = cur.__context__
    return None


def _roll_back_after_interrupt(s: Session) -> None:
    """Roll ``s`` back after a KeyboardInterrupt (or another BaseException)
    that may have landed inside SQLAlchemy's own handling of a statement; the
    rollback can then fail ("Can't reconnect until invalid transaction is
    rolled back"), and that error must not replace the interrupt. The
    connection is invalidated, so the pool opens a fresh one next time."""
    try:
        s.rollback()
    except Exception as e:  # noqa: BLE001 - the interrupt is what propagates
        _log.debug("rollback after an interrupt failed (%s); the connection is dropped", e)
        try:
            s.invalidate()
        except Exception:  # noqa: BLE001
            pass


class Store:
    """Transactions and the few multi-row operations that must be atomic."""

    def __init__(self, url: str | None = None, *, run_migrations: bool = True) -> None:
        self.url = url or default_url()
        if run_migrations:
            migrate(self.url)
        self.engine = make_engine(self.url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._reads = sessionmaker(self.engine.execution_options(**{_BEGIN: "DEFERRED"}), expire_on_commit=False)

    @contextmanager
    def session(self, write: bool = True) -> Iterator[Session]:
        """One transaction, committed at the end (rolled back on an error).
        ``write=False``: a session that only reads; on SQLite it takes no
        write lock (a write in it may then fail with "database is locked").
        A Ctrl-C in the main thread waits for the session's end where
        :mod:`tidal.control.interrupts`' handler is installed."""
        with Shielded(), (self._sessions if write else self._reads)() as s:
            try:
                yield s
                s.commit()
            except BaseException as e:
                # Ctrl-C (or a cancel) mid-statement, possibly hidden behind SQLAlchemy's failed rollback:
                # the caller must see the interrupt
                interrupt = _interrupt_behind(e)
                if interrupt is None:
                    s.rollback()
                    raise
                _roll_back_after_interrupt(s)
                if interrupt is e:
                    raise
                raise interrupt from None

    # -- users -----------------------------------------------------------------
    def add_user(self, name: str, admin: bool = False, token: str | None = None) -> str:
        token = token or secrets.token_urlsafe(24)
        with self.session() as s:
            u = s.get(User, name)
            if u is None:
                s.add(User(name=name, token_hash=hash_token(token), is_admin=admin))
            else:
                u.token_hash, u.is_admin = hash_token(token), admin
        return token

    def user_for_token(self, token: str) -> User | None:
        with self.session(write=False) as s:
            return s.scalar(select(User).where(User.token_hash == hash_token(token)))

    # -- events ------------------------------------------------------------------
    @staticmethod
    def log(s: Session, kind: str, job_id: str | None = None, node: str | None = None,
            gpu: int | None = None, **detail: Any) -> None:
        s.add(Event(time=time.time(), kind=kind, job_id=job_id, node=node, gpu=gpu,
                    detail=json.loads(json.dumps(detail, default=str))))

    # -- GPUs ----------------------------------------------------------------------
    def assign_gpus(self, s: Session, job_id: str, gids: list[int]) -> None:
        """Give free GPUs to a job; raises if any is held (nothing changes then)."""
        for g in gids:
            res = s.execute(
                update(GPU)
                .where(GPU.gid == g, GPU.job_id.is_(None))
                .values(job_id=job_id, state="in_use")
            )
            if res.rowcount != 1:
                holder = s.get(GPU, g)
                raise RuntimeError(f"GPU {g} is not free (held by {holder.job_id if holder else '?'})")
            self.log(s, "gpu.assign", job_id, gpu=g)
        # a reservation ends when the GPU is the job's; its warmed-up workers may train
        s.execute(update(GPU).where(GPU.gid.in_(gids), GPU.reserved_for == job_id).values(reserved_for=None))
        s.execute(update(Process).where(Process.job_id == job_id, Process.gpu.in_(gids), Process.gated.is_(True))
                  .values(gated=False))

    def reserve_gpus(self, s: Session, job_id: str, gids: list[int]) -> bool:
        """Reserve GPUs (held or not) for ``job_id``; False if any is reserved
        for another job (nothing changes then)."""
        taken = s.scalars(select(GPU.gid).where(GPU.gid.in_(gids), GPU.reserved_for.is_not(None),
                                                GPU.reserved_for != job_id)).all()
        if taken:
            return False
        s.execute(update(GPU).where(GPU.gid.in_(gids)).values(reserved_for=job_id))
        for g in gids:
            self.log(s, "gpu.reserve", job_id, gpu=g)
        return True

    def unreserve_gpus(self, s: Session, job_id: str, gids: list[int]) -> None:
        s.execute(update(GPU).where(GPU.gid.in_(gids), GPU.reserved_for == job_id).values(reserved_for=None))

    def release_gpus(self, s: Session, job_id: str, gids: list[int]) -> None:
        for g in gids:
            res = s.execute(
                update(GPU).where(GPU.gid == g, GPU.job_id == job_id).values(job_id=None, state="free")
            )
            if res.rowcount == 1:
                self.log(s, "gpu.release", job_id, gpu=g)

    def job_gpus(self, s: Session, job_id: str) -> list[int]:
        return sorted(s.scalars(select(GPU.gid).where(GPU.job_id == job_id)))
