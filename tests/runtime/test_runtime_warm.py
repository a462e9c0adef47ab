"""Warm spares (tidal.runtime.warm): a scale-out's newcomer starts from a
process whose interpreter, imports and first optimizer step are done, and
runs the script exactly as ``python SCRIPT ARGS`` would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from runtime_helpers import check_exactly_once, launch, master_url, read_steps

from tidal.runtime.client import MasterClient
from tidal.runtime.warm import SparePool, script_imports

SCRIPT = '''
import json, os, sys
import numpy
import helper_mod  # the script's own module: never imported ahead
if "--raise" in sys.argv:
    raise ValueError("boom")
print(json.dumps({"x": os.environ.get("X"), "argv": sys.argv, "name": __name__, "path0": sys.path[0],
                  "stdin": sys.stdin.read(), "helper": helper_mod.WHO}), flush=True)
sys.exit(3)
'''


def test_script_imports_are_the_scripts_third_party_and_stdlib_modules(tmp_path: Path) -> None:
    (tmp_path / "helper_mod.py").write_text("import os\nWHO = os.environ.get('X')\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text("from __future__ import annotations\nimport json, numpy.linalg\nimport helper_mod\n"
                      "from pkg import thing\nfrom . import rel\nfrom torch.utils.data import DataLoader\n"
                      "def f():\n    import scipy\n")
    assert script_imports(str(script)) == ["json", "numpy.linalg", "torch.utils.data"]
    (tmp_path / "broken.py").write_text("import (\n")
    assert script_imports(str(tmp_path / "broken.py")) == []


@pytest.mark.timeout(120)
def test_a_granted_spare_runs_the_script_as_python_would_and_ungranted_ones_leave(tmp_path: Path) -> None:
    (tmp_path / "helper_mod.py").write_text("import os\nWHO = os.environ.get('X')\n")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    procs: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], fds: tuple[int, ...]) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             pass_fds=fds, cwd="/")
        procs.append(p)
        return p

    pool = SparePool(str(script), 2, start)
    try:
        assert pool.fill() == 2 and pool.fill() == 0
        # one granted at once, still warming (a scale-out right after the job started)
        early = pool.take({"X": "w7"}, ["--flag", "1"])
        deadline = time.monotonic() + 90
        while pool.warm() < 1:
            assert time.monotonic() < deadline, "the spare did not warm up within 90 s"
            time.sleep(0.1)
        # warm means imported: the script's third-party import is done, its own module is not
        bad = pool.take({"X": "w8"}, ["--raise"])
        assert early is not None and bad is not None
        out, err = early.communicate(timeout=60)
        assert early.returncode == 3, err.decode()
        got = json.loads(out)
        assert got == {"x": "w7", "argv": [str(script), "--flag", "1"], "name": "__main__",
                       "path0": str(tmp_path), "stdin": "", "helper": "w7"}
        out, err = bad.communicate(timeout=60)
        lines = err.decode().strip().splitlines()
        assert bad.returncode == 1 and lines[-1] == "ValueError: boom", err.decode()
        assert lines[0] == "Traceback (most recent call last):" and "runpy" not in err.decode()
        assert str(script) in lines[1], lines  # the script's own frame comes first
        assert pool.warm() == 0 and pool.fill() == 2  # taken spares are replaced; these are never granted
    finally:
        pool.close()
    assert all(p.poll() is not None for p in procs)
    assert pool.take({}, []) is None


@pytest.mark.slow  # ~40 s
@pytest.mark.timeout(180)
def test_a_scale_out_under_tidal_run_starts_from_a_warm_spare(tmp_path: Path) -> None:
    out, home = tmp_path / "out", tmp_path / "home"
    out.mkdir()
    n, batch = 2400, 24
    proc = launch("warm", 2, out, home, "--n", str(n), "--batch", str(batch), "--epochs", "2", "--sleep", "0.1",
                  timeout=170)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        c = MasterClient(master_url("warm", home, proc), patience_s=10)
        c.wait_for(2, timeout_s=90)
        deadline = time.monotonic() + 120
        while not any("warm spare" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.1)
        assert c.scale_out(1).accepted
        assert c.wait_for(3, timeout_s=60).state == "running"
        (out / "fast").touch()
        proc.wait(timeout=120)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines)
    assert proc.returncode == 0, text
    check_exactly_once(read_steps(out), n, batch, 2)
    warm = {p.stem[len("summary-"):]: json.loads(p.read_text())["warm_start"] for p in out.glob("summary-*.json")}
    assert warm == {"w0": False, "w1": False, "w2": True}, warm
    # no spare outlives its launcher
    left = subprocess.run(["pgrep", "-f", f"tidal.runtime.warm .*{Path(__file__).parent}"], capture_output=True,
                          text=True).stdout.split()
    assert not left, left


@pytest.mark.slow  # ~10 s; by default the spares' own test covers the warm-up and the run
@pytest.mark.timeout(120)
def test_an_agents_gated_process_warms_the_same_way_and_runs_once_the_gate_opens(tmp_path: Path) -> None:
    (tmp_path / "helper_mod.py").write_text("import os\nWHO = os.environ.get('X')\n")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    gate = tmp_path / "gate"
    p = subprocess.Popen([sys.executable, "-m", "tidal.agent.prewarm", str(gate), "--", sys.executable, "-u",
                          str(script), "--a"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
                         env={**os.environ, "X": "w3"})
    try:
        time.sleep(1.0)
        assert p.poll() is None  # waits at the gate
        gate.touch()
        out, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 3, err.decode()
    first, second = out.decode().splitlines()
    assert first.startswith("[tidal prewarm] warmed up in")
    assert json.loads(second) == {"x": "w3", "argv": [str(script), "--a"], "name": "__main__",
                                  "path0": str(tmp_path), "stdin": "", "helper": "w3"}
