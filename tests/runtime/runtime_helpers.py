"""Shared helpers for the runtime tests (not collected by pytest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tidal.runtime.client import MasterClient

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "elastic_train.py"
REPO = HERE.parent.parent


def env(tidal_home: Path) -> dict[str, str]:
    e = dict(os.environ)
    e.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TIDAL_HOME=str(tidal_home), PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(HERE), e.get("PYTHONPATH", "")])
    return e


def launch(job: str, workers: int, out: Path, home: Path, *script_args: str, timeout: float = 150,
           extra_env: dict[str, str] | None = None, launcher_args: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", str(workers), "--job", job,
           "--timeout", str(timeout), *launcher_args, str(TRAIN), "--out", str(out), *script_args]
    return subprocess.Popen(cmd, env=dict(env(home), **(extra_env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def master_url(job: str, home: Path, proc: subprocess.Popen[str], timeout: float = 30) -> str:
    f = home / "jobs" / f"{job}.json"
    deadline = time.monotonic() + timeout
    while not f.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"launcher did not start: {proc.stdout.read() if proc.stdout else ''}")
        time.sleep(0.05)
    return json.loads(f.read_text())["url"]


def read_steps(out: Path) -> dict[str, list[dict[str, Any]]]:
    return {p.stem[len("steps-"):]: [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
            for p in sorted(out.glob("steps-*.jsonl"))}


def check_exactly_once(steps: dict[str, list[dict[str, Any]]], n: int, batch: int | None, epochs: int) -> int:
    """Every index of every epoch used exactly once; every step's shares add up
    to the global batch. Returns the number of global steps seen."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for recs in steps.values():
        for r in recs:
            by_step.setdefault(r["step"], []).append(r)
    per_epoch: dict[int, list[int]] = {e: [] for e in range(epochs)}
    for s, recs in sorted(by_step.items()):
        worlds = {r["world"] for r in recs}
        assert len(worlds) == 1 and len(recs) == worlds.pop(), f"step {s}: inconsistent group {recs}"
        assert sorted(r["rank"] for r in recs) == list(range(len(recs))), f"step {s}: ranks {recs}"
        for r in recs:
            per_epoch[r["epoch"]].extend(r["idx"])
    for e, idx in per_epoch.items():
        assert len(idx) == n and sorted(idx) == list(range(n)), f"epoch {e}: {len(idx)} indices, {len(set(idx))} distinct"
    if batch is None:  # the global batch changed with the world size (weak/hybrid scaling)
        assert sorted(by_step) == list(range(len(by_step)))
    else:
        steps_per_epoch = -(-n // batch)
        assert sorted(by_step) == list(range(epochs * steps_per_epoch))
    return len(by_step)


def finish(proc: subprocess.Popen[str], timeout: float = 100) -> str:
    """Wait for a launched job; kill it if it overruns. Returns its output."""
    try:
        text, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return text


def grow_while_reading(script: Path, job: str, home: Path, before_grow: Callable[[MasterClient], None],
                       timeout: float = 170) -> tuple[subprocess.Popen[str], list[tuple[float, str]], float]:
    """``tidal run --workers 2 --max-workers 3`` of ``script``; once 2
    workers train and ``before_grow(client)`` returned, a third is added.
    Returns the ended process, its output lines with their arrival times
    (monotonic) and when the third worker had joined."""
    proc = subprocess.Popen([sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", "2", "--max-workers",
                             "3", "--job", job, "--timeout", str(timeout), str(script)], env=env(home),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), ln)) for ln in proc.stdout], daemon=True)
    reader.start()
    try:
        c = MasterClient(master_url(job, home, proc), patience_s=10)
        c.wait_for(2, timeout_s=60)
        before_grow(c)
        c.scale_out(1)
        c.wait_for(3, timeout_s=90)
        joined = time.monotonic()
        proc.wait(timeout=timeout - 10)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    return proc, lines, joined


def exit_quietly(worker: Callable[..., None], *args: Any) -> None:
    """Run ``worker(*args)`` in a spawned rank and leave with ``os._exit``:
    gloo's threads can outlive the interpreter and abort it at a normal exit
    (SIGABRT, "terminate called without an active exception", a few runs in a
    hundred on a busy machine), which would fail a rank that did everything
    right. The runtime's workers leave the same way (``worker._quiet_exit``)."""
    import traceback

    code = 0
    try:
        worker(*args)
    except BaseException:  # noqa: BLE001 - reported, and the exit code says so
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_quietly_at(index: int, worker: Callable[..., None], *args: Any) -> None:
    """:func:`exit_quietly` for ``torch.multiprocessing.start_processes``,
    which passes the process index first."""
    exit_quietly(worker, index, *args)


def run_ranks(worker: Callable[..., None], ranks: int = 2, timeout: float = 80) -> dict[Any, Any]:
    """``worker(rank, port, out)`` in ``ranks`` spawned processes (a gloo
    group on a free loopback port); what they put in the shared dict ``out``.
    Fails the test unless every process exits 0 within ``timeout``."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        out = mgr.dict()
        procs = [ctx.Process(target=exit_quietly, args=(worker, r, port, out)) for r in range(ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=timeout)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert codes == [0] * ranks, codes
        return dict(out)
