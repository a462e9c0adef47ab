"""Stopping ``tidal run`` as a terminal or a batch system does: Ctrl-C (SIGINT
to the terminal's foreground process group) and SIGTERM to the launcher. The
workers run in sessions of their own, as torchrun's do, so the launcher
stops them: bounded time, every worker gone, no traceback, the exit code a
shell expects."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runtime_helpers import TRAIN, env, master_url

from tidal.runtime.client import MasterClient


def _stop_running_job(tmp_path: Path, send: str) -> tuple[int, str, float, list[int]]:
    out, home = tmp_path / "out", tmp_path / "home"
    out.mkdir()
    cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", "2", "--job", "sig", "--timeout", "120",
           str(TRAIN), "--out", str(out), "--n", "4000", "--sleep", "0.05"]
    # its own process group, as a shell gives a foreground job
    proc = subprocess.Popen(cmd, env=env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        MasterClient(master_url("sig", home, proc, timeout=60), patience_s=10).wait_for(2, timeout_s=90)
        workers = _workers(proc.pid, f"{TRAIN} --out {out}")
        assert len(workers) == 2, {p: _cmdline(p) for p in workers}
        t0 = time.monotonic()
        if send == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends: the launcher's whole group
        else:
            proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=60)
        return proc.returncode, text, time.monotonic() - t0, workers
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def _workers(launcher: int, pattern: str) -> list[int]:
    """The launcher's children running the script: not a child of a worker,
    and not a child caught between fork and exec (the launcher starting a
    warm spare), which still shows the launcher's command line when pgrep
    reads it, and may show the spare's (``tidal.runtime.warm SCRIPT``, no
    ``--out``) when it is read again: kept only if it still runs the script."""
    found = subprocess.run(["pgrep", "-P", str(launcher), "-f", pattern], capture_output=True, text=True).stdout.split()
    lines = {int(p): _cmdline(int(p)) for p in found}
    return [p for p, line in lines.items() if pattern in line and "tidal.runtime.launch" not in line]


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "zombie" not in Path(f"/proc/{p}/status").read_text().lower()
                   for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(180)
def test_ctrl_c_stops_the_job_in_order_without_a_traceback(tmp_path: Path) -> None:
    rc, text, took, workers = _stop_running_job(tmp_path, "ctrl-c")
    assert rc == 130, text
    assert "interrupted (Ctrl-C); stopping the workers" in text, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert took < 30, took
    assert _gone(workers, 5), workers


@pytest.mark.slow  # ~20 s
@pytest.mark.timeout(180)
def test_sigterm_to_the_launcher_stops_its_workers(tmp_path: Path) -> None:
    rc, text, took, workers = _stop_running_job(tmp_path, "sigterm")
    assert rc == 143, text
    assert "SIGTERM; stopping the workers" in text and "Traceback" not in text, text
    assert took < 30, took
    assert _gone(workers, 5), workers
