"""``tidal run`` across hosts, without the control plane: network namespaces
stand in for hosts (tests/multihost/netns.py). Host A runs the job and its
master (``--bind 0.0.0.0``), host B adds two workers with ``tidal run --join
A:PORT``, host C one more. C's launcher gets Ctrl-C (a graceful scale-in),
then ``tidal scale --remove-host B`` takes B's two out in one change. Every
sample is used exactly once per epoch and A's workers end with the
parameters of a fixed-size run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"
if str(RUNTIME) not in sys.path:
    sys.path.insert(0, str(RUNTIME))

from runtime_helpers import REPO, TRAIN, check_exactly_once, read_steps  # noqa: E402
from test_runtime_elastic import TOL, max_rel_diff, reference_run  # noqa: E402

PORT = 29517
N, BATCH, EPOCHS = 240, 24, 16


def _env(home: Path, host: str) -> dict[str, str]:
    e = dict(os.environ)
    for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TIDAL_BIND_ADDR", "TIDAL_ADVERTISE_ADDR"):
        e.pop(k, None)  # CI exports GLOO_SOCKET_IFNAME=lo; across hosts each worker picks its own interface
    e.update(OMP_NUM_THREADS="1", TIDAL_HOME=str(home), PYTHONUNBUFFERED="1", TIDAL_HOST=host)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(RUNTIME), e.get("PYTHONPATH", "")])
    return e


def _launch(h: Any, name: str, tmp: Path, out: Path, *launcher: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", *launcher, str(TRAIN), "--out", str(out),
           "--n", str(N), "--batch", str(BATCH), "--epochs", str(EPOCHS), "--sleep", "0.2"]
    log = open(tmp / f"launcher-{name}.log", "w")
    return h.popen(cmd, env=_env(tmp / f"home-{name}", name), stdout=log, stderr=subprocess.STDOUT, text=True)


def _records(out: Path) -> list[dict[str, Any]]:
    recs = []
    for f in out.glob("steps-*.jsonl"):
        for line in f.read_text().splitlines():
            if line.endswith("}"):
                recs.append(json.loads(line))
    return recs


def _wait(what: str, cond: Callable[[list[dict[str, Any]]], bool], out: Path, procs: list[subprocess.Popen[str]],
          tmp: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond(_records(out)):
        dead = [p.args for p in procs if p.poll() not in (None,)]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(tmp.glob("launcher-*.log")))
            raise AssertionError(f"waiting for {what}: {'exited: ' + str(dead) if dead else 'timeout'}\n{logs}")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_join_from_other_hosts_then_leave_keeps_exactly_once_and_equal_parameters(hosts: Any, tmp_path: Path) -> None:
    hs = hosts(3)
    out = tmp_path / "out"
    out.mkdir()
    a = _launch(hs[0], "A", tmp_path, out, "--workers", "2", "--job", "mh", "--bind", "0.0.0.0",
                "--port", str(PORT), "--timeout", "200")
    procs = [a]
    _wait("two workers on A", lambda rs: sum(r["world"] == 2 for r in rs) >= 6, out, procs, tmp_path)
    join = f"{hs[0].addr}:{PORT}"
    b = _launch(hs[1], "B", tmp_path, out, "--join", join, "--workers", "2")
    procs.append(b)
    _wait("four workers on A and B", lambda rs: any(r["world"] == 4 for r in rs), out, procs, tmp_path)
    c = _launch(hs[2], "C", tmp_path, out, "--join", join, "--workers", "1")
    procs.append(c)
    _wait("five workers", lambda rs: any(r["world"] == 5 for r in rs), out, procs, tmp_path)
    c.send_signal(signal.SIGINT)  # Ctrl-C on C: its worker leaves at the next agreed switch
    assert c.wait(timeout=60) == 0, (tmp_path / "launcher-C.log").read_text()
    last5 = max(r["step"] for r in _records(out) if r["world"] == 5)
    _wait("back to four", lambda rs: any(r["world"] == 4 and r["step"] > last5 for r in rs), out, [a, b], tmp_path)
    # tidal scale names a host: B's two workers leave in one change, and B's launcher ends with them
    sc = hs[2].run([sys.executable, "-m", "tidal.runtime.launch", "scale", f"http://{join}", "--remove-host", "B"],
                   timeout=90, env=_env(tmp_path / "home-C", "C"), capture_output=True, text=True)
    assert sc.returncode == 0, sc.stdout + sc.stderr
    assert b.wait(timeout=60) == 0, (tmp_path / "launcher-B.log").read_text()
    (out / "fast").touch()
    assert a.wait(timeout=120) == 0, (tmp_path / "launcher-A.log").read_text()

    steps = read_steps(out)
    check_exactly_once(steps, N, BATCH, EPOCHS)
    worlds = [r["world"] for r in sorted(_records(out), key=lambda r: r["step"])]
    assert {2, 4, 5} <= set(worlds) and worlds[-1] == 2
    finals = sorted(out.glob("final-*.pt"))
    assert [f.name for f in finals] == ["final-w0.pt", "final-w1.pt"]  # A's two; B's and C's left
    ref = reference_run(n=N, batch=BATCH, epochs=EPOCHS)
    for f in finals:
        assert max_rel_diff(torch.load(f), ref) <= TOL, f.name


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_hosts_workers_migrate_to_another_host_in_one_switch(hosts: Any, tmp_path: Path) -> None:
    """A runs 2 workers, B joins 2; then ``tidal run --join A:PORT
    --replace-host B`` on C: C's two workers warm up while the job trains,
    and one switch replaces B's (EDL §5.2): the job never runs with B's and
    C's workers together, nor without either. A's workers, which stay, hold
    the state the newcomers receive."""
    hs = hosts(3)
    out = tmp_path / "out"
    out.mkdir()
    a = _launch(hs[0], "A", tmp_path, out, "--workers", "2", "--job", "mig", "--bind", "0.0.0.0",
                "--port", str(PORT), "--timeout", "180")
    join = f"{hs[0].addr}:{PORT}"
    _wait("two workers on A", lambda rs: sum(r["world"] == 2 for r in rs) >= 6, out, [a], tmp_path)
    b = _launch(hs[1], "B", tmp_path, out, "--join", join, "--workers", "2")
    _wait("four workers", lambda rs: sum(r["world"] == 4 for r in rs) >= 8, out, [a, b], tmp_path)
    b_ids = {w for w in read_steps(out) if w not in ("w0", "w1")}
    c = _launch(hs[2], "C", tmp_path, out, "--join", join, "--workers", "2", "--replace-host", "B")
    _wait("C's workers to train", lambda rs: len({r["gen"] for r in rs if r["world"] == 4}) >= 2, out, [a, c],
          tmp_path)
    assert b.wait(timeout=60) == 0, (tmp_path / "launcher-B.log").read_text()  # B's workers left at the switch
    (out / "fast").touch()
    assert c.wait(timeout=120) == 0, (tmp_path / "launcher-C.log").read_text()
    assert a.wait(timeout=60) == 0, (tmp_path / "launcher-A.log").read_text()

    steps = read_steps(out)
    check_exactly_once(steps, N, BATCH, EPOCHS)
    c_ids = set(steps) - b_ids - {"w0", "w1"}
    assert len(b_ids) == len(c_ids) == 2, sorted(steps)
    last_b = max(r["step"] for w in b_ids for r in steps[w])
    first_c = min(r["step"] for w in c_ids for r in steps[w])
    assert first_c == last_b + 1  # one switch: B's last step, then C's first
    assert {r["world"] for r in steps["w0"] if r["step"] >= min(r["step"] for w in b_ids for r in steps[w])} == {4}
    finals = sorted(f.name for f in out.glob("final-*.pt"))
    assert finals == sorted(f"final-{w}.pt" for w in ("w0", "w1", *c_ids))
    ref = reference_run(n=N, batch=BATCH, epochs=EPOCHS)
    for f in finals:
        assert max_rel_diff(torch.load(out / f), ref) <= TOL, f


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_node_local_checkpoint_directory_keeps_a_job_on_one_host(hosts: Any, tmp_path: Path) -> None:
    """A checkpoints to a directory on this machine's ext4/overlay (node-local
    as far as Tidal can tell); B's worker is refused at registration with
    the reason, B's launcher fails, and A's job goes on and finishes."""
    hs = hosts(2)
    out = tmp_path / "out"
    out.mkdir()
    ckpt = {"TIDAL_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "TIDAL_CHECKPOINT_EVERY": "20"}

    def launch(h: Any, name: str, *launcher: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", *launcher, str(TRAIN), "--out", str(out),
               "--n", str(N), "--batch", str(BATCH), "--epochs", "6", "--sleep", "0.2"]
        log = open(tmp_path / f"launcher-{name}.log", "w")
        return h.popen(cmd, env={**_env(tmp_path / f"home-{name}", name), **ckpt}, stdout=log,
                       stderr=subprocess.STDOUT, text=True)

    a = launch(hs[0], "A", "--workers", "1", "--job", "ck", "--bind", "0.0.0.0", "--port", str(PORT),
               "--timeout", "120")
    _wait("A training", lambda rs: len(rs) >= 3, out, [a], tmp_path)
    b = launch(hs[1], "B", "--join", f"{hs[0].addr}:{PORT}", "--workers", "1")
    assert b.wait(timeout=90) == 1
    text = (tmp_path / "launcher-B.log").read_text()
    assert "node-local" in text and "TIDAL_CHECKPOINT_SHARED" in text, text
    (out / "fast").touch()
    assert a.wait(timeout=90) == 0, (tmp_path / "launcher-A.log").read_text()
    steps = {w: rs for w, rs in read_steps(out).items() if rs}  # B's worker opened its log, then was refused
    assert list(steps) == ["w0"] and {r["world"] for r in steps["w0"]} == {1}
    check_exactly_once(steps, N, BATCH, 6)
