"""The master's own host leaves: it hands its state to a new master while
the job trains; workers follow, the old master goes away, and later rescales
run on the new master with exactly-once data."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import pytest

from runtime_helpers import TRAIN, check_exactly_once, env, read_steps
from tidal.runtime.client import MasterClient
from tidal.runtime.host import host_master
from tidal.runtime.master import JobMaster
from tidal.runtime.server import MasterServer
from tidal.runtime.spawner import LocalSpawner, WorkerLaunch

N, BATCH, EPOCHS = 300, 20, 30


def hosted(master: JobMaster) -> tuple[threading.Event, threading.Thread]:
    """Run the master's hosting loop (its periodic step) in a thread until the event is set."""
    stop = threading.Event()
    t = threading.Thread(target=host_master, args=(master,), kwargs={"stop": stop.is_set}, daemon=True)
    t.start()
    return stop, t


@pytest.mark.slow  # 12 s: the default suite stays within 5 min
@pytest.mark.timeout(150)
def test_handover_then_rescale_on_the_new_master(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    args = ["--out", str(out), "--n", str(N), "--batch", str(BATCH), "--epochs", str(EPOCHS), "--sleep", "0.04"]
    sp1 = LocalSpawner(str(TRAIN), args, env=env(tmp_path))
    m1 = JobMaster("ho", 2, spawner=sp1, first_worker=2)
    s1 = MasterServer(m1).start()
    sp1.master_url = s1.url
    sp1.spawn([WorkerLaunch("w0"), WorkerLaunch("w1")])
    stop1, host1 = hosted(m1)
    sp2 = LocalSpawner(str(TRAIN), args, env=env(tmp_path))
    s2: MasterServer | None = None
    stop2: threading.Event | None = None
    try:
        c = MasterClient(s1.url, patience_s=10)
        c.wait_for(2, timeout_s=60)
        while c.status().step < 3:
            time.sleep(0.02)
        # hand over: the successor is bound (its URL known) before the snapshot is taken
        m2 = JobMaster("ho", 2, spawner=sp2)
        s2 = MasterServer(m2)
        sp2.master_url = s2.url
        m2.restore(m1.handover(s2.url))
        s2.start()
        stop2, _ = hosted(m2)
        assert c.status().master_url == s2.url and c.url == s2.url  # the client followed "moved"
        # rank 0 now reports its progress to the new master's store
        step0 = c.status().step
        deadline = time.monotonic() + 30
        while c.status().step <= step0 + 2:
            assert time.monotonic() < deadline, "workers did not follow the handover"
            time.sleep(0.05)
        # the old master's host is gone
        stop1.set()
        host1.join()
        s1.stop()
        del m1
        gc.collect()
        assert c.scale_out(1).accepted
        c.wait_for(3, timeout_s=60)
        assert c.scale_in(ranks=[0]).accepted
        st = c.wait_for(2, timeout_s=30)
        assert st.state == "running" and st.gen == 3, st
        (out / "fast").touch()
        deadline = time.monotonic() + 90
        while any(code is None for code in list(sp1.exit_codes().values()) + list(sp2.exit_codes().values())):
            assert time.monotonic() < deadline, "workers did not finish"
            time.sleep(0.1)
        codes = {**sp1.exit_codes(), **sp2.exit_codes()}
        assert all(code == 0 for code in codes.values()), codes
        assert c.status().state == "finished"
    finally:
        stop1.set()
        if stop2 is not None:
            stop2.set()
        sp1.terminate()
        sp2.terminate()
        if s2 is not None:
            s2.stop()
    check_exactly_once(read_steps(out), N, BATCH, EPOCHS)
    assert len(list(out.glob("final-*.pt"))) == 2
