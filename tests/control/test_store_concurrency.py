"""The store under concurrent writers: no "database is locked", no lost
write, no deadlock of a session opened inside another (SQLite and PostgreSQL)."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import func, select

from tidal.control.db import Event, Job, Store

THREADS, WRITES = 8, 50


@pytest.fixture
def url(store_url):
    return store_url


def _job(job_id: str) -> Job:
    return Job(id=job_id, user="u", name="n", state="submitted", spec={}, submit_time=time.time(), rescales=0)


def _hammer(stores: list[Store], work) -> list[str]:
    """Run ``work(store, thread, i)`` WRITES times in each of THREADS threads; the errors."""
    errors: list[str] = []
    start = threading.Barrier(THREADS)

    def run(t: int) -> None:
        start.wait()
        for i in range(WRITES):
            try:
                work(stores[t % len(stores)], t, i)
            except Exception as e:  # noqa: BLE001 - collected and asserted on
                errors.append(f"{type(e).__name__}: {e}"[:300])

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    return errors


def test_concurrent_read_modify_write_sessions_lose_nothing(url):
    """8 threads x 50 sessions, over two engines on one database (as two
    processes would be), each reading a shared counter, adding one, adding a
    job row and an event: every write lands, none raises."""
    stores = [Store(url), Store(url, run_migrations=False)]
    with stores[0].session() as s:
        s.add(_job("counter"))

    def work(store: Store, t: int, i: int) -> None:
        with store.session() as s:
            c = s.get(Job, "counter", with_for_update=True)  # FOR UPDATE: PostgreSQL's row lock
            s.scalar(select(func.count()).select_from(Event))  # a reader that then writes
            c.rescales += 1
            s.add(_job(f"j{t}-{i}"))
            store.log(s, "test.write", f"j{t}-{i}")

    errors = _hammer(stores, work)
    assert errors == []
    with stores[0].session(write=False) as s:
        assert s.get(Job, "counter").rescales == THREADS * WRITES
        assert s.scalar(select(func.count()).select_from(Job)) == THREADS * WRITES + 1
        assert s.scalar(select(func.count()).select_from(Event).where(Event.kind == "test.write")) == THREADS * WRITES


def test_readers_run_beside_writers(url):
    """Read-only sessions (the API's listings) neither fail nor see half a write."""
    store = Store(url)

    def work(store: Store, t: int, i: int) -> None:
        if t % 2:
            jobs = select(func.count()).select_from(Job).scalar_subquery()
            events = select(func.count()).select_from(Event).where(Event.kind == "test.write").scalar_subquery()
            with store.session(write=False) as s:  # a write adds a job and its event together
                seen = s.execute(select(jobs, events)).one()
                assert seen[0] == seen[1], tuple(seen)
        else:
            with store.session() as s:
                s.add(_job(f"j{t}-{i}"))
                s.flush()
                store.log(s, "test.write", f"j{t}-{i}")

    assert _hammer([store], work) == []


def test_a_session_inside_another_does_not_wait_for_itself(tmp_path):
    """On SQLite the outer session holds the write lock; an inner one in the
    same thread reads instead of waiting for it (30 s, then "locked")."""
    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    t0 = time.monotonic()
    with store.session() as outer:
        outer.add(_job("a"))
        outer.flush()
        with store.session() as inner:
            assert inner.get(Job, "a") is None  # not committed yet
        assert store.user_for_token("nope") is None
    assert time.monotonic() - t0 < 5
    with store.session(write=False) as s:
        assert s.get(Job, "a") is not None
