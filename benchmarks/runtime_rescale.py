"""Benchmark of the elastic runtime: rescale pauses, steady-state
overhead and per-step coordination round trip, versus torchrun.

One file, several roles (same model and data everywhere: a 3-layer MLP,
1.3 M float32 parameters, global batch 256, on synthetic data):

* driver (default): runs every measurement below and prints a report, or one
  JSON object with ``--json``;
* ``--role elastic``: the training script under ``tidal run`` (tidal.runtime);
* ``--role ddp``: the same loop with plain ``DistributedDataParallel`` under
  torchrun (``python -m torch.distributed.run``), optionally loading and
  saving a checkpoint.

Pause definition, identical for both: on an existing worker, the wall time
from the end of the last step before the change to the start of the first step
after it (i.e. time in which no training happens). For torchrun the change is
stop-resume: the 2-worker run saves a checkpoint after its last step and
exits; a 4-worker torchrun starts, loads it and takes its first step. This is
torchrun's best case (checkpoint exactly at the stop, no lost progress).

Overhead: median step time (end to end of consecutive steps, after warm-up)
of the elastic runtime at 2 workers vs plain DDP at 2 workers, runs
alternated ``--repeats`` times and the medians of the per-run medians taken.

Coordination round trip: rank 0's asynchronous heartbeat to the master (one
HTTP request/answer on localhost), as seen by the worker, p50 and p99.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

DIM, HIDDEN, CLASSES, BATCH = 256, 1024, 10, 256


# ---------------------------------------------------------------------------- shared model/data
def build(seed: int = 0) -> tuple[Any, Any, Any]:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return torch, model, opt


class Synthetic:
    def __init__(self, n: int, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, DIM, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        return self.x[i], self.y[i]


class StepLog:
    """Per-step wall-clock start/end timestamps, one JSON line per step."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "w")

    def write(self, **rec: Any) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()


# ---------------------------------------------------------------------------- worker roles
def role_elastic(a: argparse.Namespace) -> None:
    import tidal.runtime

    job = tidal.runtime.init()
    torch, model, opt = build()
    job.register_state(model, opt)
    loader = job.data(Synthetic(a.steps * BATCH), batch_size=BATCH, epochs=1, seed=0)
    log = StepLog(Path(a.out) / f"elastic-{job.worker_id}.jsonl")
    for x, y in loader:
        t_start = time.time()  # the batch is in hand (after any switch the iterator performed)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        job.step()
        log.write(step=job.step_count, world=job.world_size, rank=job.rank, gen=job.gen.gen if job.gen else 0,
                  t_start=t_start, t_end=time.time())
    (Path(a.out) / f"elastic-summary-{job.worker_id}.json").write_text(json.dumps(job.summary()))
    job.close()


def role_ddp(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from torch.utils.data import default_collate

    from tidal.runtime.data import epoch_permutation, step_slice

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch, model, opt = build()
    start_step = 0
    if a.load:
        ck = torch.load(a.load, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_step = ck["step"]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    data = Synthetic(a.total_steps * BATCH)
    perm = epoch_permutation(len(data), 0, 0)
    log = StepLog(Path(a.out) / f"ddp-{a.tag}-{rank}.jsonl")
    for step in range(start_step, start_step + a.steps):
        sl = step_slice(step * BATCH, len(data), BATCH, rank, world)
        x, y = default_collate([data[i] for i in perm[sl.lo : sl.hi].tolist()])
        t_start = time.time()  # the batch is in hand
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        t_end = time.time()
        log.write(step=step + 1, world=world, rank=rank, t_start=t_start, t_end=t_end)
    if a.save and rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": start_step + a.steps}, a.save)
    del ddp  # drop the DDP wrapper before tearing the group down (gloo teardown pitfall)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- driver
def _env() -> dict[str, str]:
    e = dict(os.environ)
    e.setdefault("GLOO_SOCKET_IFNAME", "lo")
    e.setdefault("OMP_NUM_THREADS", "1")
    src = Path(__file__).resolve().parents[1] / "src"
    e["PYTHONPATH"] = os.pathsep.join([str(src), e.get("PYTHONPATH", "")])
    return e


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _median_step(recs: list[dict[str, Any]], warmup: int) -> float:
    ends = [r["t_end"] for r in recs]
    gaps = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :])]
    return statistics.median(gaps)


def _run_elastic(out: Path, workers: int, steps: int, schedule: list[int], quiet: bool = True) -> dict[str, Any]:
    """Run ``tidal run`` in-process; apply ``schedule`` (world sizes) once the
    job has run a few steps at each size. Returns the master's status."""
    os.environ.update(_env())
    from tidal.runtime.client import MasterClient
    from tidal.runtime.launch import run_job

    job = f"bench-{os.getpid()}-{len(list(out.iterdir()))}"
    res: dict[str, Any] = {}
    lines: list[str] = []
    t = threading.Thread(target=lambda: res.setdefault("rc", run_job(
        __file__, ["--role", "elastic", "--out", str(out), "--steps", str(steps)], workers, job=job,
        timeout_s=600, out=lines.append)), daemon=True)
    t.start()
    from tidal.runtime.launch import resolve_master

    while True:
        try:
            c = MasterClient(resolve_master(job))
            break
        except FileNotFoundError:
            time.sleep(0.05)
    c.wait_for(workers, timeout_s=120)
    for size in schedule:
        st = c.status()
        target = st.step + 15
        while c.status().step < target and c.status().state == "running":
            time.sleep(0.05)
        ans = c.scale_to(size, timeout_s=120)
        if not ans.accepted:
            raise RuntimeError(f"scale to {size}: {ans}")
        st = c.wait_for(size, timeout_s=120)
        if st.state == "finished":
            raise RuntimeError("job finished before the rescale; raise --steps")
    t.join(timeout=900)
    if not quiet:
        print("\n".join(lines), file=sys.stderr)
    if res.get("rc") != 0:
        raise RuntimeError("elastic run failed:\n" + "\n".join(lines))
    return {"lines": lines}


def _elastic_pause(out: Path, wid: str, from_size: int, to_size: int) -> float:
    recs = _read(out / f"elastic-{wid}.jsonl")
    for a, b in zip(recs, recs[1:]):
        if a["world"] == from_size and b["world"] == to_size:
            return b["t_start"] - a["t_end"]
    raise RuntimeError(f"no {from_size}->{to_size} switch in {wid}'s log")


def _torchrun(nproc: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__, *args]
    subprocess.run(cmd, env=_env(), check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(a: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="tidal-bench-"))
    res: dict[str, Any] = {}
    # 1. elastic rescale 2 -> 4 -> 3 (scale-out and scale-in pauses)
    d = base / "rescale"
    d.mkdir()
    _run_elastic(d, 2, a.rescale_steps, [4, 3])
    res["scaleout_pause_s"] = _elastic_pause(d, "w0", 2, 4)
    res["scalein_pause_s"] = _elastic_pause(d, "w0", 4, 3)
    res["step_time_4_s"] = _median_step([r for r in _read(d / "elastic-w0.jsonl") if r["world"] == 4], 2)
    res["step_time_3_s"] = _median_step([r for r in _read(d / "elastic-w0.jsonl") if r["world"] == 3], 2)
    # 2. the same rescale by stop-resume with torchrun
    d = base / "stopresume"
    d.mkdir()
    ck = str(d / "ckpt.pt")
    _torchrun(2, ["--role", "ddp", "--out", str(d), "--tag", "before", "--steps", "20", "--total-steps", str(a.rescale_steps), "--save", ck])
    _torchrun(4, ["--role", "ddp", "--out", str(d), "--tag", "after", "--steps", "5", "--total-steps", str(a.rescale_steps), "--load", ck])
    last = _read(d / "ddp-before-0.jsonl")[-1]["t_end"]
    first = _read(d / "ddp-after-0.jsonl")[0]["t_start"]
    res["stop_resume_pause_s"] = first - last
    # 3. steady state at 2 workers: elastic vs plain DDP, alternated
    el, dd, rtts50, rtts99 = [], [], [], []
    for i in range(a.repeats):
        d = base / f"steady-el-{i}"
        d.mkdir()
        _run_elastic(d, 2, a.steady_steps, [])
        el.append(_median_step(_read(d / "elastic-w0.jsonl"), 10))
        s = json.loads((d / "elastic-summary-w0.json").read_text())
        if s["heartbeats"] == 0:
            s = json.loads((d / "elastic-summary-w1.json").read_text())
        rtts50.append(s["coord_rtt_ms_p50"])
        rtts99.append(s["coord_rtt_ms_p99"])
        d = base / f"steady-ddp-{i}"
        d.mkdir()
        _torchrun(2, ["--role", "ddp", "--out", str(d), "--tag", "steady", "--steps", str(a.steady_steps), "--total-steps", str(a.steady_steps)])
        dd.append(_median_step(_read(d / "ddp-steady-0.jsonl"), 10))
    res["step_time_s"] = statistics.median(el)
    res["ddp_step_time_s"] = statistics.median(dd)
    res["overhead_pct"] = 100.0 * (res["step_time_s"] / res["ddp_step_time_s"] - 1.0)
    res["coord_rtt_ms_p50"] = statistics.median(rtts50)
    res["coord_rtt_ms_p99"] = max(rtts99)
    res["speedup_vs_stop_resume"] = res["stop_resume_pause_s"] / max(res["scaleout_pause_s"], 1e-9)
    res["scalein_pause_over_step"] = res["scalein_pause_s"] / res["step_time_3_s"]
    res["config"] = {"model": f"MLP {DIM}-{HIDDEN}-{HIDDEN}-{CLASSES} fp32", "global_batch": BATCH,
                     "steady_steps": a.steady_steps, "repeats": a.repeats, "cores": os.cpu_count(), "backend": "gloo"}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--role", choices=["driver", "elastic", "ddp"], default="driver")
    ap.add_argument("--out", default=".")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--total-steps", type=int, default=100)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--save", default=None)
    ap.add_argument("--load", default=None)
    ap.add_argument("--rescale-steps", type=int, default=400)
    ap.add_argument("--steady-steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if a.role == "elastic":
        return role_elastic(a)
    if a.role == "ddp":
        return role_ddp(a)
    res = measure(a)
    keys = ["scaleout_pause_s", "stop_resume_pause_s", "scalein_pause_s", "step_time_s", "overhead_pct",
            "coord_rtt_ms_p50", "coord_rtt_ms_p99"]
    if a.json:
        print(json.dumps({k: res[k] for k in keys} | {k: v for k, v in res.items() if k not in keys}))
    else:
        for k, v in res.items():
            print(f"{k:28s} {v}")


if __name__ == "__main__":
    main()
