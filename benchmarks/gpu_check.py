"""GPU check of the elastic runtime: needs >= 2 CUDA GPUs and NCCL.

Without them it fails loudly (a message on stderr, exit code 2): it never
skips. On a machine with ``n >= 2`` GPUs it runs, with NCCL:

a. **equivalence**: an elastic job launched with ``python -m
   tidal.runtime.launch run --workers 2 ...`` (a float64 MLP, SGD with
   momentum and a step LR schedule, the data path of a DDP script:
   ``job.wrap``, ``job.loader(DataLoader(...))``, ``job.epochs``) is scaled
   2 -> n -> 2 through ``MasterClient`` while it trains; its final parameters
   must equal a plain single-GPU PyTorch loop over the same global batches
   within ``--tol`` (relative, per tensor);
b. **pauses**: a float32 job (an MLP of ~38 M parameters) scaled 2 -> n -> 2:
   scale-out and scale-in pauses on ``w0`` (end of the last step before the
   change to the start of the first step after it) and request-to-switch
   times (the request to the first step of the new generation, latest over
   its members);
c. **overhead**: median step time of that job at n workers against torch
   DDP at n processes under torchrun, ``--repeats`` alternating pairs.

Every step ends with ``torch.cuda.synchronize()`` in both, so step times are
GPU times. Prints ONE JSON line; exits 1 if the equivalence check failed.

Each worker trains on ``job.device``: the local launcher gives every worker
the lowest GPU no running worker holds (``LOCAL_RANK``), so no two live
workers share a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))  # this tree's tidal, not whichever one is installed

from runtime_rescale import elastic_pause, median_step, read_log, request_size, request_to_switch

EQ_N, EQ_BATCH, EQ_DIM = 1200, 40, 8
PERF_SIZES, PERF_BATCH = (1024, 4096, 4096, 4096, 10), 1024


class GpuCheckError(RuntimeError):
    """The machine cannot run the GPU check."""


def require_gpus(minimum: int = 2) -> int:
    """The number of CUDA GPUs; raises :class:`GpuCheckError` below ``minimum`` or without NCCL."""
    import torch
    import torch.distributed as dist

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < minimum:
        raise GpuCheckError(f"gpu_check needs at least {minimum} CUDA GPUs, found {n} "
                            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
    if not dist.is_nccl_available():
        raise GpuCheckError("gpu_check needs NCCL, which this torch build lacks")
    return n


# ---------------------------------------------------------------------------- models and data
def eq_model(seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(EQ_DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()


def perf_model(seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    layers: list[Any] = []
    for i, (a, b) in enumerate(zip(PERF_SIZES, PERF_SIZES[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(PERF_SIZES) - 2 else [])
    return torch.nn.Sequential(*layers)


def optimizer(model: Any) -> tuple[Any, Any]:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.8)


class Tensors:
    """A map-style dataset of two tensors; ``__getitems__`` fetches a whole
    batch in one indexing operation (the DataLoader then calls ``first``)."""

    def __init__(self, kind: str, n: int) -> None:
        import torch

        g = torch.Generator().manual_seed(1)
        if kind == "eq":
            self.x = torch.randn(n, EQ_DIM, generator=g, dtype=torch.float64)
            self.y = torch.tanh(self.x @ torch.randn(EQ_DIM, 1, generator=g, dtype=torch.float64))
        else:
            self.x = torch.randn(n, PERF_SIZES[0], generator=g)
            self.y = torch.randint(0, PERF_SIZES[-1], (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        return self.x[i], self.y[i]

    def __getitems__(self, idx: list[int]) -> list[tuple[Any, Any]]:
        return [(self.x[idx], self.y[idx])]


def first(batch: list[Any]) -> Any:
    """collate_fn for :meth:`Tensors.__getitems__`."""
    return batch[0]


def loss_of(kind: str, out: Any, y: Any) -> Any:
    import torch

    return torch.nn.functional.mse_loss(out, y) if kind == "eq" else torch.nn.functional.cross_entropy(out, y)


# ---------------------------------------------------------------------------- worker roles
def role_worker(a: argparse.Namespace) -> None:
    """The elastic training script (under ``tidal.runtime.launch run``)."""
    import torch
    from torch.utils.data import DataLoader

    import tidal.runtime

    out = Path(a.out)
    if a.kind == "eq":  # ends by itself
        job = tidal.runtime.init()
    else:  # runs until the driver suspends it (a checkpoint only then)
        job = tidal.runtime.init(checkpoint_dir=out / "ckpt", checkpoint_every=10**9)
    model = job.wrap((eq_model() if a.kind == "eq" else perf_model()).to(job.device))
    opt, sched = optimizer(model)
    data = Tensors(a.kind, a.samples)
    loader = job.loader(DataLoader(data, batch_size=a.batch, shuffle=True, collate_fn=first))
    with open(out / f"elastic-{job.worker_id}.jsonl", "w") as log:
        for _epoch in job.epochs(a.epochs):
            for x, y in loader:
                t_start = time.time()
                loss_of(a.kind, model(x.to(job.device)), y.to(job.device)).backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                torch.cuda.synchronize(job.device)
                log.write(json.dumps({"step": job.step_count, "world": job.world_size, "rank": job.rank,
                                      "t_start": t_start, "t_end": time.time()}) + "\n")
                log.flush()
                if a.sleep and not (out / "fast").exists():
                    time.sleep(a.sleep)  # slow steps while the driver rescales
    if not job.left:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out / f"final-{job.worker_id}.pt")
    job.close()


def role_ddp(a: argparse.Namespace) -> None:
    """The same float32 job with plain DDP (under torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    model = perf_model().to(dev)
    opt, sched = optimizer(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
    data = Tensors("perf", a.samples)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=a.batch // world, sampler=sampler, collate_fn=first, drop_last=True)

    def batches() -> Any:
        for epoch in range(10**9):
            sampler.set_epoch(epoch)
            yield from loader

    with open(Path(a.out) / f"ddp-{rank}.jsonl", "w") as log:
        for _, (x, y) in zip(range(a.steps), batches()):
            t_start = time.time()
            loss_of("perf", ddp(x.to(dev)), y.to(dev)).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            torch.cuda.synchronize(dev)
            log.write(json.dumps({"world": world, "t_start": t_start, "t_end": time.time()}) + "\n")
    del ddp
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- driver
def _env(home: Path) -> dict[str, str]:
    e = dict(os.environ, TIDAL_HOME=str(home), NCCL_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo",
             PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join([str(SRC), str(Path(__file__).resolve().parent), e.get("PYTHONPATH", "")])
    return e


class ElasticRun:
    """One job under ``python -m tidal.runtime.launch run``, driven through
    its master (``MasterClient``)."""

    def __init__(self, job: str, out: Path, workers: int, max_workers: int, worker_args: list[str],
                 timeout_s: float) -> None:
        from tidal.runtime.client import MasterClient

        self.out, self.timeout_s = out, timeout_s
        out.mkdir(parents=True)
        cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", str(workers), "--max-workers",
               str(max_workers), "--job", job, "--timeout", str(timeout_s), os.path.abspath(__file__),
               "--role", "worker", "--out", str(out), *worker_args]
        self.proc = subprocess.Popen(cmd, env=_env(out / "home"), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        f = out / "home" / "jobs" / f"{job}.json"
        deadline = time.monotonic() + timeout_s
        while not f.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the launcher did not start: {self.proc.stdout.read() if self.proc.stdout else ''}")
            time.sleep(0.05)
        self.client = MasterClient(json.loads(f.read_text())["url"])
        self.client.wait_for(workers, timeout_s=timeout_s)

    def run_steps(self, steps: int) -> None:
        target = self.client.status().step + steps
        while self.client.status().step < target:
            if self.client.status().state != "running":
                raise RuntimeError(f"the job stopped early: {self.client.status()}")
            time.sleep(0.02)

    def rescale(self, size: int) -> float:
        """Request ``size`` workers and wait for them; the request's wall time."""
        t_req = request_size(self.client, size, self.timeout_s)
        st = self.client.wait_for(size, timeout_s=self.timeout_s)
        if st.state != "running" or st.world_size != size:
            raise RuntimeError(f"the job did not run at {size} workers: {st}")
        return t_req

    def end(self, suspend: bool) -> None:
        """Suspend the job (float32 runs) or let it finish at full speed."""
        if suspend:
            self.client.suspend()
        else:
            (self.out / "fast").touch()
        try:
            text, _ = self.proc.communicate(timeout=self.timeout_s)
        finally:
            self.kill()
        if self.proc.returncode != 0:
            raise RuntimeError(f"the elastic job failed (exit {self.proc.returncode}):\n{text[-4000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def reference_params(a: argparse.Namespace) -> dict[str, Any]:
    """A plain single-GPU loop over the same global batches (fixed size)."""
    import torch

    from tidal.runtime.data import epoch_permutation

    dev = torch.device("cuda", 0)
    model = eq_model().to(dev)
    opt, sched = optimizer(model)
    data = Tensors("eq", EQ_N)
    for e in range(a.eq_epochs):
        perm = epoch_permutation(EQ_N, 0, e)
        for start in range(0, EQ_N, EQ_BATCH):
            x, y = data.__getitems__(perm[start : start + EQ_BATCH].tolist())[0]
            loss_of("eq", model(x.to(dev)), y.to(dev)).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def check_equivalence(base: Path, n_gpus: int, a: argparse.Namespace) -> dict[str, Any]:
    """(a) 2 -> n -> 2 while training, against the fixed-size run."""
    import torch

    out = base / "equivalence"
    run = ElasticRun("gpu-eq", out, 2, n_gpus, ["--kind", "eq", "--samples", str(EQ_N), "--batch", str(EQ_BATCH),
                                                "--epochs", str(a.eq_epochs), "--sleep", "0.1"], a.timeout)
    try:
        for size in (n_gpus, 2):
            run.run_steps(a.settle)
            run.rescale(size)
    except BaseException:
        run.kill()
        raise
    run.end(suspend=False)
    worlds = [r["world"] for r in read_log(out / "elastic-w0.jsonl")]
    sizes = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    ref = reference_params(a)
    diffs = {}
    for f in sorted(out.glob("final-*.pt")):
        got = torch.load(f)
        diffs[f.stem[len("final-"):]] = max(((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)
    ok = bool(diffs) and max(diffs.values()) <= a.tol and sizes == [2, n_gpus, 2]
    return {"equivalent": ok, "sizes": sizes, "max_rel_diff": diffs, "tol": a.tol}


def _perf_args(a: argparse.Namespace) -> list[str]:
    return ["--kind", "perf", "--samples", str(a.perf_samples), "--batch", str(PERF_BATCH), "--epochs", "1000000"]


def measure_pauses(base: Path, n_gpus: int, a: argparse.Namespace) -> dict[str, Any]:
    """(b) pauses and request-to-switch of 2 -> n -> 2 (float32 job)."""
    out = base / "pauses"
    run = ElasticRun("gpu-pauses", out, 2, n_gpus, _perf_args(a), a.timeout)
    try:
        reqs = []
        for size in (n_gpus, 2):
            run.run_steps(a.settle)
            reqs.append(run.rescale(size))
        run.run_steps(a.settle)
    except BaseException:
        run.kill()
        raise
    run.end(suspend=True)
    return {"scaleout_pause_s": elastic_pause(out, "w0", 2, n_gpus),
            "scalein_pause_s": elastic_pause(out, "w0", n_gpus, 2),
            "request_to_switch_s": request_to_switch(out, reqs[0], n_gpus),
            "scalein_request_to_switch_s": request_to_switch(out, reqs[1], 2)}


def _steady_elastic(out: Path, n_gpus: int, a: argparse.Namespace) -> float:
    run = ElasticRun(f"gpu-steady-{out.name}", out, n_gpus, n_gpus, _perf_args(a), a.timeout)
    try:
        run.run_steps(a.warmup + a.steps)
    except BaseException:
        run.kill()
        raise
    run.end(suspend=True)
    return median_step(read_log(out / "elastic-w0.jsonl"), a.warmup)


def _steady_ddp(out: Path, n_gpus: int, a: argparse.Namespace) -> float:
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n_gpus}",
           os.path.abspath(__file__), "--role", "ddp", "--out", str(out), "--samples", str(a.perf_samples),
           "--batch", str(PERF_BATCH), "--steps", str(a.warmup + a.steps)]
    subprocess.run(cmd, env=_env(out / "home"), check=True, timeout=a.timeout, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return median_step(read_log(out / "ddp-0.jsonl"), a.warmup)


def measure_overhead(base: Path, n_gpus: int, a: argparse.Namespace) -> dict[str, Any]:
    """(c) elastic vs DDP at n GPUs, ``a.repeats`` alternating pairs."""
    el, dd = [], []
    for i in range(a.repeats):
        for kind in (("el", "ddp") if i % 2 == 0 else ("ddp", "el")):
            if kind == "el":
                el.append(_steady_elastic(base / f"steady-el-{i}", n_gpus, a))
            else:
                dd.append(_steady_ddp(base / f"steady-ddp-{i}", n_gpus, a))
    pairs = [100.0 * (e / d - 1.0) for e, d in zip(el, dd)]
    return {"world": n_gpus, "step_time_s": statistics.median(el), "ddp_step_time_s": statistics.median(dd),
            "overhead_pct": statistics.median(pairs), "overhead_pct_min": min(pairs),
            "overhead_pct_max": max(pairs), "step_time_runs_s": el, "ddp_step_time_runs_s": dd}


def drive(a: argparse.Namespace) -> int:
    n_gpus = require_gpus()
    if a.gpus:
        if not 2 <= a.gpus <= n_gpus:
            raise GpuCheckError(f"--gpus {a.gpus}: between 2 and the {n_gpus} GPUs present")
        n_gpus = a.gpus
    base = Path(tempfile.mkdtemp(prefix="tidal-gpu-check-"))
    res: dict[str, Any] = {"gpus": n_gpus, "backend": "nccl"}
    res["equivalence"] = check_equivalence(base, n_gpus, a)
    res["pauses"] = measure_pauses(base, n_gpus, a)
    res["overhead"] = measure_overhead(base, n_gpus, a)
    import torch

    res["config"] = {"perf_model": f"MLP {'-'.join(map(str, PERF_SIZES))} fp32", "perf_global_batch": PERF_BATCH,
                     "eq_model": f"MLP {EQ_DIM}-32-1 fp64", "eq_global_batch": EQ_BATCH, "torch": torch.__version__,
                     "device": torch.cuda.get_device_name(0), "repeats": a.repeats, "steps": a.steps}
    print(json.dumps(res))
    return 0 if res["equivalence"]["equivalent"] else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="(always) print one JSON line")
    ap.add_argument("--gpus", type=int, default=0, help="scale out to this many GPUs (default: all)")
    ap.add_argument("--tol", type=float, default=1e-5, help="relative tolerance of the equivalence check")
    ap.add_argument("--eq-epochs", type=int, default=10)
    ap.add_argument("--settle", type=int, default=30, help="steps at each size before the next rescale")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per steady run")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5, help="alternating elastic/DDP pairs")
    ap.add_argument("--perf-samples", type=int, default=65536)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds, per job")
    ap.add_argument("--role", choices=["driver", "worker", "ddp"], default="driver", help=argparse.SUPPRESS)
    ap.add_argument("--kind", choices=["eq", "perf"], default="perf", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=".", help=argparse.SUPPRESS)
    ap.add_argument("--samples", type=int, default=EQ_N, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=EQ_BATCH, help=argparse.SUPPRESS)
    ap.add_argument("--epochs", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.role == "worker":
        role_worker(a)
        return 0
    if a.role == "ddp":
        role_ddp(a)
        return 0
    try:
        return drive(a)
    except GpuCheckError as e:
        print(f"gpu_check: FAILED: {e}. This check needs a machine with >= 2 CUDA GPUs; "
              "it was not run.", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
