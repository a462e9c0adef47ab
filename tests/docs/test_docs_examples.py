"""Every command in README.md and docs/*.md is run, or checked, by a test.

Blocks are run from a scratch directory outside the checkout, with their own
``$TIDAL_HOME``, exactly as written (``ID`` stands for the job the block
submitted last). How each block is tested is written above it in the docs
(tests/docs/docblocks.py); a block without a marker fails here, so a new
example cannot go untested.
"""

from __future__ import annotations

import functools

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from docblocks import REPO, Block, blocks, inline_commands, split_commands

KINDS = {"run", "cluster", "hosts", "ci"}  # hosts: tests/multihost/test_docs_hosts.py


def _by_kind(kind: str) -> list[Block]:
    return [b for b in blocks() if b.kind == kind]


def test_every_block_says_how_it_is_tested():
    bad = [f"{b.where}: marker {b.kind!r}" for b in blocks() if b.kind not in KINDS]
    assert bad == [], "add <!-- docs-test: run|cluster|hosts|ci --> above:\n" + "\n".join(bad)


# -- parse-level: every command names a real command, options and files -------------


@functools.lru_cache(maxsize=1)
def _tidal_group():
    """The CLI's click group (built once: typer builds it anew per call)."""
    from typer.main import get_command

    from tidal.cli.main import app

    return get_command(app)


def _tidal_problem(argv: list[str]) -> str | None:
    """Why ``tidal ARGV`` would not parse (None: it does)."""
    group = _tidal_group()
    if not argv or argv[0] not in group.commands:  # type: ignore[attr-defined]
        return f"no command {argv[:1]}"
    sub = group.commands[argv[0]]  # type: ignore[attr-defined]
    try:
        sub.make_context(argv[0], list(argv[1:]))
    except Exception as e:  # noqa: BLE001 - typer's own copy of click's exceptions
        kinds = {k.__name__ for k in type(e).__mro__}
        if "NoSuchOption" in kinds:
            return e.format_message()  # type: ignore[attr-defined]
        if "UsageError" not in kinds:
            raise
        # else: a placeholder (ID, N, DIR) where a value goes, or a value left out in prose
    return None


def _python_problem(argv: list[str]) -> str | None:
    """Why ``python ARGV`` names a missing file, module or option."""
    if argv[:1] == ["-m"]:
        mod = argv[1] if len(argv) > 1 else ""
        if mod == "pytest":
            missing = [a for a in argv[2:] if a.startswith("tests") and not (REPO / a.split("::")[0]).exists()]
            return f"no such test path {missing}" if missing else None
        import importlib.util

        return None if importlib.util.find_spec(mod) else f"no module {mod}"
    path = REPO / argv[0]
    if argv[0].startswith(("benchmarks/", "examples/", "tests/")):
        if not path.exists():
            return f"no file {argv[0]}"
        src = path.read_text()
        missing = [a for a in argv[1:] if a.startswith("--") and f'"{a}"' not in src]
        return f"{argv[0]} has no option {missing}" if missing else None
    return None  # a user's own script.py


def command_problem(cmd: str) -> str | None:
    """Parse one simple command of the docs (placeholders allowed)."""
    cmd = re.sub(r"\[([^\]]*)\]", r"\1", cmd)  # `tidal logs ID [-f]`
    cmd = re.sub(r"(\S+)\|\S+", r"\1", cmd)  # `--replication topology|single`: the first choice
    try:
        argv = shlex.split(cmd)
    except ValueError as e:
        return f"unparsable: {e}"
    while argv and re.match(r"^[A-Z_]+=", argv[0]):
        argv = argv[1:]
    if not argv:
        return None
    if argv[0] == "tidal":
        return _tidal_problem(argv[1:])
    if argv[0] in ("python", "python3"):
        return _python_problem(argv[1:])
    return None  # pip, kubectl, export, ...: run by their own blocks, or not runnable here


def test_every_command_in_the_docs_parses():
    bad = []
    for b in blocks():
        for line, _ in b.commands():
            for cmd in split_commands(line):
                why = command_problem(cmd)
                if why:
                    bad.append(f"{b.where}: {cmd}: {why}")
    for where, cmd in inline_commands():
        for one in split_commands(cmd):
            why = command_problem(one)
            if why:
                bad.append(f"{where}: `{one}`: {why}")
    assert bad == [], "\n".join(bad)


# -- ci ---------------------------------------------------------------------


def test_ci_blocks_are_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    blocks_ = _by_kind("ci")
    assert len(blocks_) >= 3, "the README's set-up, test and slow-test lines are ci blocks"
    bad = [f"{b.where}: {line}" for b in blocks_ for line, _ in b.commands() if line not in ci]
    assert bad == [], ".ci/run does not run:\n" + "\n".join(bad)


# -- run: from a directory outside the checkout ---------------------------------------


@pytest.fixture
def scratch(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A directory outside the checkout, with examples/ beside it as a user
    who cloned the repository has them, and a fresh TIDAL_HOME."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(REPO / "examples", work / "examples")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    bin_dir = tmp_path / "bin"  # `tidal` is this interpreter's, whatever PATH had
    bin_dir.mkdir()
    (bin_dir / "tidal").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tidal "$@"\n')
    (bin_dir / "tidal").chmod(0o755)
    env.update(TIDAL_HOME=str(tmp_path / "home"), COLUMNS="120", PATH=f"{bin_dir}:{env.get('PATH', '')}")
    return work, env


def _run_params() -> list:
    """`run` blocks; `<!-- docs-test: run slow -->` ones only with -m slow."""
    return [pytest.param(b, id=b.where, marks=[pytest.mark.slow] if b.arg == "slow" else [])
            for b in _by_kind("run")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", _run_params())
def test_run_blocks_work_from_outside_the_checkout(block: Block, scratch):
    work, env = scratch
    assert not str(work).startswith(str(REPO))
    for line, _ in block.commands():
        res = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"{block.where}: {line}\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
        assert "Traceback" not in res.stderr, res.stderr[-2000:]


# -- cluster: `tidal up` in the background, the other lines against it ---------------


def _yaml_example(block: Block) -> str:
    """The job spec shown in the same document (its first yaml block)."""
    text = block.file.read_text()
    m = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert m, f"{block.where}: the document shows no job spec (a ```yaml block)"
    return m.group(1)


def _wait_up(env: dict[str, str], proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    home = Path(env["TIDAL_HOME"])
    end = time.time() + timeout_s
    while time.time() < end:
        assert proc.poll() is None, f"`tidal up` exited with {proc.returncode}"
        if (home / "server.json").exists():
            res = subprocess.run([sys.executable, "-m", "tidal", "cluster", "-o", "json"], env=env, capture_output=True, text=True,
                                 timeout=30)
            if res.returncode == 0 and res.stdout.count('"up"') >= 2:
                return
        time.sleep(0.5)
    raise AssertionError("the cluster did not come up")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", _by_kind("cluster"), ids=lambda b: b.where)
def test_cluster_blocks_work_against_a_real_cluster(block: Block, scratch):
    work, env = scratch
    (work / "job.yaml").write_text(_yaml_example(block))
    cmds = [c for c, _ in block.commands()]
    assert cmds[0].startswith("tidal up"), f"{block.where}: a cluster block starts with `tidal up`"
    up = subprocess.Popen(["bash", "-c", f"exec {cmds[0]}"], cwd=work, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
    job_id = ""
    try:
        _wait_up(env, up)
        for line in cmds[1:]:
            for cmd in split_commands(line):
                cmd = re.sub(r"\bID\b", job_id, cmd)
                res = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True,
                                     timeout=600)
                assert res.returncode == 0, f"{block.where}: {cmd}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
                m = re.search(r"^submitted (\S+)", res.stdout, re.M)
                job_id = m.group(1) if m else job_id
    finally:
        os.killpg(up.pid, signal.SIGTERM)  # as `kill` stops it (Ctrl-C may be ignored in a background shell)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        _kill_processes_of(Path(env["TIDAL_HOME"]))
    assert up.returncode == 0, up.stdout.read()[-3000:] if up.stdout else ""


def _kill_processes_of(home: Path) -> None:
    """Kill what is left of a cluster whose `tidal up` did not stop it: every
    process started with this TIDAL_HOME (its server and agents have sessions
    of their own)."""
    mark = f"TIDAL_HOME={home}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if mark in (d / "environ").read_bytes().split(b"\0"):
                os.kill(int(d.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue

