"""A job master that moves to another address while its old host goes
silent (SIGSTOP: its connections hang, nothing resets them), as the control
plane relocates a master whose host died: a new master resumes from the
saved state on other ports and ``$TIDAL_MASTER_FILE`` names it. Every
worker follows within seconds — rank 0's progress heartbeat, whose store
calls to the old master only time out (it makes no HTTP call that would
have found the file), and every rank's liveness beats — so the new master
sees the job's step rise again, not the step it resumed at."""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from runtime_helpers import TRAIN, check_exactly_once, env, read_steps
from test_runtime_master_failure import BATCH, EPOCHS, N, STEPS, WORKERS, assert_fixed_run_params, finish_all, \
    free_port, stop_all
from tidal.runtime.client import MasterClient
from tidal.runtime.faults import wait_for_step

FOLLOW_BOUND_S = 10.0


def _master(tmp: Path, db: str, port: int, store_port: int, resume: bool) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tidal.runtime.launch", "master", "--job", "mmove", "--workers", str(WORKERS),
           "--state", f"sqlite://{tmp / db}", "--port", str(port), "--store-port", str(store_port),
           "--timeout", "100", *(["--resume"] if resume else [])]
    return subprocess.Popen(cmd, env=env(tmp / "home"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _beats(store_port: int) -> dict[str, bytes]:
    s = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=5))
    keys = [f"tidal/mmove/alive/w{i}" for i in range(WORKERS)]
    return {k: bytes(s.get(k)) for k in keys if s.check([k])}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_every_worker_follows_a_master_that_moved_away_from_a_silent_host(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    p1, s1, p2, s2 = free_port(), free_port(), free_port(), free_port()
    url1, url2 = f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}"
    where = tmp_path / "master.url"  # what the node's agent writes
    where.write_text(url1)
    procs: list[subprocess.Popen[str]] = []
    try:
        m1 = _master(tmp_path, "m1.db", p1, s1, resume=False)
        procs.append(m1)
        workers = []
        for i in range(WORKERS):
            e = dict(env(tmp_path / "home"), TIDAL_MASTER_URL=url1, TIDAL_MASTER_FILE=str(where),
                     TIDAL_WORKER_ID=f"w{i}")
            workers.append(subprocess.Popen(
                [sys.executable, str(TRAIN), "--out", str(out), "--n", str(N), "--batch", str(BATCH),
                 "--epochs", str(EPOCHS), "--sleep", "0.05"], env=e, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
        procs += workers
        wait_for_step(MasterClient(url1, patience_s=60).status, 5, timeout_s=60)
        os.kill(m1.pid, signal.SIGSTOP)  # the old master's host goes silent
        t0 = time.monotonic()
        shutil.copy(tmp_path / "m1.db", tmp_path / "m2.db")  # the state the new host resumes from
        m2 = _master(tmp_path, "m2.db", p2, s2, resume=True)
        procs.append(m2)
        where.write_text(url2)
        c = MasterClient(url2, patience_s=60)
        resumed_at = c.status().step
        up = time.monotonic()  # the new master answers (its start-up is not the workers' doing)
        wait_for_step(c.status, resumed_at + 5, timeout_s=FOLLOW_BOUND_S + 30)
        took = time.monotonic() - up
        first = _beats(s2)
        time.sleep(1.5)
        again = _beats(s2)
        print(f"\nold master silent -> new master up: {up - t0:.1f}s; -> rank 0's progress rising there: "
              f"{took:.1f}s more")
        assert took <= FOLLOW_BOUND_S, f"rank 0 followed the moved master {took:.1f}s after it was up"
        assert len(again) == WORKERS and all(again[k] != first.get(k) for k in again), (first, again)
        m1.kill()  # SIGKILL ends a stopped process too
        m1.wait(timeout=10)
        finish_all(out, workers, m2)
    finally:
        stop_all(procs)
    steps = read_steps(out)
    assert check_exactly_once(steps, N, BATCH, EPOCHS) == STEPS
    assert_fixed_run_params(out, [f"w{i}" for i in range(WORKERS)])
