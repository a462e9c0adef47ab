"""Leader election over the store: one PostgreSQL advisory lock among
replicas (a real PostgreSQL server), taken over when the leader's session
dies; a SQLite store's only replica always leads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sqlalchemy import create_engine, text

from tidal.control.leader import AdvisoryLease, Elector, SoleLease, lease_for


def test_one_replica_leads_and_another_takes_over_when_its_session_dies(pg_url):
    a, b = create_engine(pg_url), create_engine(pg_url)
    ea, eb = Elector(lease_for(a, "t1")), Elector(lease_for(b, "t1"))
    assert isinstance(ea.lease, AdvisoryLease)
    assert ea.leading() and not eb.leading() and ea.leading()  # one leader, and it stays
    # the leader's host dies: PostgreSQL ends its session (here: terminated from outside)
    pid = ea.lease._conn.execute(text("SELECT pg_backend_pid()")).scalar()  # type: ignore[union-attr]
    with create_engine(pg_url).connect() as c:
        c.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
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
