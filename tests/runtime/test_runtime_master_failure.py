"""Master failure (Elan §V-D): the job master is killed with
SIGKILL while the job trains, a new master process restarts from the saved
state on the same addresses, the workers reconnect (HTTP retries, a fresh
TCPStore client) and a scale-in then runs on the restarted master. The job
finishes with exactly-once data and the fixed-size run's parameters."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime_helpers import TRAIN, check_exactly_once, env, read_steps
from test_runtime_elastic import TOL, max_rel_diff, reference_run
from tidal.runtime.client import MasterClient
from tidal.runtime.faults import kill_process, wait_for_step

N, BATCH, EPOCHS, WORKERS = 120, 12, 20, 3
STEPS = EPOCHS * (-(-N // BATCH))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_master(tmp: Path, port: int, store_port: int, resume: bool) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tidal.runtime.launch", "master", "--job", "mfail", "--workers", str(WORKERS),
           "--state", f"sqlite://{tmp / 'master.db'}", "--port", str(port), "--store-port", str(store_port),
           "--timeout", "100", *(["--resume"] if resume else [])]
    return subprocess.Popen(cmd, env=env(tmp / "home"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop_all(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def assert_fixed_run_params(out: Path, names: list[str]) -> None:
    """Exactly these workers saved final parameters, each equal to the fixed-size run's."""
    finals = sorted(out.glob("final-*.pt"))
    assert [f.name for f in finals] == sorted(f"final-{w}.pt" for w in names)
    ref = reference_run(n=N, batch=BATCH, epochs=EPOCHS)
    for f in finals:
        assert max_rel_diff(torch.load(f), ref) <= TOL


def finish_all(out: Path, workers: list[subprocess.Popen[str]], master: subprocess.Popen[str]) -> None:
    """Lift the workers' slowdown; every worker and the master exit 0 and the job finished."""
    (out / "fast").touch()
    texts = [w.communicate(timeout=60)[0] for w in workers]
    assert [w.returncode for w in workers] == [0] * len(workers), texts
    mtext, _ = master.communicate(timeout=30)
    assert master.returncode == 0 and "finished" in mtext, mtext


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_master_killed_and_restarted_from_saved_state(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port, store_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen[str]] = []
    try:
        m1 = start_master(tmp_path, port, store_port, resume=False)
        procs.append(m1)
        workers = []
        for i in range(WORKERS):
            e = dict(env(tmp_path / "home"), TIDAL_MASTER_URL=url, TIDAL_WORKER_ID=f"w{i}")
            workers.append(subprocess.Popen(
                [sys.executable, str(TRAIN), "--out", str(out), "--n", str(N), "--batch", str(BATCH),
                 "--epochs", str(EPOCHS), "--sleep", "0.05"], env=e, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
        procs += workers
        c = MasterClient(url, patience_s=60)
        wait_for_step(c.status, 5, timeout_s=60)
        before = c.status()
        kill_process(m1.pid)  # drop the master
        m1.wait(timeout=10)
        time.sleep(0.5)  # the workers keep training without a master
        assert all(w.poll() is None for w in workers)
        m2 = start_master(tmp_path, port, store_port, resume=True)
        procs.append(m2)
        st = c.status()  # retried until the restarted master answers
        assert (st.gen, st.members, st.state) == (before.gen, before.members, "running"), st
        # rank 0's heartbeat reconnects to the new store: progress flows again
        wait_for_step(c.status, st.step + 5, timeout_s=60)
        # and the restarted master drives a change: 3 -> 2
        assert c.scale_in(1).accepted
        st2 = c.wait_for(2, timeout_s=60)
        assert st2.state == "running" and st2.gen == before.gen + 1, st2
        finish_all(out, workers, m2)
    finally:
        stop_all(procs)
    steps = read_steps(out)
    assert check_exactly_once(steps, N, BATCH, EPOCHS) == STEPS
    worlds = sorted({(r["step"], r["world"]) for recs in steps.values() for r in recs})
    assert [w for _, w in worlds][0] == 3 and [w for _, w in worlds][-1] == 2
    assert st2.members == before.members[:2]  # the highest rank left
    assert_fixed_run_params(out, list(st2.members))


def test_scaling_requests_with_ids_are_idempotent_across_a_restart(tmp_path: Path) -> None:
    """A client that retries a scale request whose answer was lost (the master
    died after applying it) must not cause a second change (Elan §V-D)."""
    from master_helpers import RecordingSpawner
    from tidal.runtime.master import JobMaster
    from tidal.runtime.persistence import open_backend
    from tidal.runtime.server import MasterServer

    sp = RecordingSpawner()
    url = f"file://{tmp_path / 'm.json'}"
    m = JobMaster("j", 2, backend=open_backend(url), spawner=sp, first_worker=2)
    m.register("w0")
    m.register("w1")
    s = MasterServer(m).start()
    try:
        c = MasterClient(s.url, patience_s=5)
        first = c.post("/scale_out", {"n": 1, "request_id": "r1"})
        again = c.post("/scale_out", {"n": 1, "request_id": "r1"})
        assert first == again and first["status"] == "accepted" and sp.calls == [["w2"]]
        assert c.post("/scale_out", {"n": 1, "request_id": "r2"})["status"] == "retry"  # a new request is new
    finally:
        s.stop()
    m2 = JobMaster("j", 2, backend=open_backend(url), resume=True, spawner=sp)
    assert m2.scale_out(1, request_id="r1").to_json() == first and sp.calls == [["w2"]]
    m2.register("w2")
    m2.switched(m2.group.plan.target.gen, 10)  # type: ignore[union-attr]
    assert m2.scale_in(1, request_id="r3").accepted and m2.scale_in(1, request_id="r3").accepted
    assert m2.group.plan is not None and m2.group.plan.leavers == ("w2",)  # one removal, not two


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_master_killed_during_a_scale_out(tmp_path: Path) -> None:
    """The master dies after publishing a scale-out plan (the newcomer is
    waiting for its generation's go, rank 0 may already have agreed on the
    switch step): the restarted master re-publishes the plan on its new
    store, the newcomer reconnects, the switch completes and the job
    finishes with exactly-once data and the fixed-size run's parameters."""
    out = tmp_path / "out"
    out.mkdir()
    port, store_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen[str]] = []

    def worker(wid: str) -> subprocess.Popen[str]:
        e = dict(env(tmp_path / "home"), TIDAL_MASTER_URL=url, TIDAL_WORKER_ID=wid)
        p = subprocess.Popen([sys.executable, str(TRAIN), "--out", str(out), "--n", str(N), "--batch", str(BATCH),
                              "--epochs", str(EPOCHS), "--sleep", "0.05"], env=e, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        procs.append(p)
        return p

    try:
        m1 = start_master(tmp_path, port, store_port, resume=False)
        procs.append(m1)
        workers = [worker(f"w{i}") for i in range(WORKERS)]
        c = MasterClient(url, patience_s=60)
        wait_for_step(c.status, 3, timeout_s=60)
        workers.append(worker("w3"))  # registers on its own: the master plans a scale-out for it
        deadline = time.monotonic() + 60
        while not (c.status().pending or "").startswith("scale_out"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        kill_process(m1.pid)
        m1.wait(timeout=10)
        time.sleep(0.5)
        m2 = start_master(tmp_path, port, store_port, resume=True)
        procs.append(m2)
        st = c.wait_for(4, timeout_s=90)
        assert st.state == "running" and st.members[-1] == "w3", st
        finish_all(out, workers, m2)
    finally:
        stop_all(procs)
    steps = read_steps(out)
    assert check_exactly_once(steps, N, BATCH, EPOCHS) == STEPS
    assert {r["world"] for r in steps["w3"]} == {4}
    assert_fixed_run_params(out, [f"w{i}" for i in range(4)])
