"""Stragglers (EDL §5.2, DLRover §5.4): a rank slower than 1.2x the
median compute time for 10 consecutive steps is reported and, with the
``remove`` policy, removed by scale-in; the job still uses every sample once
and ends with the fixed-size run's parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime_helpers import check_exactly_once, finish, launch, read_steps
from test_runtime_elastic import TOL, max_rel_diff, reference_run
from tidal.runtime.master import JobMaster
from tidal.runtime.stragglers import StragglerConfig, StragglerDetector


def test_detector_needs_ten_consecutive_slow_steps() -> None:
    d = StragglerDetector()
    assert (d.config.factor, d.config.window) == (1.2, 10)
    for _ in range(9):
        assert d.update([1.0, 1.0, 1.3]) == []
    assert d.update([1.0, 1.0, 1.1]) == []  # not slow enough: the streak restarts
    for _ in range(9):
        assert d.update([1.0, 1.0, 1.3]) == []
    assert d.update([1.0, 1.0, 1.3]) == [(2, pytest.approx(1.3))]
    assert d.update([1.0, 1.0, 1.3]) == []  # reported once
    d.reset()
    assert d.update([2.0]) == []  # a single rank has no median to compare with
    d = StragglerDetector(StragglerConfig(min_excess_s=0.002))
    for _ in range(20):  # 1.5x but only 0.5 ms slower than the median: below the optional absolute floor
        assert d.update([0.001, 0.001, 0.0015]) == []


@pytest.mark.parametrize("policy", ["report", "remove"])
def test_master_straggler_policy(policy: str) -> None:
    m = JobMaster("j", 3, straggler_policy=policy)
    for i in range(3):
        m.register(f"w{i}")
    m.straggler("w1", gen=1, step=20, ratio=3.0)
    m.straggler("w1", gen=1, step=20, ratio=3.0)  # a retried report is recorded once
    st = m.status()
    assert [s["worker_id"] for s in st.stragglers] == ["w1"]
    if policy == "remove":
        assert st.stragglers[0]["action"] == "removed" and m.group.plan is not None
        assert m.group.plan.leavers == ("w1",)
    else:
        assert st.stragglers[0]["action"] == "reported" and m.group.plan is None
    with pytest.raises(ValueError):
        JobMaster("j", 1, straggler_policy="nope")


@pytest.mark.slow
@pytest.mark.timeout(110)
def test_slow_worker_is_detected_and_removed(tmp_path: Path) -> None:
    out, home = tmp_path / "out", tmp_path / "home"
    out.mkdir()
    n, batch, epochs = 120, 12, 10
    proc = launch("strag", 3, out, home, "--n", str(n), "--batch", str(batch), "--epochs", str(epochs),
                  "--sleep", "0.02", timeout=100, extra_env={"TIDAL_FAULTS": "slow:w2@0=2000"},
                  launcher_args=("--straggler-policy", "remove"))
    text = finish(proc, 100)
    assert proc.returncode == 0, text
    assert "straggler w2 in gen 1" in text and ": removed" in text, text
    assert "scale_in 3->2" in text, text
    steps = read_steps(out)
    check_exactly_once(steps, n, batch, epochs)
    assert max(r["step"] for r in steps["w2"]) < epochs * n // batch - 1  # it left before the end
    assert min(r["step"] for r in steps["w2"]) == 0 and all(r["world"] == 3 for r in steps["w2"])
    finals = sorted(p.name for p in out.glob("final-*.pt"))
    assert finals == ["final-w0.pt", "final-w1.pt"]
    ref = reference_run(n=n, batch=batch, epochs=epochs)
    for f in finals:
        assert max_rel_diff(torch.load(out / f), ref) <= TOL
