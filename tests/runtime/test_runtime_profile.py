"""``profile(min_p, max_p)`` (EDL §5.2): one job started at max_p
workers, scaled in one worker at a time, ~steps measured at each size; the
curve is written in the scheduler's profile format."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from runtime_helpers import launch, master_url
from tidal.core.profile import load_profiles
from tidal.runtime import MasterClient
from tidal.runtime.profiling import profile, write_profile_csv


def test_write_profile_csv_loads(tmp_path: Path) -> None:
    p = write_profile_csv(tmp_path / "mlp.csv", 24, {3: 30.0, 1: 12.5, 2: 21.0})
    rows = list(csv.reader(p.open()))
    assert rows == [["global_batch_size", "1", "2", "3"], ["24", "12.5", "21", "30"]]
    prof = load_profiles(tmp_path)
    assert prof.models == ["mlp"] and prof.batch_sizes("mlp") == [24]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_profile_3_to_1_writes_loadable_curve(tmp_path: Path) -> None:
    out, home, prof_dir = tmp_path / "out", tmp_path / "home", tmp_path / "profiles"
    out.mkdir()
    # ~12 ms steps so that the scale-in's switch lead (0.5 s) is ~40 steps of data
    proc = launch("prof", 3, out, home, "--n", "480", "--batch", "24", "--epochs", "40", "--sleep", "0.01", timeout=100)
    try:
        c = MasterClient(master_url("prof", home, proc), patience_s=10)
        c.wait_for(3, timeout_s=60)
        res = profile(c, 1, 3, 24, steps=10, warmup=2, out_dir=prof_dir, model="elastic-mlp", timeout_s=60)
        (out / "fast").write_text("")  # let the job run out quickly
        text, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, text
    assert sorted(res.its) == [1, 2, 3]
    for p, (s0, s1, dt) in res.windows.items():
        assert s1 - s0 >= 10 and dt > 0 and res.its[p] > 0
    assert "scale_in 3->2" in text and "scale_in 2->1" in text, text
    prof = load_profiles(prof_dir)
    assert prof.models == ["elastic-mlp"] and prof.batch_sizes("elastic-mlp") == [24]
    curve = prof.curves["elastic-mlp"][24]
    assert curve.counts == (1, 2, 3) and len(curve.values) == 3  # one measured value per size
    for p in (1, 2, 3):
        assert prof.throughput("elastic-mlp", 24, p) == pytest.approx(res.its[p], rel=1e-5)
