"""Weak scaling in a real job: the local batch stays fixed, so the global
batch and (linearly) the learning rate follow the number of workers across a
rescale, and data is still used exactly once per epoch."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from runtime_helpers import check_exactly_once, launch, master_url, read_steps
from tidal.runtime.client import MasterClient

N, LOCAL, EPOCHS = 240, 10, 12


@pytest.mark.slow  # 8 s: the default suite stays within 5 min
@pytest.mark.timeout(120)
def test_weak_scaling_follows_the_world_size(tmp_path: Path) -> None:
    out, home = tmp_path / "out", tmp_path / "home"
    out.mkdir()
    proc = launch("weak", 2, out, home, "--n", str(N), "--batch", str(LOCAL), "--epochs", str(EPOCHS),
                  "--scaling", "weak", "--sleep", "0.04", timeout=100)
    try:
        c = MasterClient(master_url("weak", home, proc), patience_s=10)
        c.wait_for(2, timeout_s=60)
        while c.status().step < 3:
            time.sleep(0.02)
        assert c.scale_in(1).accepted
        st = c.wait_for(1, timeout_s=30)
        assert st.state == "running", st
        (out / "fast").touch()
        text, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, text
    steps = read_steps(out)
    check_exactly_once(steps, N, None, EPOCHS)
    recs = sorted((r for rs in steps.values() for r in rs if r["rank"] == 0), key=lambda r: r["step"])
    two = [r for r in recs if r["world"] == 2]
    one = [r for r in recs if r["world"] == 1]
    assert two and one and two[-1]["step"] < one[0]["step"]
    assert {r["B"] for r in two} == {2 * LOCAL} and {r["B"] for r in one} == {LOCAL}
    # StepLR(step_size=20, gamma=0.8) on top of the linear factor world/2
    for r in recs:
        base = 0.05 * 0.8 ** (r["lr_step"] // 20)
        assert r["lr"] == pytest.approx(base * r["world"] / 2, rel=1e-9), r
