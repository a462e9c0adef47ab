"""Ctrl-C in the middle of a store statement (as `tidal up` gets it while it
reads the store): the caller sees KeyboardInterrupt, never SQLAlchemy's
PendingRollbackError; the store works afterwards, and no write that returned
is lost."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# a real process (SIGINT to itself at random moments, from a timer thread), so the interrupt lands
# wherever the main thread is: in the driver, in SQLAlchemy's flush, in its own rollback
SCRIPT = textwrap.dedent("""
    import json, os, random, signal, sys, threading, time
    from tidal.control.db import Job, Store
    store = Store(sys.argv[1])
    random.seed(int(sys.argv[2]))

    def read():
        with store.session(write=False) as s:
            return [j.id for j in s.query(Job).filter(Job.state == "pending")]

    def write(jid):
        with store.session() as s:
            s.add(Job(id=jid, user="u", name="n", state="pending", spec={}, submit_time=0.0, tags={}))

    kinds, acked, n = {}, [], 0
    for i in range(int(sys.argv[3])):
        fired = threading.Event()
        def fire():
            os.kill(os.getpid(), signal.SIGINT)
            fired.set()
        threading.Timer(random.uniform(0, 0.004), fire).start()
        try:
            try:
                end = time.monotonic() + 0.012
                while time.monotonic() < end:
                    n += 1
                    if i % 2:
                        read()
                    else:
                        write(f"j{n}")
                        acked.append(f"j{n}")
            finally:
                fired.wait()
                time.sleep(0.002)  # the handler runs at the next bytecode
        except BaseException as e:
            kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
    stored = set(read())
    print(json.dumps({"kinds": kinds, "lost": sorted(set(acked) - stored), "acked": len(acked)}))
""")


@pytest.mark.timeout(120)
def test_ctrl_c_mid_statement_surfaces_as_keyboard_interrupt(tmp_path):
    res = subprocess.run([sys.executable, "-c", SCRIPT, f"sqlite:///{tmp_path / 's.db'}", "7", "200"],
                         capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(out["kinds"]) == {"KeyboardInterrupt"}, out
    assert out["kinds"]["KeyboardInterrupt"] >= 190, out  # a few may land between two statements' loops
    assert out["acked"] > 0 and out["lost"] == [], out
