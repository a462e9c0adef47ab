"""The elastic runtime's gradient reducer against DDP's, in the same two
processes: how much of ``runtime_rescale.py``'s CPU overhead is the
reduction itself.

``runtime_rescale.py`` compares rank 0 of a ``tidal run`` job with rank 0 of
a torchrun job: two sets of processes, whose CPU per step differs run to run
by a point or two for reasons of their own (which core, which neighbour, the
transport threads' wake-ups). Here the two ranks hold two copies of the same
model (the same 3-layer MLP, global batch 256): one wrapped in
``DistributedDataParallel``, the other with tidal's
:class:`~tidal.runtime.reducer.GradReducer` hooks (armed each step with the
rank's weight, as the runtime arms it), over one process group. Phases of
``--phase-steps`` steps alternate between the two (ABBA, after one warm-up
phase each), and each phase's CPU per step is read for the process and for
each of its threads (``/proc/self/task/*/schedstat``).

Prints one JSON line: ``cpu_overhead_pct`` (the median over the phase pairs
of tidal's CPU per step over DDP's, minus 1, in %, for rank 0's process),
``cpu_overhead_pct_ci90`` (a bootstrap interval of that median), both
variants' CPU per step, and ``per_thread_ms_delta`` (tidal minus DDP per
thread name, ms per step, medians over the pairs).

    python benchmarks/reducer_ab.py                 # 21 pairs of 40 steps
    python benchmarks/reducer_ab.py --pairs 41

On a machine with two or more GPUs the ranks use ``cuda:0`` and ``cuda:1``
and NCCL (not run here: this host has no GPU); otherwise the CPU and gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from runtime_rescale import BATCH, CLASSES, DIM, build, median_interval, per_thread_ns


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sample() -> dict[str, int]:
    return {**per_thread_ns(), "process": time.process_time_ns()}


def _models(device: Any) -> dict[str, tuple[Any, Any, Any]]:
    import torch

    from tidal.runtime.reducer import GradReducer

    _, m_ddp, o_ddp = build()
    _, m_tidal, o_tidal = build()
    m_ddp.to(device)
    m_tidal.to(device)
    ids = [device.index] if device.type == "cuda" else None
    return {"ddp": (torch.nn.parallel.DistributedDataParallel(m_ddp, device_ids=ids), o_ddp, None),
            "tidal": (m_tidal, o_tidal, GradReducer(list(m_tidal.parameters())))}


def role_rank(a: argparse.Namespace) -> None:
    """One rank: warm-up phases, then ``a.pairs`` ABBA pairs; rank 0 prints
    the JSON line."""
    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    device = torch.device(f"cuda:{a.rank}") if gpu else torch.device("cpu")
    store = dist.TCPStore("127.0.0.1", a.port, 2, is_master=a.rank == 0)
    dist.init_process_group("nccl" if gpu else "gloo", store=store, rank=a.rank, world_size=2)
    models = _models(device)
    g = torch.Generator().manual_seed(a.rank)
    local = BATCH // 2
    xs, ys = torch.randn(4096, DIM, generator=g).to(device), torch.randint(0, CLASSES, (4096,), generator=g).to(device)
    step = 0

    def phase(kind: str) -> dict[str, float]:
        nonlocal step
        model, opt, reducer = models[kind]
        dist.barrier()
        before = _sample()
        for _ in range(a.phase_steps):
            lo = (step * local) % (4096 - local)
            step += 1
            if reducer is not None:
                reducer.arm(0.5, True)  # this rank's share of the global batch, as the runtime arms it
            torch.nn.functional.cross_entropy(model(xs[lo:lo + local]), ys[lo:lo + local]).backward()
            opt.step()
            opt.zero_grad()
            if reducer is not None:
                reducer.closed()
                reducer.disarm()
        if gpu:
            torch.cuda.synchronize(device)
        after = _sample()
        return {k: (v - before.get(k, 0)) / a.phase_steps / 1e6 for k, v in after.items()}

    phase("ddp")
    phase("tidal")
    rows: dict[str, list[dict[str, float]]] = {"ddp": [], "tidal": []}
    for k in range(a.pairs):
        for kind in (("tidal", "ddp") if k % 2 == 0 else ("ddp", "tidal")):
            rows[kind].append(phase(kind))
    dist.barrier()
    dist.destroy_process_group()
    if a.rank == 0:
        print(json.dumps(_report(rows, a, "nccl" if gpu else "gloo")))


def _report(rows: dict[str, list[dict[str, float]]], a: argparse.Namespace, backend: str) -> dict[str, Any]:
    t, d = rows["tidal"], rows["ddp"]
    pct = [100.0 * (x["process"] / y["process"] - 1.0) for x, y in zip(t, d)]
    names = sorted(set().union(*t, *d) - {"process"})
    delta = {n: round(statistics.median(x.get(n, 0.0) - y.get(n, 0.0) for x, y in zip(t, d)), 3) for n in names}
    return {
        "benchmark": "reducer_ab",
        "cpu_overhead_pct": round(statistics.median(pct), 2),
        "cpu_overhead_pct_ci90": median_interval(pct),
        "cpu_overhead_pct_runs": [round(x, 2) for x in pct],
        "cpu_step_ms": round(statistics.median(x["process"] for x in t), 3),
        "ddp_cpu_step_ms": round(statistics.median(y["process"] for y in d), 3),
        "per_thread_ms_delta": delta,
        "config": {"pairs": a.pairs, "phase_steps": a.phase_steps, "backend": backend, "cores": os.cpu_count(),
                   "load_avg_1m": round(os.getloadavg()[0], 2)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=21, help="ABBA phase pairs measured")
    ap.add_argument("--phase-steps", type=int, default=40, help="steps per phase")
    ap.add_argument("--role", choices=["driver", "rank"], default="driver")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    if a.pairs < 1 or a.phase_steps < 2:
        ap.error("--pairs must be at least 1 and --phase-steps at least 2")
    if a.role == "rank":
        role_rank(a)
        return
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # as torchrun sets it
    args = [sys.executable, __file__, "--role", "rank", "--port", str(port), "--pairs", str(a.pairs),
            "--phase-steps", str(a.phase_steps)]
    ranks = [subprocess.Popen([*args, "--rank", str(r)], env=env, stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                              text=True) for r in (0, 1)]
    try:
        out, _ = ranks[0].communicate(timeout=1800)
        if ranks[1].wait(timeout=60) != 0 or ranks[0].returncode != 0:
            raise SystemExit(f"reducer_ab: a rank failed (exit codes {ranks[0].returncode}, {ranks[1].returncode})")
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    print(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
