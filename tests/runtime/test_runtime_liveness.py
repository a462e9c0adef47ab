"""A job ends when the platform says, and ``tidal run`` never waits for
workers that will not come.

* ``TIDAL_MAX_STEPS`` (``tidal run --max-steps``; a job spec's
  ``iterations``): a script whose own loop is longer ends at exactly that
  global step on every rank, with every sample up to it used exactly once.
* ``tidal run`` fails within seconds, with one line saying why, when its
  workers exit without registering (the script never called
  ``tidal.runtime.init()``), when one fails before registering (its error's
  last line), or when they do not register within ``TIDAL_JOIN_TIMEOUT_S``.
* A worker started for a job that already finished exits 0 with one line
  and without running the script's post-training code; one whose master
  does not answer gives up after ``TIDAL_MASTER_WAIT_S`` with one line.
* A master restarted from its saved state never reports less progress than
  it did before.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime_helpers import TRAIN, env, finish, launch, read_steps
from tidal.net import LOOPBACK
from tidal.runtime.data import epoch_permutation
from tidal.runtime.master import JobMaster
from tidal.runtime.persistence import open_backend
from tidal.runtime.server import MasterServer

N, BATCH, EPOCHS, LIMIT = 120, 12, 3, 15  # the script's own loop: 30 steps; the job's: 15

pytestmark = pytest.mark.timeout(120)


def _run(tmp_path: Path, script: str, extra_env: dict[str, str] | None = None,
         timeout: float = 60) -> tuple[int, str, float]:
    """``tidal run`` of ``script`` (its text) with 2 workers: exit code, output, seconds taken."""
    path = tmp_path / "script.py"
    path.write_text(script)
    cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", "2", "--job", "live",
           "--timeout", str(timeout), str(path)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=dict(env(tmp_path), **(extra_env or {})), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout + 30)
    return p.returncode, p.stdout, time.monotonic() - t0


# ----------------------------------------------------------------------------- the step limit


@pytest.mark.slow  # 9 s: the default suite stays within 5 min (tests/control/test_worker_env.py runs)
def test_the_step_limit_ends_a_longer_script_at_exactly_that_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = launch("limit", 2, out, tmp_path, "--n", str(N), "--batch", str(BATCH), "--epochs", str(EPOCHS),
                  launcher_args=("--max-steps", str(LIMIT)))
    text = finish(proc)
    assert proc.returncode == 0, text
    assert f"summary: job limit finished" in text and f"{LIMIT} steps" in text, text
    steps = read_steps(out)
    assert sorted(steps) == ["w0", "w1"]
    for w, recs in steps.items():  # every rank took steps 0 .. LIMIT-1, no more
        assert [r["step"] for r in recs] == list(range(LIMIT)), w
        summary = json.loads((out / f"summary-{w}.json").read_text())
        assert summary["steps"] == LIMIT and summary["cursor"] == LIMIT * BATCH
    used: dict[int, list[int]] = {}
    for recs in steps.values():
        for r in recs:
            used.setdefault(r["epoch"], []).extend(r["idx"])
    per_epoch = N // BATCH
    assert sorted(used[0]) == list(range(N))  # the first epoch exactly once
    part = epoch_permutation(N, 0, 1)[: (LIMIT - per_epoch) * BATCH].tolist()
    assert sorted(used[1]) == sorted(part)  # the second up to the limit, exactly once
    assert set(used) == {0, 1}


# ----------------------------------------------------------------------------- workers that do not register


def test_a_script_that_never_calls_init_fails_the_run_at_once(tmp_path: Path) -> None:
    rc, text, took = _run(tmp_path, 'print("training without tidal")\n')
    assert rc != 0, text
    assert "the script never called tidal.runtime.init()" in text, text
    assert took < 20, f"took {took:.1f}s"


def test_a_worker_error_before_registering_fails_the_run_with_its_last_line(tmp_path: Path) -> None:
    rc, text, took = _run(tmp_path, 'raise ValueError("no such dataset: /data/x")\n')
    assert rc != 0, text
    assert "failed before it registered with the job master (exit code 1): ValueError: no such dataset: /data/x" \
        in text, text
    assert took < 20, f"took {took:.1f}s"


@pytest.mark.slow  # 6 s: the default suite stays within 5 min
def test_workers_that_do_not_register_in_time_fail_the_run_naming_the_setting(tmp_path: Path) -> None:
    script = "import time\ntime.sleep(120)\nimport tidal.runtime\ntidal.runtime.init()\n"
    rc, text, took = _run(tmp_path, script, {"TIDAL_JOIN_TIMEOUT_S": "4"})
    assert rc != 0, text
    assert "have not registered with the job master 2 s after they started" in text, text  # the warning first
    assert "did not register with the job master within 4 s ($TIDAL_JOIN_TIMEOUT_S)" in text, text
    assert took < 40, f"took {took:.1f}s"


# ----------------------------------------------------------------------------- newcomers of a job that ended


def _worker(tmp_path: Path, url: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    e = dict(env(tmp_path), TIDAL_MASTER_URL=url, TIDAL_WORKER_ID="w9", **(extra_env or {}))
    return subprocess.run([sys.executable, str(TRAIN), "--out", str(out), "--n", "48", "--batch", "12"], env=e,
                          capture_output=True, text=True, timeout=90)


def test_a_worker_started_for_a_finished_job_exits_quietly(tmp_path: Path) -> None:
    m = JobMaster("j", 1)
    m.register("w0")
    m.done(step=4, cursor=48, epoch=1)
    srv = MasterServer(m).start()
    try:
        p = _worker(tmp_path, srv.url)
    finally:
        srv.stop()
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "the job finished before it joined" in p.stderr, p.stderr
    assert len([ln for ln in p.stderr.splitlines() if ln.strip()]) == 1, p.stderr
    assert not list((tmp_path / "out").glob("final-*.pt"))  # the script's post-training code did not run


def test_a_worker_whose_master_does_not_answer_gives_up_with_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind((LOOPBACK, 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    p = _worker(tmp_path, f"http://{LOOPBACK}:{port}", {"TIDAL_MASTER_WAIT_S": "2"})
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and "TIDAL_MASTER_WAIT_S" in p.stderr, p.stderr
    assert len([ln for ln in p.stderr.splitlines() if ln.strip()]) == 1, p.stderr
    assert time.monotonic() - t0 < 30


# ----------------------------------------------------------------------------- progress after a restart


def test_a_restarted_master_does_not_report_less_progress(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'state.json'}"
    m = JobMaster("j", 2, backend=open_backend(url))
    m.register("w0")
    m.register("w1")
    m.heartbeat({"gen": 1, "step": 486, "cursor": 486 * 32, "epoch": 3, "step_time_s": 0.1})
    assert m.status().step == 486  # reported
    again = JobMaster("j", 2, backend=open_backend(url), resume=True)  # e.g. kill -9, then --resume
    st = again.status()
    assert st.state == "running" and st.step == 486 and st.epoch == 3
