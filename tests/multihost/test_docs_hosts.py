"""The docs' several-host examples, run as written on hosts that are network
namespaces at the docs' own addresses (10.0.0.1, ...).

A block marked ``<!-- docs-test: hosts -->`` names its hosts in comments:
``# host A (10.0.0.1): ...``, ``# host B: ...``, ``# every GPU host: ...`` (two
hosts here), ``# anywhere that reaches the server``. Servers, agents and
``tidal run`` launchers start in the background in their hosts; a line that
names ``ADDR:PORT`` starts once that port answers. What the harness adds, as
an operator would: ``--virtual-gpus 2`` on agents (no GPU here), the admin
token copied beside each host's shell as ``admin.token``, a shared
``$TIDAL_HOME`` (one file system), the docs' job spec as ``job.yaml`` and
``examples/cnn.py`` as ``train.py``. The block passes when every launcher
exits 0 and a submitted job completes.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
from docblocks import REPO, Block, blocks, split_commands  # noqa: E402

HOST = re.compile(r"^#\s*host (\w+)(?: \(([\d.]+)\))?")
BACKGROUND = ("tidal server", "tidal agent", "tidal run")
TARGET = re.compile(r"(?:https?://)?(\d+\.\d+\.\d+\.\d+):(\d+)")


def _host_of(context: str) -> str:
    m = HOST.match(context)
    if m:
        return m.group(1)
    if "every GPU host" in context:
        return "gpu"
    return "client"  # "anywhere that reaches the server"


def _plan(block: Block) -> list[tuple[str, str]]:
    """(host key, command) per simple command; "every GPU host" is two hosts."""
    out = []
    for line, context in block.commands():
        key = _host_of(context)
        for cmd in split_commands(line):
            if key == "gpu":
                out += [("gpu1", cmd), ("gpu2", cmd.replace("gpu-a", "gpu-b"))]
            else:
                out.append((key, cmd))
    return out


def _addresses(block: Block, keys: list[str]) -> dict[str, int]:
    """Host key -> index into the namespaces (10.0.0.(i+1)); the docs' own addresses kept."""
    fixed = {}
    for _, context in block.commands():
        m = HOST.match(context)
        if m and m.group(2):
            assert m.group(2).startswith("10.0.0."), f"{block.where}: use 10.0.0.x addresses in the docs"
            fixed[m.group(1)] = int(m.group(2).rsplit(".", 1)[1]) - 1
    free = (i for i in range(len(keys) + len(fixed)) if i not in fixed.values())
    return {k: fixed[k] if k in fixed else next(free) for k in keys}


def _wait_port(h: Any, addr: str, port: str, env: dict[str, str], timeout_s: float = 90.0) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        if h.run(["bash", "-c", f"exec 3<>/dev/tcp/{addr}/{port}"], timeout=10, env=env).returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"{addr}:{port} did not answer from {h.name}")


def _setup(tmp_path: Path, block: Block) -> tuple[Path, dict[str, str]]:
    work, home, bin_dir = tmp_path / "work", tmp_path / "home", tmp_path / "bin"
    for d in (work, home, bin_dir):
        d.mkdir()
    shutil.copytree(REPO / "examples", work / "examples")
    # the docs' train.py: the CNN example with 4x its default data, so a job lives long
    # enough (about a minute on two workers here) for another host's workers to join it
    cnn = (REPO / "examples" / "cnn.py").read_text()
    assert '"--samples", type=int, default=4096' in cnn
    (work / "train.py").write_text(cnn.replace('"--samples", type=int, default=4096',
                                               '"--samples", type=int, default=16384'))
    spec = re.search(r"```yaml\n(.*?)```", block.file.read_text(), re.S)
    if spec:
        (work / "job.yaml").write_text(spec.group(1))
    (bin_dir / "tidal").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tidal "$@"\n')
    (bin_dir / "tidal").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    env.update(TIDAL_HOME=str(home), PATH=f"{bin_dir}:{env.get('PATH', '')}", COLUMNS="120")
    return work, env


def _adapt(cmd: str) -> str:
    """What the harness adds to a command (module docstring)."""
    if cmd.startswith("tidal agent") and "--virtual-gpus" not in cmd:
        cmd += " --virtual-gpus 2 --interval 0.3"
    return cmd


def _wait_job(h: Any, job_id: str, env: dict[str, str], work: Path, timeout_s: float = 300.0) -> None:
    end, state = time.time() + timeout_s, ""
    while time.time() < end:
        res = h.run(["tidal", "job", job_id, "-o", "json"], timeout=30, env=env, cwd=work,
                    capture_output=True, text=True)
        assert res.returncode == 0 or "cannot reach" not in res.stderr, res.stderr
        m = re.search(r'"state":\s*"(\w+)"', res.stdout)
        state = m.group(1) if m else state
        if state in ("completed", "failed", "cancelled"):
            break
        time.sleep(2)
    assert state == "completed", f"job {job_id} ended {state or 'nowhere'}"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", [b for b in blocks() if b.kind == "hosts"], ids=lambda b: b.where)
def test_the_several_host_examples_work_as_written(block: Block, hosts: Any, tmp_path: Path) -> None:
    plan = _plan(block)
    keys = list(dict.fromkeys(k for k, _ in plan))
    index = _addresses(block, keys)
    hs = hosts(max(index.values()) + 1, subnet="10.0.0")
    work, env = _setup(tmp_path, block)
    logs, background, submitted = [], [], []
    for key, cmd in plan:
        h = hs[index[key]]
        cmd = _adapt(cmd)
        for addr, port in TARGET.findall(cmd):
            _wait_port(h, addr, port, env)
        token = Path(env["TIDAL_HOME"]) / "admin.token"
        if token.exists():
            shutil.copy(token, work / "admin.token")
        log = open(tmp_path / f"{len(logs)}-{key}.log", "w")
        logs.append(log)
        if cmd.startswith(BACKGROUND):
            background.append((cmd, h.popen(["bash", "-c", cmd], env=env, cwd=work, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)))
            if cmd.startswith("tidal server"):
                _wait_port(h, h.addr, re.search(r"--port (\d+)", cmd).group(1), env)
                time.sleep(1)
            continue
        res = h.run(["bash", "-c", cmd], timeout=120, env=env, cwd=work, capture_output=True, text=True)
        assert res.returncode == 0, f"{block.where}: {cmd}\n{res.stdout}\n{res.stderr}"
        ids = re.findall(r"^submitted (\S+)", res.stdout, re.M)
        prefix = dict(re.findall(r"(?:^|\s)([A-Z_]+)=(\S+)(?=\s+tidal\b)", cmd))  # VAR=... tidal submit
        submitted += [(job_id, key, {**env, **prefix}) for job_id in ids]
    try:
        for job_id, key, job_env in submitted:  # asked from where it was submitted, as it was
            _wait_job(hs[index[key]], job_id, job_env, work)
        for cmd, p in background:
            if cmd.startswith("tidal run"):
                assert p.wait(timeout=300) == 0, f"{block.where}: {cmd} exited {p.returncode}"
    finally:
        for _, p in background:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for _, p in background:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        for log in logs:
            log.close()
