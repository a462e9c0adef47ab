"""Leader election over the store: one PostgreSQL advisory lock among
replicas (a real PostgreSQL server), taken over when the leader's session
dies; a SQLite store's only replica always leads. The lease is bounded: every
store connection carries TCP keepalives and a user timeout on both ends, the
leader trusts a confirmation for less than PostgreSQL waits for a silent
peer and is fenced after it, and it hands the lead on when its loop is stuck.
The readiness endpoint fails on a store that does not answer and on a stuck
loop (tests/multihost/test_leader_silent.py cuts a real link)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from tidal.control.api.health import DbProbe
from tidal.control.db import Store, make_engine
from tidal.control.leader import (TRUST, USER_TIMEOUT, AdvisoryLease, Elector, Lease, LeaseLost, LoopClock,
                                  SoleLease, fence, lease_bound, lease_for, tcp_bounds)
from tidal.control.server import create_app


def test_one_replica_leads_and_another_takes_over_when_its_session_dies(pg_url):
    a, b = create_engine(pg_url), create_engine(pg_url)
    ea, eb = Elector(lease_for(a, "t1")), Elector(lease_for(b, "t1"))
    assert isinstance(ea.lease, AdvisoryLease)
    assert ea.leading() and not eb.leading() and ea.leading()  # one leader, and it stays
    # the leader's host dies: PostgreSQL ends its session (here: terminated from outside)
    pid = ea.lease._conn.execute(text("SELECT pg_backend_pid()")).scalar()  # type: ignore[union-attr]
    with create_engine(pg_url).connect() as c:
        c.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        # the backend ends (and lets its locks go) after the signal, not with it: until then no other
        # session can take the lock, so wait (bounded) until the server shows none held by it
        deadline = time.monotonic() + 10
        while c.execute(text("SELECT count(*) FROM pg_locks WHERE pid = :p AND locktype = 'advisory'"),
                        {"p": pid}).scalar():
            assert time.monotonic() < deadline, "the terminated session still held its lock after 10 s"
            time.sleep(0.01)
    assert eb.leading()
    assert not ea.leading()  # the old leader notices before its next round
    eb.close()
    assert ea.leading()  # released: the other takes it
    other = Elector(lease_for(create_engine(pg_url), "another-lock"))
    assert other.leading()  # locks are per name
    for e in (ea, other):
        e.close()


def test_a_sqlite_store_has_one_replica_that_always_leads(tmp_path):
    e = Elector(lease_for(create_engine(f"sqlite:///{tmp_path / 's.db'}")))
    assert isinstance(e.lease, SoleLease) and e.leading()
    with pytest.raises(ValueError, match="no leader election"):
        lease_for(SimpleNamespace(dialect=SimpleNamespace(name="mysql")))  # type: ignore[arg-type]
    e.close()


# -- the bound ---------------------------------------------------------------------------------


def test_the_tcp_bounds_end_a_silent_peer_within_the_lease(monkeypatch):
    for lease in (5.0, 10.0, 20.0, 30.0, 120.0):
        b = tcp_bounds(lease)
        # keepalive alone (a kernel without TCP_USER_TIMEOUT), and the user timeout, which ends the
        # probing at the first probe past it
        assert b.idle_s + b.count * b.interval_s <= 0.8 * lease
        assert b.user_timeout_ms / 1000 + b.interval_s <= 0.7 * lease
        # the leader stops trusting a confirmation before either end can drop it
        assert TRUST * lease < b.user_timeout_ms / 1000 == USER_TIMEOUT * lease
    monkeypatch.setenv("TIDAL_LEADER_LEASE_S", "12")
    assert lease_bound() == 12.0 and tcp_bounds().user_timeout_ms == 6000
    assert lease_bound(1.0) == 5.0  # too short to express in whole-second keepalives


def _sockopts(fd: int) -> tuple[int, int, int, int]:
    s = socket.socket(fileno=fd)
    try:
        return (s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))
    finally:
        s.detach()


def test_every_store_connection_is_bounded_on_both_ends(pg_url):
    eng = make_engine(pg_url, lease_s=10)
    b = tcp_bounds(10)
    with eng.connect() as c:
        server = {k: int(c.execute(text(f"SHOW {k}")).scalar().rstrip("ms")) for k in b.server_settings()}
        assert server == b.server_settings()  # the server's end of this very socket
        client = _sockopts(c.connection.dbapi_connection.pgconn.socket)
        assert client == (b.idle_s, b.interval_s, b.count, b.user_timeout_ms)
    # a parameter the URL gives wins over the bound
    with make_engine(pg_url + "?keepalives_idle=7", lease_s=10).connect() as c:
        assert _sockopts(c.connection.dbapi_connection.pgconn.socket)[0] == 7
    eng.dispose()


# -- stepping down, with a lease and a clock of our own ----------------------------------------


class FakeLease(Lease):
    shared = True

    def __init__(self) -> None:
        self.free, self.mine, self.answers, self.released = True, False, True, 0

    def try_acquire(self) -> bool:
        if self.free and self.answers:
            self.free, self.mine = False, True
        return self.mine and self.answers

    def held(self) -> bool:
        return self.mine and self.answers

    def release(self) -> None:
        self.free, self.mine, self.released = True, False, self.released + 1


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_leader_that_cannot_confirm_its_lock_stops_within_the_trust():
    clock, lease, changes = Clock(), FakeLease(), []
    e = Elector(lease, changes.append, lease_s=20, clock=clock)
    assert e.leading() and e.is_leading and not e.fenced() and changes == [True]
    clock.t += TRUST * 20 - 0.1
    assert e.is_leading  # within the trust, no I/O needed to say so
    clock.t += 0.2
    assert not e.is_leading and e.fenced()  # lapsed: the scheduling thread is fenced
    other = threading.Thread(target=lambda: changes.append(e.fenced()))
    other.start()
    other.join()
    assert changes[-1] is False  # a thread that does not schedule (an API handler) is not
    lease.answers = False  # the link is cut: every confirmation fails
    assert not e.leading() and changes[-1] is False and not e.is_leading
    lease.answers = True  # the link is back but someone else took the lock meanwhile
    lease.mine, lease.free = False, False
    assert not e.leading()
    e.close()


def test_a_leader_whose_loop_is_stuck_hands_the_lead_on():
    clock, lease = Clock(), FakeLease()
    rounds = [0]
    loop = LoopClock(lambda: rounds[0], bound_s=10, clock=clock)
    e = Elector(lease, loop.reset, lease_s=20, stuck=loop.stuck, clock=clock)
    assert e.leading()
    for _ in range(5):  # rounds go on: leading
        clock.t += 4
        rounds[0] += 1
        assert e.leading() and loop.age() == 0
    clock.t += 11  # no round for 11 s
    assert loop.stuck()
    assert not e.leading() and lease.released == 1 and lease.free
    clock.t += 19  # it leaves the lock to the followers for L
    assert not e.leading() and lease.free
    clock.t += 2
    assert e.leading() and not loop.stuck()  # nobody took it: it leads again, its loop's clock restarted
    e.close()
    lease.shared = False  # the only replica (SQLite) keeps leading: there is nobody to hand the lead on to
    e = Elector(lease, loop.reset, lease_s=20, stuck=loop.stuck, clock=clock)
    assert e.leading() and loop.age() == 0
    clock.t += 30
    assert loop.stuck() and e.leading()
    e.close()


def test_the_loop_clock_ages_only_without_a_new_round():
    clock, rounds = Clock(), [3]
    loop = LoopClock(lambda: rounds[0], bound_s=5, clock=clock)
    assert loop.age() == 0
    clock.t += 4
    assert loop.age() == 4 and not loop.stuck()
    clock.t += 2
    assert loop.stuck()
    rounds[0] += 1
    assert loop.age() == 0
    clock.t += 6
    loop.reset()
    assert loop.age() == 0


def test_the_fence_refuses_a_lapsed_leaders_writes_but_not_its_lease_or_others(pg_url):
    clock = Clock()
    eng = make_engine(pg_url, lease_s=10)
    e = Elector(lease_for(eng, "fence-test"), lease_s=10, clock=clock)
    fence(eng, e)
    assert e.leading()
    with eng.connect() as c:
        assert c.execute(text("SELECT 1")).scalar() == 1
        clock.t += TRUST * 10 + 1
        with pytest.raises(LeaseLost):
            c.execute(text("SELECT 2"))
    with eng.begin() as c:  # a statement before the lapse, the commit after: refused too
        clock.t = 1000.0
        assert e.leading()
        c.execute(text("CREATE TEMP TABLE IF NOT EXISTS fenced (x int)"))
        clock.t += TRUST * 10 + 1
        with pytest.raises(LeaseLost):
            c.commit()
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(eng.connect().execute(text("SELECT 3")).scalar()))
    t.start()
    t.join()
    assert seen == [3]  # an API handler's statement goes through
    assert e.leading()  # the lease's own session is exempt: confirming it renews the trust
    e.close()
    eng.dispose()


# -- readiness -----------------------------------------------------------------------------------


@contextmanager
def silent_server() -> Iterator[int]:
    """A TCP port that accepts connections and never answers (a database on a dead host, nearly)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def test_readiness_fails_when_the_store_does_not_answer_or_the_loop_is_stuck(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    app = create_app(store, admin_token="tok", home=tmp_path, start_loop=False)
    client = TestClient(app)
    r = client.get("/readyz")
    assert r.status_code == 200, r.json()
    assert r.json()["db"] == "ok" and r.json()["leading"] is False and r.json()["loop_age_s"] is None
    assert client.get("/healthz").json() == {"status": "ok", "leader": False, "leading": False, "loop_age_s": None}

    # this replica leads, and its loop goes round ... then does not
    state = app.state
    state.loop_clock.bound_s = 0.3
    assert state.elector.leading()
    state.coordinator.round()
    assert client.get("/readyz").status_code == 200
    time.sleep(0.5)
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["leading"] is True and r.json()["loop_age_s"] > 0.3
    assert "scheduling loop" in r.json()["reasons"][0]
    h = client.get("/healthz")
    assert h.status_code == 200 and h.json()["loop_age_s"] > 0.3  # liveness stays cheap and up
    state.coordinator.round()
    assert client.get("/readyz").status_code == 200

    # the store refuses connections: 503 at once, with the error
    state.db_probe = DbProbe(Store("postgresql+psycopg://u@127.0.0.1:1/x", run_migrations=False), 5.0)
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["db"] == "store error: OperationalError"  # no address: no token
    # the store accepts and never answers: 503 after the probe's timeout; probes do not pile up
    with silent_server() as port:
        state.db_probe = DbProbe(Store(f"postgresql+psycopg://u@127.0.0.1:{port}/x", run_migrations=False), 0.3)
        for _ in range(3):
            t0 = time.monotonic()
            r = client.get("/readyz")
            assert r.status_code == 503 and "no answer from the store within 0.3 s" in r.json()["reasons"]
            assert time.monotonic() - t0 < 2
        # one probe hangs on the silent store; three would be a pile-up. (A probe that
        # has just answered may still be exiting on a busy machine: it gets 1 s.)
        deadline = time.monotonic() + 1.0
        while sum(t.name == "tidal-db-probe" for t in threading.enumerate()) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(t.name == "tidal-db-probe" for t in threading.enumerate()) <= 1
