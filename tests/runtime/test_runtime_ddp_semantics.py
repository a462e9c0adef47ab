"""DDP's contract across a rescale: a script written the usual way
(tests/runtime/outside_train.py) with gradient clipping, a GradScaler under
bf16 autocast, gradient accumulation with no_sync, or parameters some ranks
do not use, scaled 2 -> 3 -> 1 while it trains, ends with the parameters of
the same script run alone, and every sample of every epoch is used once."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime_helpers import HERE, env, finish, master_url, read_steps
from tidal.runtime.client import MasterClient

SCRIPT = HERE / "outside_train.py"
N, BATCH, EPOCHS = 384, 24, 6
TOL = {"clip": 1e-6, "accum": 1e-6, "unused": 1e-6, "amp": 2e-2}  # bf16 rounding depends on the split


def _run_alone(out: Path, home: Path, feature: str) -> dict[str, torch.Tensor]:
    out.mkdir()
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--features", feature], env=env(home),
                   check=True, capture_output=True, timeout=120)
    return torch.load(out / "final.pt")


def _launch(out: Path, home: Path, feature: str) -> subprocess.Popen[str]:
    out.mkdir()
    cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", "2", "--job", "outside", "--timeout",
           "150", str(SCRIPT), "--out", str(out), "--features", feature, "--sleep", "0.3"]  # slow until "fast": a newcomer starting on a busy machine must find steps left
    return subprocess.Popen(cmd, env=env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _check_exactly_once(out: Path) -> set[int]:
    per_epoch: dict[int, list[int]] = {e: [] for e in range(EPOCHS)}
    worlds = set()
    for recs in read_steps(out).values():
        for r in recs:
            per_epoch[r["epoch"]].extend(r["idx"])
            worlds.add(r["world"])
    for e, idx in per_epoch.items():
        assert sorted(idx) == list(range(N)), f"epoch {e}: {len(idx)} indices, {len(set(idx))} distinct"
    return worlds


@pytest.mark.timeout(240)
# clip runs by default (the idiom most often lost); the others with -m slow
@pytest.mark.parametrize("feature", ["clip", *(pytest.param(f, marks=pytest.mark.slow) for f in ("amp", "accum", "unused"))])
def test_rescaled_run_matches_the_script_alone(tmp_path: Path, feature: str) -> None:
    ref = _run_alone(tmp_path / "alone", tmp_path / "home0", feature)
    out, home = tmp_path / "out", tmp_path / "home"
    proc = _launch(out, home, feature)
    try:
        c = MasterClient(master_url("outside", home, proc), patience_s=10)
        c.wait_for(2, timeout_s=60)
        while c.status().step < 3:
            time.sleep(0.02)
        assert c.scale_to(3).accepted
        c.wait_for(3, timeout_s=60)
        step = c.status().step
        while c.status().step < step + 3:
            time.sleep(0.02)
        assert c.scale_to(1).accepted
        c.wait_for(1, timeout_s=60)
        (out / "fast").touch()
        text = finish(proc, timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, text
    assert _check_exactly_once(out) == {1, 2, 3}
    got = torch.load(out / "final.pt")
    for k, v in ref.items():
        d = ((got[k] - v).norm() / v.norm().clamp_min(1e-12)).item() if v.norm() > 0 else (got[k] - v).norm().item()
        assert d <= TOL[feature], f"{feature}: {k} differs from the run alone by {d:.3g}"
    if feature == "unused":
        assert torch.equal(got["never.weight"], ref["never.weight"])  # grad None: AdamW left it alone
