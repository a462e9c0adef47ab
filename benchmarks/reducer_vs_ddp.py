"""Tidal's gradient reducer against torch DDP, step by step, in one run.

Two gloo processes on loopback (``torch.multiprocessing`` spawn,
``GLOO_SOCKET_IFNAME=lo``, one thread each) train the same model on the same
local batches with:

* **A, reducer**: :class:`tidal.runtime.reducer.GradReducer` used directly
  (bucketed as in the runtime: 25 MB, the first 1 MB as DDP's; all-reduce
  overlapped with backward), armed with
  the rank's batch-share weight before each backward; its control tensor
  carries what the runtime sends every step (the two switch-agreement numbers
  and one compute time per rank);
* **B, DDP + hook**: ``DistributedDataParallel`` (default buckets) with a comm
  hook that multiplies each bucket by the rank's batch-share weight and
  all-reduces SUM, plus, after backward, the tiny extra all-reduce DDP would
  need for the same control numbers;
* **C, DDP rebuilt per generation**: the time to construct
  ``DistributedDataParallel`` on an existing process group (what a design
  that rebuilds DDP at every rescale pays on top of the new process group),
  and the extra time of the first step after it; the reducer's construction
  is timed alike.

Per model (the 1.3 M-parameter MLP of ``benchmarks/runtime_rescale.py`` and a
larger ~13 M one), A and B alternate ``--repeats`` times; each repeat is the
median step time (consecutive step ends, on rank 0) over ``--steps`` steps
after ``--warmup``. Reported: the median of the repeats and their min/max,
A/B - 1 in percent (median of the per-pair ratios, min/max), the same for
the CPU time per step of rank 0's process (all threads: less sensitive to
other load on the machine than wall time), whether A and B gave the same
gradients on the first step, and C. Prints ONE JSON line.
"""

# no `from __future__ import annotations`: DDP checks the comm hook's annotations as objects
import argparse
import datetime
import json
import os
import socket
import sys
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))  # this tree's tidal, not whichever one is installed

GLOBAL_BATCH, DIM, CLASSES = 256, 256, 10
MODELS: dict[str, tuple[int, ...]] = {
    "mlp_1.3M": (DIM, 1024, 1024, CLASSES),  # the model of runtime_rescale.py
    "mlp_13M": (DIM, 3072, 3072, 1024, CLASSES),
}


def build(sizes: tuple[int, ...], seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class Control:
    """The reducer's listener: the numbers the runtime adds to its control
    tensor every step (switch agreement pair + per-rank compute time)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.t0 = 0.0

    def numbers(self) -> list[float]:
        times = [0.0] * self.world
        times[self.rank] = time.perf_counter() - self.t0
        return [0.0, 0.0, *times]

    def sync_begin(self) -> list[float]:
        return self.numbers()

    def sync_done(self, reduced: list[float]) -> None:
        pass

    def sync_failed(self, error: Exception) -> None:
        raise error


def _weighted_sum_hook(weight: float, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    buf.mul_(weight)
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


class Variants:
    """A (reducer) and B (DDP + hook) on two copies of one model."""

    def __init__(self, sizes: tuple[int, ...], rank: int, world: int, bucket_mb: float) -> None:
        from tidal.runtime.reducer import GradReducer

        self.rank, self.world = rank, world
        self.weight = (GLOBAL_BATCH // world) / GLOBAL_BATCH
        self.ctrl = Control(rank, world)
        self.model_a = build(sizes)
        self.opt_a = torch.optim.SGD(self.model_a.parameters(), lr=0.01, momentum=0.9)
        self.red = GradReducer(list(self.model_a.parameters()), listener=self.ctrl, bucket_cap_mb=bucket_mb)
        self.model_b = build(sizes)
        self.opt_b = torch.optim.SGD(self.model_b.parameters(), lr=0.01, momentum=0.9)
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model_b)
        self.ddp.register_comm_hook(self.weight, _weighted_sum_hook)
        g = torch.Generator().manual_seed(1 + rank)
        local = GLOBAL_BATCH // world
        self.x = torch.randn(local, sizes[0], generator=g)
        self.y = torch.randint(0, sizes[-1], (local,), generator=g)

    def step_a(self) -> None:
        self.ctrl.t0 = time.perf_counter()
        self.red.arm(self.weight, True)
        torch.nn.functional.cross_entropy(self.model_a(self.x), self.y).backward()
        self.opt_a.step()
        self.opt_a.zero_grad()
        self.red.closed()
        self.red.disarm()

    def backward_b(self) -> None:
        self.ctrl.t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(self.ddp(self.x), self.y).backward()
        c = torch.tensor(self.ctrl.numbers(), dtype=torch.float64)
        dist.all_reduce(c)  # the switch agreement and compute times: one more small collective
        c.tolist()

    def step_b(self) -> None:
        self.backward_b()
        self.opt_b.step()
        self.opt_b.zero_grad()

    def same_first_gradients(self) -> float:
        """Max abs difference of A's and B's reduced gradients on one batch."""
        self.red.arm(self.weight, True)
        torch.nn.functional.cross_entropy(self.model_a(self.x), self.y).backward()
        self.backward_b()
        diff = max((pa.grad - pb.grad).abs().max().item()
                   for pa, pb in zip(self.model_a.parameters(), self.model_b.parameters()))
        self.opt_a.zero_grad()
        self.opt_b.zero_grad()
        self.red.closed()
        self.red.disarm()
        return diff


def _timed(step: Callable[[], None], steps: int, warmup: int) -> tuple[float, float]:
    """Median wall time between consecutive step ends (after ``warmup``
    steps) and median CPU time per step of this process (all its threads)."""
    for _ in range(warmup):
        step()
    dist.barrier()
    ends, cpu = [time.perf_counter()], [time.process_time()]
    for _ in range(steps):
        step()
        ends.append(time.perf_counter())
        cpu.append(time.process_time())
    return (statistics.median(b - a for a, b in zip(ends, ends[1:])),
            statistics.median(b - a for a, b in zip(cpu, cpu[1:])))


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def compare(v: Variants, a: argparse.Namespace, steps: int) -> dict[str, Any]:
    """A and B alternating (the order alternates too), ``a.repeats`` each."""
    ta, tb, ca, cb = [], [], [], []
    for i in range(a.repeats):
        for kind in (("a", "b") if i % 2 == 0 else ("b", "a")):
            wall, cpu = _timed(v.step_a if kind == "a" else v.step_b, steps, a.warmup)
            (ta if kind == "a" else tb).append(wall)
            (ca if kind == "a" else cb).append(cpu)
    pct = [100.0 * (x / y - 1.0) for x, y in zip(ta, tb)]
    cpu_pct = [100.0 * (x / y - 1.0) for x, y in zip(ca, cb)]
    return {"reducer_step_s": _spread(ta), "ddp_hook_step_s": _spread(tb), "reducer_vs_ddp_pct": _spread(pct),
            "reducer_cpu_step_s": _spread(ca), "ddp_hook_cpu_step_s": _spread(cb),
            "reducer_vs_ddp_cpu_pct": _spread(cpu_pct),
            "reducer_runs_s": [round(x, 5) for x in ta], "ddp_hook_runs_s": [round(x, 5) for x in tb]}


def rebuild_cost(sizes: tuple[int, ...], v: Variants, a: argparse.Namespace) -> dict[str, Any]:
    """C: DistributedDataParallel constructed again on the same group (and
    its first step), against the reducer's construction."""
    from tidal.runtime.reducer import GradReducer

    model = build(sizes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    build_s, first_s, red_s = [], [], []
    for _ in range(a.rebuilds):
        dist.barrier()
        t0 = time.perf_counter()
        ddp = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's parameters and buffers
        ddp.register_comm_hook(v.weight, _weighted_sum_hook)
        t1 = time.perf_counter()
        torch.nn.functional.cross_entropy(ddp(v.x), v.y).backward()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        build_s.append(t1 - t0)
        first_s.append(t2 - t1)
        del ddp
        dist.barrier()
        t0 = time.perf_counter()
        red = GradReducer(list(model.parameters()))
        red_s.append(time.perf_counter() - t0)
        red.remove()
    return {"ddp_construct_s": _spread(build_s), "ddp_first_step_s": _spread(first_s),
            "reducer_construct_s": _spread(red_s)}


def worker(rank: int, world: int, port: int, a: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    res: dict[str, Any] = {}
    for name in a.models.split(","):
        sizes = MODELS[name]
        v = Variants(sizes, rank, world, a.bucket_mb)
        steps = a.steps if name == "mlp_1.3M" else a.large_steps
        r: dict[str, Any] = {"params": sum(p.numel() for p in v.model_a.parameters()),
                             "reducer_buckets": len(v.red.buckets), "steps": steps,
                             "first_grad_max_abs_diff": v.same_first_gradients()}
        r |= compare(v, a, steps)
        r |= rebuild_cost(sizes, v, a)
        res[name] = r
        v.red.remove()
        del v
    if rank == 0:
        import tidal

        res["tidal_src"] = str(Path(tidal.__file__).parents[1])  # the tree measured
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="(always) print one JSON line")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--repeats", type=int, default=5, help="alternating A/B pairs")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per repeat, small model")
    ap.add_argument("--large-steps", type=int, default=12, help="timed steps per repeat, large model")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rebuilds", type=int, default=5, help="DDP constructions timed (C)")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="the reducer's bucket cap (the runtime's: 25)")
    a = ap.parse_args()
    unknown = set(a.models.split(",")) - set(MODELS)
    if unknown:
        ap.error(f"unknown model(s) {sorted(unknown)}")
    os.environ.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                      PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    world = 2
    with tempfile.TemporaryDirectory(prefix="reducer-vs-ddp-") as d:
        out = str(Path(d) / "result.json")
        t0 = time.time()
        mp.spawn(worker, args=(world, _free_port(), a, out), nprocs=world, join=True)
        res = json.loads(Path(out).read_text())
    res["config"] = {"tidal_src": res.pop("tidal_src"), "world": world, "global_batch": GLOBAL_BATCH, "backend": "gloo", "threads_per_rank": 1,
                     "repeats": a.repeats, "warmup": a.warmup, "reducer_bucket_mb": a.bucket_mb, "torch": torch.__version__,
                     "load_avg_1m": round(os.getloadavg()[0], 2), "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
