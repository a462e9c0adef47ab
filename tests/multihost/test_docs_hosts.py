"""The docs' several-host examples, run as written on hosts that are network
namespaces at the docs' own addresses (10.0.0.1, ...).

A block marked ``<!-- docs-test: hosts -->`` names its hosts in comments:
``# host A (10.0.0.1): ...``, ``# host B: ...``, ``# every GPU host: ...`` (two
hosts here), ``# anywhere that reaches the server``. Servers, agents and
``tidal run`` launchers start in the background in their hosts; a line that
names ``ADDR:PORT`` starts once that port answers. What the harness adds, as
an operator would: ``--virtual-gpus 2`` on agents (no GPU here), the admin
token copied beside each host's shell as ``admin.token``, a shared
``$TIDAL_HOME`` (one file system, declared shared storage for checkpoints, as
docs/control.md asks of jobs that span hosts), the docs' job spec as ``job.yaml`` and
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
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tidal import settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
from docblocks import REPO, Block, blocks, split_commands  # noqa: E402

HOST = re.compile(r"\bhost (\w+)(?: \(?(\d+\.\d+\.\d+\.\d+)\)?)?")
BACKGROUND = ("tidal server", "tidal agent", "tidal run")
TARGET = re.compile(r"(?:https?://)?(\d+\.\d+\.\d+\.\d+):(\d+)")


DB_URL = re.compile(r"postgresql\+psycopg://(\w+)@(\d+\.\d+\.\d+\.\d+)/(\w+)")


def _hosts_of(context: str) -> list[str]:
    """The host keys a comment names: `host A (ADDR)` (one or several),
    `every GPU host` (two here), else anywhere ("client")."""
    named = [m.group(1) for m in HOST.finditer(context)]
    if named:
        return named
    if "every GPU host" in context:
        return ["gpu1", "gpu2"]
    return ["client"]


def _plan(block: Block) -> list[tuple[str, str]]:
    """(host key, command) per simple command, in order; a line for several
    hosts runs on each; `export` lines stay with their hosts' later lines."""
    out, exports = [], {}
    for line, context in block.commands():
        for key in _hosts_of(context):
            for cmd in split_commands(line):
                if cmd.startswith("export "):
                    exports[key] = exports.get(key, "") + cmd + "; "
                    continue
                out.append((key, exports.get(key, "") + (cmd.replace("gpu-a", "gpu-b") if key == "gpu2" else cmd)))
    return out


def _addresses(block: Block, keys: list[str]) -> dict[str, int]:
    """Host key -> index into the namespaces (10.0.0.(i+1)); the docs' own
    addresses kept, and a database the commands name gets its own host."""
    fixed = {}
    for line, context in block.commands():
        for m in HOST.finditer(context):
            if m.group(2):
                assert m.group(2).startswith("10.0.0."), f"{block.where}: use 10.0.0.x addresses in the docs"
                fixed[m.group(1)] = int(m.group(2).rsplit(".", 1)[1]) - 1
        for m in DB_URL.finditer(line):
            fixed["db"] = int(m.group(2).rsplit(".", 1)[1]) - 1
    keys = [*keys, *(["db"] if "db" in fixed and "db" not in keys else [])]
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
    env[settings.CHECKPOINT_SHARED.name] = "1"  # the hosts share one file system: checkpoints are shared storage
    return work, env


def _bare(cmd: str) -> str:
    """The command without the `export ...; ` lines carried before it."""
    return cmd.rsplit("; ", 1)[-1] if cmd.startswith("export ") else cmd


def _adapt(cmd: str) -> str:
    """What the harness adds to a command (module docstring)."""
    if _bare(cmd).startswith("tidal agent") and "--virtual-gpus" not in cmd:
        cmd += " --virtual-gpus 2 --interval 0.3"
    return cmd


def _pg_bin(name: str) -> str | None:
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True)
    return str(found[0]) if found else shutil.which(name)


def _postgres(h: Any, role: str, db: str, tmp: Path) -> None:
    """A PostgreSQL server on host ``h`` (its address, port 5432) with ``role``
    owning database ``db``, reachable from the other hosts without a password."""
    initdb, pg_ctl, psql = _pg_bin("initdb"), _pg_bin("pg_ctl"), _pg_bin("psql")
    if not (initdb and pg_ctl and psql):
        pytest.skip("PostgreSQL server binaries not installed (apt-get install postgresql)")
    d = Path(tempfile.mkdtemp(prefix="tidal-docs-pg-"))  # outside pytest's tmp: the postgres user reaches it
    (tmp / "pg-dir").write_text(str(d))  # stopped and removed by _drop_postgres
    shutil.chown(d, "postgres", "postgres")
    as_pg = ["runuser", "-u", "postgres", "--"]
    subprocess.run([*as_pg, initdb, "-D", str(d / "data"), "-A", "trust", "-U", "postgres"], check=True,
                   capture_output=True, timeout=120)
    with open(d / "data" / "pg_hba.conf", "a") as f:
        f.write("host all all 10.0.0.0/24 trust\n")
    res = h.run([*as_pg, pg_ctl, "-D", str(d / "data"), "-w", "-l", str(d / "log"), "-o",
                 f"-p 5432 -k {d} -c listen_addresses={h.addr}", "start"], timeout=60, capture_output=True)
    assert res.returncode == 0, res.stderr
    res = h.run([psql, "-h", h.addr, "-U", "postgres", "-c", f"CREATE ROLE {role} LOGIN", "-c",
                 f"CREATE DATABASE {db} OWNER {role}"], timeout=30, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def _wait_job(h: Any, job_id: str, env: dict[str, str], work: Path, timeout_s: float = 480.0) -> None:
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


def _drop_postgres(tmp: Path) -> None:
    """Stop and delete the database server ``_postgres`` made, if any."""
    marker = tmp / "pg-dir"
    if not marker.exists():
        return
    d, pg_ctl = Path(marker.read_text()), _pg_bin("pg_ctl")
    if pg_ctl and (d / "data" / "postmaster.pid").exists():
        subprocess.run(["runuser", "-u", "postgres", "--", pg_ctl, "-D", str(d / "data"), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
    shutil.rmtree(d, ignore_errors=True)


class _Run:
    """One block's processes and logs on its hosts; ``close`` stops them all."""

    def __init__(self, block: Block, hs: Any, index: dict[str, int], work: Path, env: dict[str, str],
                 tmp: Path) -> None:
        self.block, self.hs, self.index, self.work, self.env, self.tmp = block, hs, index, work, env, tmp
        self.logs: list[Any] = []
        self.background: list[tuple[str, subprocess.Popen[Any]]] = []
        self.submitted: list[tuple[str, str, dict[str, str]]] = []

    def step(self, key: str, cmd: str) -> None:
        """Run one command on its host: servers, agents and launchers in the
        background, the rest to completion (exit 0)."""
        h, cmd = self.hs[self.index[key]], _adapt(cmd)
        for addr, port in TARGET.findall(_bare(cmd)):  # what the command itself talks to
            _wait_port(h, addr, port, self.env)
        token = Path(self.env["TIDAL_HOME"]) / "admin.token"
        if token.exists() and not (self.work / "admin.token").exists():
            shutil.copy(token, self.work / "admin.token")  # as an operator copies it to the hosts
        log = open(self.tmp / f"{len(self.logs)}-{key}.log", "w")
        self.logs.append(log)
        if _bare(cmd).startswith(BACKGROUND):
            self.background.append((cmd, h.popen(["bash", "-c", cmd], env=self.env, cwd=self.work, stdout=log,
                                                 stderr=subprocess.STDOUT, start_new_session=True)))
            if _bare(cmd).startswith("tidal server"):
                port = re.search(r"--port (\d+)", cmd)
                _wait_port(h, h.addr, port.group(1) if port else "8470", self.env)
                time.sleep(1)
            return
        res = h.run(["bash", "-c", cmd], timeout=120, env=self.env, cwd=self.work, capture_output=True, text=True)
        assert res.returncode == 0, f"{self.block.where}: {cmd}\n{res.stdout}\n{res.stderr}"
        prefix = dict(re.findall(r"(?:^|\s)([A-Z_]+)=(\S+)(?=\s+tidal\b)", cmd))  # VAR=... tidal submit
        self.submitted += [(job_id, key, {**self.env, **prefix})
                           for job_id in re.findall(r"^submitted (\S+)", res.stdout, re.M)]

    def check(self) -> None:
        """Every service still up, every submitted job completed, every launcher exited 0."""
        dead = [cmd for cmd, p in self.background if not _bare(cmd).startswith("tidal run") and p.poll() is not None]
        assert dead == [], f"{self.block.where}: exited early: {dead}"
        for job_id, key, job_env in self.submitted:  # asked from where it was submitted, as it was
            _wait_job(self.hs[self.index[key]], job_id, job_env, self.work)
        for cmd, p in self.background:
            if _bare(cmd).startswith("tidal run"):
                assert p.wait(timeout=300) == 0, f"{self.block.where}: {cmd} exited {p.returncode}"

    def close(self) -> None:
        for _, p in self.background:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for _, p in self.background:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in self.logs:
            log.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", [b for b in blocks() if b.kind == "hosts"], ids=lambda b: b.where)
def test_the_several_host_examples_work_as_written(block: Block, hosts: Any, tmp_path: Path) -> None:
    plan = _plan(block)
    index = _addresses(block, list(dict.fromkeys(k for k, _ in plan)))
    hs = hosts(max(index.values()) + 1, subnet="10.0.0")
    work, env = _setup(tmp_path, block)
    run = _Run(block, hs, index, work, env, tmp_path)
    try:
        db = next((m.groups() for line, _ in block.commands() for m in DB_URL.finditer(line)), None)
        if db:
            _postgres(hs[index["db"]], db[0], db[2], tmp_path)
        for key, cmd in plan:
            run.step(key, cmd)
        run.check()
    finally:
        run.close()
        _drop_postgres(tmp_path)
