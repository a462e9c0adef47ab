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
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import (
    JSON,
    Boolean,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    create_engine,
    false,
    event,
    select,
    update,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from tidal import settings
from tidal.net import LOOPBACK


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
    """Measured throughput (SideCar Tables II-III): iterations/s."""

    __tablename__ = "throughput"
    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    batch: Mapped[int] = mapped_column(Integer, primary_key=True)
    gpus: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[float] = mapped_column(Float)
    source: Mapped[str] = mapped_column(String(256), default="")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def default_url() -> str:
    home = settings.home()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'tidal.db'}"


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        eng = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(eng, "connect")
        def _pragmas(dbapi_conn, _rec) -> None:  # pragma: no cover - trivial
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return eng
    return create_engine(url, pool_pre_ping=True)


def migrate(url: str) -> None:
    """Bring the schema to the newest revision (alembic ``upgrade head``)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).with_name("migrations")))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    command.upgrade(cfg, "head")


class Store:
    """Transactions and the few multi-row operations that must be atomic."""

    def __init__(self, url: str | None = None, *, run_migrations: bool = True) -> None:
        self.url = url or default_url()
        if run_migrations:
            migrate(self.url)
        self.engine = make_engine(self.url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions() as s:
            try:
                yield s
                s.commit()
            except BaseException:
                s.rollback()
                raise

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
        with self.session() as s:
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
