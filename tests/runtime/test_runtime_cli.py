"""``tidal run`` on the MLP example prints progress, survives ``tidal scale``
up and down, ``tidal migrate`` and ``tidal profile`` from other processes,
and exits 0 with a summary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime_helpers import REPO, env, master_url
from tidal.runtime.client import MasterClient

TIDAL = [sys.executable, "-c", "from tidal.cli.main import app; app()"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tidal_run_and_scale_example(tmp_path: Path) -> None:
    e = env(tmp_path)
    run = subprocess.Popen(
        TIDAL + ["run", "--workers", "2", "--job", "mlpjob", "--timeout", "100", str(REPO / "examples" / "mlp.py"),
                 "--epochs", "80", "--samples", "2048", "--delay", "0.02"],
        env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        c = MasterClient(master_url("mlpjob", tmp_path, run), patience_s=10)
        c.wait_for(2, timeout_s=60)
        up = subprocess.run(TIDAL + ["scale", "mlpjob", "--workers", "3", "--timeout", "60"], env=e,
                            capture_output=True, text=True, timeout=90)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "at 3 workers" in up.stdout
        # move rank 0 elsewhere in one change, then measure the 3 -> 2 scaling curve in place
        mig = subprocess.run(TIDAL + ["migrate", "mlpjob", "0", "--timeout", "60"], env=e,
                             capture_output=True, text=True, timeout=90)
        assert mig.returncode == 0 and "accepted" in mig.stdout, mig.stdout + mig.stderr
        prof = subprocess.run(TIDAL + ["profile", "mlpjob", "--min", "2", "--max", "3", "--batch", "128", "--steps", "5",
                                       "--out", str(tmp_path / "prof"), "--model", "mlp"], env=e,
                              capture_output=True, text=True, timeout=90)
        assert prof.returncode == 0, prof.stdout + prof.stderr
        from tidal.core.profile import load_profiles

        assert tuple(load_profiles(tmp_path / "prof").curves["mlp"][128].counts) == (2, 3)
        down = subprocess.run(TIDAL + ["scale", "mlpjob", "--workers", "1", "--timeout", "60"], env=e,
                              capture_output=True, text=True, timeout=90)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "at 1 workers" in down.stdout
        out, _ = run.communicate(timeout=100)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 0, out
    assert "step " in out and "workers 3" in out  # progress lines, at the new size
    assert "summary: job mlpjob finished" in out and "4 rescale(s)" in out, out
    assert "scale_out 2->3" in out and "migrate 3->3" in out and "scale_in 3->2" in out and "scale_in 2->1" in out
    assert not (tmp_path / "jobs" / "mlpjob.json").exists()  # the job file is cleaned up
    # an unknown job is an error, not a hang
    bad = subprocess.run(TIDAL + ["scale", "nosuchjob", "--workers", "2"], env=e, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0

