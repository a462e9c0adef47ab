"""Benchmark of the elastic runtime: rescale pauses, request-to-switch
latency, steady-state overhead and per-step coordination round trip, versus
torchrun.

One file, several roles (same model and data everywhere: a 3-layer MLP,
1.3 M float32 parameters, global batch 256, on synthetic data):

* driver (default): runs every measurement below and prints a report, or one
  JSON object with ``--json``;
* ``--role elastic``: the training script under ``tidal run``, written as a
  DDP user writes it: ``job.wrap(model)``, ``job.loader(DataLoader(...))``,
  ``for epoch in job.epochs(1)``, ``optimizer.step()``/``zero_grad()`` by the
  script itself;
* ``--role ddp``: the same loop with plain ``DistributedDataParallel`` and a
  torch ``DataLoader`` under torchrun (``python -m torch.distributed.run``),
  optionally loading and saving a checkpoint.

Pause definition, identical for both: on an existing worker, the wall time
from the end of the last step before the change to the start of the first step
after it (i.e. time in which no training happens). For torchrun the change is
stop-resume: the 2-worker run saves a checkpoint after its last step and
exits; a 4-worker torchrun starts, loads it and takes its first step. This is
torchrun's best case (checkpoint exactly at the stop, no lost progress).

Request to switch (``request_to_switch_s``): from the driver's scale-out
call (``MasterClient.scale_out``) to the start of the first step of the new
generation, the latest over its members, from the workers' step logs (one
host, one wall clock). ``newcomer_startup_s``: a newcomer's process start
(``/proc/self/stat``) to the moment its registration was answered (imports,
model and data pipeline built), median over the newcomers.

Overhead: median step time (end to end of consecutive steps, after warm-up)
of the elastic runtime at 2 workers vs plain DDP at 2 workers, ``--repeats``
alternating pairs (the order inside a pair alternates too); ``overhead_pct``
is the median of the pairs' overheads, ``overhead_pct_min``/``_max`` their
spread.

Coordination round trip: rank 0's per-step store exchange with the master
(progress write + plan read) in its background thread, p50 and p99.
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

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))  # this tree's tidal, not whichever one is installed

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


def spawned_at() -> float:
    """Wall time this process was created (``/proc``; 10 ms resolution)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in ticks since boot
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - start_s)
    except (OSError, ValueError, IndexError):
        return float("nan")


# ---------------------------------------------------------------------------- worker roles
def _note_registration(job: Any, marks: dict[str, float]) -> None:
    """Record when this worker's registration with the master was answered."""
    register = job.membership.register

    def timed(**kw: Any) -> Any:
        out = register(**kw)
        marks["registered"] = time.time()
        return out

    job.membership.register = timed


def role_elastic(a: argparse.Namespace) -> None:
    marks = {"spawned": spawned_at()}
    import tidal.runtime
    from torch.utils.data import DataLoader

    job = tidal.runtime.init()
    torch, model, opt = build()
    model = job.wrap(model)
    loader = job.loader(DataLoader(Synthetic(a.steps * BATCH), batch_size=BATCH, shuffle=True))
    log = StepLog(Path(a.out) / f"elastic-{job.worker_id}.jsonl")
    _note_registration(job, marks)
    marks["ready"] = time.time()  # imports done, model and data built; the first epoch registers
    for _epoch in job.epochs(1):
        if "joined" not in marks:
            marks["joined"] = time.time()
            (Path(a.out) / f"elastic-start-{job.worker_id}.json").write_text(json.dumps(marks))
        for x, y in loader:
            t_start = time.time()  # the batch is in hand (after any switch the iterator performed)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            log.write(step=job.step_count, world=job.world_size, rank=job.rank, gen=job.gen.gen if job.gen else 0,
                      t_start=t_start, t_end=time.time(), cpu=time.process_time())
    (Path(a.out) / f"elastic-summary-{job.worker_id}.json").write_text(json.dumps(job.summary()))
    job.close()


def role_ddp(a: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

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
    # this rank's indices of each step (what a DistributedSampler hands a DataLoader)
    batches = [perm[sl.lo : sl.hi].tolist() for sl in
               (step_slice(s * BATCH, len(data), BATCH, rank, world) for s in range(start_step, start_step + a.steps))]
    log = StepLog(Path(a.out) / f"ddp-{a.tag}-{rank}.jsonl")
    for step, (x, y) in enumerate(DataLoader(data, batch_sampler=batches), start=start_step):
        t_start = time.time()  # the batch is in hand
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        log.write(step=step + 1, world=world, rank=rank, t_start=t_start, t_end=time.time(), cpu=time.process_time())
    if a.save and rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": start_step + a.steps}, a.save)
    del ddp  # drop the DDP wrapper before tearing the group down (gloo teardown pitfall)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- driver helpers
def _env(home: Path | None = None) -> dict[str, str]:
    e = dict(os.environ)
    e.setdefault("GLOO_SOCKET_IFNAME", "lo")
    e.setdefault("OMP_NUM_THREADS", "1")
    if home is not None:
        e["TIDAL_HOME"] = str(home)
    if str(SRC) not in e.get("PYTHONPATH", "").split(os.pathsep):
        e["PYTHONPATH"] = os.pathsep.join([str(SRC), e.get("PYTHONPATH", "")])
    return e


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def median_step(recs: list[dict[str, Any]], warmup: int, key: str = "t_end") -> float:
    ends = [r[key] for r in recs]
    gaps = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :])]
    return statistics.median(gaps)


def request_size(c: Any, size: int, timeout_s: float = 120.0) -> float:
    """Ask for ``size`` workers (scale_out/scale_in, retried while busy);
    returns the wall time of the accepted call."""
    deadline = time.monotonic() + timeout_s
    while True:
        cur = c.status().world_size
        t_req = time.time()
        ans = c.scale_out(size - cur) if size > cur else c.scale_in(cur - size)
        if ans.accepted:
            return t_req
        if ans.status != "retry" or time.monotonic() > deadline:
            raise RuntimeError(f"scale to {size}: {ans}")
        time.sleep(max(0.05, ans.retry_after_s))


def _run_elastic(out: Path, workers: int, steps: int, schedule: list[int]) -> list[dict[str, Any]]:
    """Run ``tidal run`` in-process; apply ``schedule`` (world sizes) once the
    job has run 15 steps at each size. Returns the requests (size, time)."""
    home = out / "home"
    os.environ.update(_env(home))
    from tidal.runtime.client import MasterClient
    from tidal.runtime.launch import resolve_master, run_job

    job = f"bench-{os.getpid()}-{out.name}"
    res: dict[str, Any] = {}
    lines: list[str] = []
    t = threading.Thread(target=lambda: res.setdefault("rc", run_job(
        __file__, ["--role", "elastic", "--out", str(out), "--steps", str(steps)], workers, job=job,
        timeout_s=600, out=lines.append)), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while True:
        try:
            c = MasterClient(resolve_master(job))
            break
        except FileNotFoundError:
            if time.monotonic() > deadline or not t.is_alive():
                raise RuntimeError("the launcher did not start:\n" + "\n".join(lines)) from None
            time.sleep(0.05)
    c.wait_for(workers, timeout_s=120)
    requests = []
    for size in schedule:
        target = c.status().step + 15
        while c.status().step < target and c.status().state == "running":
            time.sleep(0.05)
        requests.append({"size": size, "t_req": request_size(c, size)})
        if c.wait_for(size, timeout_s=120).state == "finished":
            raise RuntimeError("job finished before the rescale; raise --steps")
    t.join(timeout=900)
    if res.get("rc") != 0:
        raise RuntimeError("elastic run failed:\n" + "\n".join(lines))
    return requests


def elastic_pause(out: Path, wid: str, from_size: int, to_size: int) -> float:
    recs = read_log(out / f"elastic-{wid}.jsonl")
    for a, b in zip(recs, recs[1:]):
        if a["world"] == from_size and b["world"] == to_size:
            return b["t_start"] - a["t_end"]
    raise RuntimeError(f"no {from_size}->{to_size} switch in {wid}'s log")


def request_to_switch(out: Path, t_req: float, size: int) -> float:
    """Request -> the latest first step start, over the new generation's members."""
    firsts = []
    for p in out.glob("elastic-w*.jsonl"):
        first = next((r["t_start"] for r in read_log(p) if r["t_start"] > t_req and r["world"] == size), None)
        if first is not None:
            firsts.append(first)
    if len(firsts) != size:
        raise RuntimeError(f"{len(firsts)} workers logged a step at size {size} after the request")
    return max(firsts) - t_req


def _newcomer_startup(out: Path) -> float | None:
    """Process start -> registration answered, median over the workers that
    joined a running job (their first step was not step 0)."""
    vals = []
    for p in out.glob("elastic-start-*.json"):
        wid = p.stem[len("elastic-start-"):]
        recs = read_log(out / f"elastic-{wid}.jsonl")
        m = json.loads(p.read_text())
        if recs and recs[0]["step"] > 0 and "registered" in m and m["spawned"] == m["spawned"]:  # not NaN
            vals.append(m["registered"] - m["spawned"])
    return statistics.median(vals) if vals else None


def _torchrun(nproc: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__, *args]
    subprocess.run(cmd, env=_env(), check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# ---------------------------------------------------------------------------- measurements
def measure_rescale(base: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Elastic 2 -> 4 -> 3 in one job: pauses, request-to-switch, start-up."""
    d = base / "rescale"
    d.mkdir()
    reqs = _run_elastic(d, 2, a.rescale_steps, [4, 3])
    w0 = read_log(d / "elastic-w0.jsonl")
    return {
        "scaleout_pause_s": elastic_pause(d, "w0", 2, 4),
        "scalein_pause_s": elastic_pause(d, "w0", 4, 3),
        "request_to_switch_s": request_to_switch(d, reqs[0]["t_req"], 4),
        "newcomer_startup_s": _newcomer_startup(d),
        "scalein_request_to_switch_s": request_to_switch(d, reqs[1]["t_req"], 3),
        "step_time_4_s": median_step([r for r in w0 if r["world"] == 4], 2),
        "step_time_3_s": median_step([r for r in w0 if r["world"] == 3], 2),
    }


def measure_stop_resume(base: Path, a: argparse.Namespace) -> dict[str, Any]:
    """The same scale-out by torchrun stop-resume (checkpoint, restart at 4)."""
    d = base / "stopresume"
    d.mkdir()
    ck = str(d / "ckpt.pt")
    common = ["--role", "ddp", "--out", str(d), "--total-steps", str(a.rescale_steps)]
    _torchrun(2, [*common, "--tag", "before", "--steps", "20", "--save", ck])
    _torchrun(4, [*common, "--tag", "after", "--steps", "5", "--load", ck])
    last = read_log(d / "ddp-before-0.jsonl")[-1]["t_end"]
    first = read_log(d / "ddp-after-0.jsonl")[0]["t_start"]
    return {"stop_resume_pause_s": first - last}


def _steady_elastic(d: Path, steps: int) -> tuple[float, float, dict[str, Any]]:
    """Median wall and CPU time per step of w0, and the heartbeat's summary."""
    d.mkdir()
    _run_elastic(d, 2, steps, [])
    s = json.loads((d / "elastic-summary-w0.json").read_text())
    if s["heartbeats"] == 0:
        s = json.loads((d / "elastic-summary-w1.json").read_text())
    recs = read_log(d / "elastic-w0.jsonl")
    return median_step(recs, 10), median_step(recs, 10, "cpu"), s


def _steady_ddp(d: Path, steps: int) -> tuple[float, float]:
    d.mkdir()
    _torchrun(2, ["--role", "ddp", "--out", str(d), "--tag", "steady", "--steps", str(steps),
                  "--total-steps", str(steps)])
    recs = read_log(d / "ddp-steady-0.jsonl")
    return median_step(recs, 10), median_step(recs, 10, "cpu")


def measure_steady(base: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Elastic vs DDP at 2 workers, ``a.repeats`` alternating pairs."""
    el, dd, el_cpu, dd_cpu, rtt50, rtt99 = [], [], [], [], [], []
    for i in range(a.repeats):
        order = ("el", "ddp") if i % 2 == 0 else ("ddp", "el")
        for kind in order:
            if kind == "el":
                t, c, s = _steady_elastic(base / f"steady-el-{i}", a.steady_steps)
                el.append(t)
                el_cpu.append(c)
                rtt50.append(s["coord_rtt_ms_p50"])
                rtt99.append(s["coord_rtt_ms_p99"])
            else:
                t, c = _steady_ddp(base / f"steady-ddp-{i}", a.steady_steps)
                dd.append(t)
                dd_cpu.append(c)
    pairs = [100.0 * (e / d - 1.0) for e, d in zip(el, dd)]
    cpu_pairs = [100.0 * (e / d - 1.0) for e, d in zip(el_cpu, dd_cpu)]
    return {
        "step_time_s": statistics.median(el),
        "ddp_step_time_s": statistics.median(dd),
        "overhead_pct": statistics.median(pairs),
        "overhead_pct_min": min(pairs),
        "overhead_pct_max": max(pairs),
        "overhead_pct_of_medians": 100.0 * (statistics.median(el) / statistics.median(dd) - 1.0),
        "overhead_pct_runs": [round(p, 2) for p in pairs],
        "step_time_runs_s": [round(x, 5) for x in el],
        "ddp_step_time_runs_s": [round(x, 5) for x in dd],
        "cpu_step_ms": 1e3 * statistics.median(el_cpu),
        "ddp_cpu_step_ms": 1e3 * statistics.median(dd_cpu),
        "cpu_overhead_pct": statistics.median(cpu_pairs),
        "cpu_overhead_pct_runs": [round(p, 2) for p in cpu_pairs],
        "coord_rtt_ms_p50": statistics.median(rtt50),
        "coord_rtt_ms_p99": max(rtt99),
    }


def measure(a: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="tidal-bench-"))
    res: dict[str, Any] = {}
    if not a.skip_rescale:
        res |= measure_rescale(base, a)
        res |= measure_stop_resume(base, a)
        res["speedup_vs_stop_resume"] = res["stop_resume_pause_s"] / max(res["scaleout_pause_s"], 1e-9)
        res["scalein_pause_over_step"] = res["scalein_pause_s"] / res["step_time_3_s"]
    if a.repeats > 0:
        res |= measure_steady(base, a)
    res["config"] = {"model": f"MLP {DIM}-{HIDDEN}-{HIDDEN}-{CLASSES} fp32", "global_batch": BATCH,
                     "steady_steps": a.steady_steps, "repeats": a.repeats, "cores": os.cpu_count(),
                     "backend": "gloo", "load_avg_1m": round(os.getloadavg()[0], 2)}
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
    ap.add_argument("--repeats", type=int, default=5, help="alternating elastic/DDP pairs (>= 5 for the report)")
    ap.add_argument("--skip-rescale", action="store_true", help="only the steady-state overhead")
    a = ap.parse_args()
    if a.role == "elastic":
        return role_elastic(a)
    if a.role == "ddp":
        return role_ddp(a)
    res = measure(a)
    keys = ["scaleout_pause_s", "request_to_switch_s", "newcomer_startup_s", "stop_resume_pause_s",
            "scalein_pause_s", "step_time_s", "overhead_pct", "overhead_pct_min", "overhead_pct_max",
            "coord_rtt_ms_p50", "coord_rtt_ms_p99"]
    if a.json:
        print(json.dumps({k: res[k] for k in keys if k in res} | {k: v for k, v in res.items() if k not in keys}))
    else:
        for k, v in res.items():
            print(f"{k:28s} {v}")


if __name__ == "__main__":
    main()
