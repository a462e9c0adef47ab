"""Ctrl-C while the main thread uses the store, as `tidal up` gets it (it
installs :func:`tidal.control.interrupts.handler`): the interrupt waits for
the store session to end and is raised then, as KeyboardInterrupt; the store
works afterwards (no write lock or connection left behind, nothing waits for
SQLite's busy timeout), and no write that returned is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tidal.control import interrupts

# a real process (SIGINT to its main thread at random moments, from a timer thread), so the
# interrupt arrives wherever the main thread is: in the loop, in SQLAlchemy's flush, in its rollback
SCRIPT = textwrap.dedent("""
    import json, random, signal, sys, threading, time
    from tidal.control import interrupts
    from tidal.control.db import Job, Store
    signal.signal(signal.SIGINT, interrupts.handler)
    store = Store(sys.argv[1])
    random.seed(int(sys.argv[2]))

    def read():
        with store.session(write=False) as s:
            return [j.id for j in s.query(Job).filter(Job.state == "pending")]

    def write(jid):
        with store.session() as s:
            s.add(Job(id=jid, user="u", name="n", state="pending", spec={}, submit_time=0.0, tags={}))

    kinds, acked, n, slowest = {}, [], 0, 0.0
    for i in range(int(sys.argv[3])):
        fired = threading.Event()
        def fire():  # to the main thread, as a terminal's Ctrl-C arrives: a blocking call there returns at once
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            fired.set()
        try:
            try:
                threading.Timer(random.uniform(0, 0.004), fire).start()  # it may fire before start() returns
                end = time.monotonic() + 0.012
                while time.monotonic() < end:
                    n += 1
                    t0 = time.monotonic()
                    if i % 2:
                        read()
                    else:
                        write(f"j{n}")
                        acked.append(f"j{n}")
                    slowest = max(slowest, time.monotonic() - t0)
            finally:
                fired.wait()
                time.sleep(0.002)
        except BaseException as e:
            kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
    stored = set(read())
    print(json.dumps({"kinds": kinds, "lost": sorted(set(acked) - stored), "acked": len(acked),
                      "slowest_s": slowest}))
""")


@pytest.mark.timeout(120)
def test_ctrl_c_mid_store_session_is_raised_after_it(tmp_path):
    res = subprocess.run([sys.executable, "-c", SCRIPT, f"sqlite:///{tmp_path / 's.db'}", "7", "200"],
                         capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(out["kinds"]) == {"KeyboardInterrupt"}, out
    # Python drops an interrupt that lands in a finalizer ("Exception ignored in ..."): a few may be lost
    assert out["kinds"]["KeyboardInterrupt"] >= 190, out
    assert out["acked"] > 0 and out["lost"] == [], out
    assert out["slowest_s"] < 5.0, out  # no session waited for a lock an interrupted one kept


def test_shield_holds_the_interrupt_until_the_session_ends(tmp_path):
    from tidal.control.db import Store

    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    old = signal.signal(signal.SIGINT, interrupts.handler)
    reached = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with store.session(write=False):
                with store.session(write=False):  # nested: raised when the outer one ends
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.05)
                    reached.append("inner")
                reached.append("outer")
        assert reached == ["inner", "outer"]
        with pytest.raises(KeyboardInterrupt):  # outside a session: at once, as Python's default
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    finally:
        signal.signal(signal.SIGINT, old)


def test_interrupt_behind_a_failed_rollback_surfaces_as_itself(tmp_path):
    """Python's default handler (commands other than `up`): when SQLAlchemy's
    own rollback fails after an interrupt, its error (here a stand-in) must
    not replace the interrupt, and the store works afterwards."""
    from tidal.control.db import Job, Store

    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    with pytest.raises(KeyboardInterrupt):
        with store.session() as s:
            s.add(Job(id="lost", user="u", name="n", state="pending", spec={}, submit_time=0.0, tags={}))
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise RuntimeError("Can't reconnect until invalid transaction is rolled back") from None
    with pytest.raises(RuntimeError):  # an error with no interrupt behind it stays itself
        with store.session():
            raise RuntimeError("plain")
    with store.session() as s:
        s.add(Job(id="kept", user="u", name="n", state="pending", spec={}, submit_time=0.0, tags={}))
    with store.session(write=False) as s:
        assert [j.id for j in s.query(Job)] == ["kept"]  # the interrupted write was rolled back
