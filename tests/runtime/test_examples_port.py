"""examples/port: a plain script, its DDP version and its Tidal version.
Porting to Tidal changes no more lines than porting to DDP, and all three
run (DDP under torchrun with 2 gloo processes)."""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

import pytest

from runtime_helpers import REPO, env

PORT = REPO / "examples" / "port"


def _code(path: Path) -> list[str]:
    """The script without its module docstring (which says what it is)."""
    text = path.read_text()
    end = text.index('"""', 3) + 3
    return text[end:].splitlines()


def changed_lines(a: Path, b: Path) -> tuple[int, int]:
    """(added, removed) lines from ``a`` to ``b``."""
    added = removed = 0
    for line in difflib.unified_diff(_code(a), _code(b), lineterm="", n=0):
        if line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return added, removed


def test_tidal_port_changes_no_more_lines_than_ddp() -> None:
    ddp = changed_lines(PORT / "plain.py", PORT / "ddp.py")
    tidal = changed_lines(PORT / "plain.py", PORT / "tidal_port.py")
    assert sum(tidal) <= sum(ddp), f"Tidal +{tidal[0]}/-{tidal[1]} vs DDP +{ddp[0]}/-{ddp[1]}"
    assert tidal[0] >= 5  # the count is real: the port does change lines


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_three_scripts_run(tmp_path: Path) -> None:
    e = env(tmp_path / "home")
    for script in ("plain.py", "tidal_port.py"):
        r = subprocess.run([sys.executable, str(PORT / script), "--epochs", "1", "--save", str(tmp_path / script)],
                           env=e, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "accuracy" in r.stdout and (tmp_path / script).exists()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--standalone", str(PORT / "ddp.py"),
                        "--epochs", "1", "--save", str(tmp_path / "ddp.pt")],
                       env=e, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "ddp.pt").exists()


def _tidal(e: dict, *args: str, timeout: float = 120) -> str:
    r = subprocess.run([sys.executable, "-m", "tidal", *args], env=e, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_ported_script_with_eval_on_rank_0_every_epoch_survives_a_scale_out_and_in(tmp_path: Path) -> None:
    """A newcomer joins mid-run, between two of the script's per-epoch
    `job.on_rank0(evaluate, ...)` calls: every member must count those calls
    from the same point (a newcomer counting from its own start waited forever
    for a result rank 0 had published under another number). The worker the
    scale-in removes exits at its batch boundary without running the script's
    code after the loop (it used to: its `on_rank0` returned None and the
    accuracy's format crashed)."""
    import time

    e = env(tmp_path / "home")
    run = subprocess.Popen([sys.executable, "-m", "tidal", "run", "--workers", "2", "--max-workers", "3", "--job",
                            "port", str(PORT / "tidal_port.py"), "--epochs", "150", "--save", str(tmp_path / "m.pt")],
                           env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(8)
        assert "at 3 workers" in _tidal(e, "scale", "port", "--workers", "3")
        assert "at 2 workers" in _tidal(e, "scale", "port", "--workers", "2")
        out, _ = run.communicate(timeout=200)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, out[-3000:]
    assert "epoch 150, final workers 2, 2 rescale(s)" in out, out[-2000:]
    # the worker the scale-in removed left at a batch boundary: it ran none of the script's code after its loop
    # (which printed an accuracy of None and crashed), and said why it ended
    assert "Traceback" not in out and "rank 0 was lost" not in out, out[-4000:]
    assert "removed by a scale-in; exiting" in out, out[-3000:]
    assert (tmp_path / "m.pt").exists()
