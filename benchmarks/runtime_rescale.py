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
host, one wall clock). The request is made once the launcher said its warm
spares are ready (``tidal run`` keeps ``$TIDAL_WARM_SPARES`` processes with
the interpreter and imports done; a job that has run a while has them).
``newcomer_startup_s``: the request to the moment a newcomer's registration
was answered (script run, model and data pipeline built), median over the
newcomers.

The rescale run makes ``--scaleouts`` (3) scale-outs from 2 to 4 workers,
each followed by a scale-in (to 2; the last one to 3), and each scale-out
waits until the launcher has warmed its spares again. The pauses and
request-to-switch times are the medians over the changes of each kind
(``*_runs``: every value): one change's pause depends on how the scheduler
happens to share the two cores at that moment (0.04-0.15 s with one
burner beside it).

Overhead: the elastic job and a plain DDP job (torchrun), 2 workers each,
run at the same time but take turns: phases of ``--phase-steps`` steps
alternate between them (ABBA; the other job waits in a sleep loop at its
phase boundary), so each elastic phase has a DDP phase a second or two away
(this VM's speed drifts by 10-30 % over tens of seconds, which separate runs
cannot cancel). A phase's step time is the median gap between consecutive
step ends inside it; phase 0 is warm-up, and lasts until ``tidal run`` has
warmed its spares (a one-time start-up cost, as DDP's own start is). ``overhead_pct`` is the median over
``--repeats`` phase pairs of elastic/DDP - 1, with min, max and quartiles;
``cpu_overhead_pct`` the same for the CPU time per step of rank 0's process;
``overhead_pct_ci90`` and ``cpu_overhead_pct_ci90``, a bootstrap 90 %
interval of each median (the pairs spread by several points, and so does
one run's median). ``--repeats`` is 61 (the overhead part takes about four
minutes): with a CPU burner beside it, single pairs spread from about -13
to +17 %, and a median of 21 pairs moved from -0.6 to +5.6 % between runs
of the same code, more than the 2-point target it is compared with; the
interval of a median narrows as one over the square root of the pairs.

``--alone N``: besides, N pairs of runs in which each job is alone on the
machine (the elastic one, then the DDP one, ``--alone-steps`` steps each):
``alone_cpu_overhead_pct`` compares rank 0's CPU per step of the two, for
the whole process and (``alone_thread_cpu_overhead_pct``) for the training
thread only, without the other job's processes beside it.

``--aa N``: besides, N runs of the overhead measurement with DDP against
DDP (two torchrun jobs taking turns as above): ``aa_cpu_overhead_pct_medians``
and ``aa_overhead_pct_medians`` list each run's median, the spread the
measurement has with no runtime difference at all.

``--per-thread``: the overhead measurement also reports rank 0's CPU per
step by thread (``per_thread_ms``, from ``/proc/self/task/*/schedstat``; a
Python thread by its ``threading`` name, torch's and gloo's by their OS
name), the median over the measured phases, for both jobs, and rank 0's
minor page faults and voluntary and involuntary context switches per step
(``rusage_per_step``, from ``getrusage``). Each step then reads those files
once, in both jobs alike; the elastic process has more threads (its
heartbeat, liveness beat and their store helpers), so it reads more files:
compare ``cpu_overhead_pct`` between runs without the option.

``--keep``: keep the runs' step logs (their folder is printed on stderr).

``--noise-scale``: the elastic job also measures the gradient noise scale
(``make_policy("strong", 256, noise_scale=True)``, :mod:`tidal.runtime.noise`):
one squared norm per bucket before its all-reduce, one after, four more
numbers in the control tail; compare its ``overhead_pct`` with a run
without the option.

Coordination round trip: rank 0's per-step store exchange with the master
(progress write + plan read) in its background thread, p50 and p99.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

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
    """``n`` samples: a bank of 4,096 random ones, repeated. (Drawing all
    ``n`` up front was 100 MB of random numbers, ~1.3 s of CPU, most of a
    warm newcomer's start: a cost of this script, not of the runtime.)"""

    BANK = 4096

    def __init__(self, n: int, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.n = n
        self.x = torch.randn(min(n, self.BANK), DIM, generator=g)
        self.y = torch.randint(0, CLASSES, (min(n, self.BANK),), generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        return self.x[i % self.BANK], self.y[i % self.BANK]


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


def rusage_counts() -> list[int]:
    """This process's minor page faults and voluntary and involuntary
    context switches so far (``getrusage``)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return [ru.ru_minflt, ru.ru_nvcsw, ru.ru_nivcsw]


def per_thread_ns() -> dict[str, int]:
    """This process's CPU time per thread name (ns, summed over the threads
    of one name), from ``/proc/self/task/*/schedstat``; a Python thread by
    its ``threading`` name, the others (torch's, gloo's) by their OS name."""
    out: dict[str, int] = {}
    py = {t.native_id: t.name for t in threading.enumerate()}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = py.get(int(task.name)) or (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        out[name] = out.get(name, 0) + ns
    return out


class Turns:
    """Phase turn-taking between two jobs on one machine (``--turn FILE``):
    before step ``s`` with ``s % phase == 0`` a rank waits until FILE reads
    ``"<kind> <s // phase>"``; the driver hands the turn over."""

    def __init__(self, path: str | None, kind: str, phase: int) -> None:
        self.path, self.kind, self.phase = (Path(path) if path else None), kind, phase

    def wait(self, step: int) -> None:
        if self.path is not None and step % self.phase == 0:
            self._until(f"{self.kind} {step // self.phase}")

    def finish(self) -> None:
        """After the last step: wait until the driver writes ``end``, so that
        neither job's exit (its teardown burns CPU) overlaps the other's
        last measured phase."""
        if self.path is not None:
            self._until("end")

    def _until(self, want: str) -> None:
        assert self.path is not None
        while True:
            try:
                if self.path.read_text() == want:
                    return
            except OSError:
                pass
            time.sleep(0.005)

    @staticmethod
    def hand(path: Path, text: str) -> None:
        """Driver: write the turn file at once (readers never see it half-written)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


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
    marks = {"spawned": spawned_at(), "script": time.time()}
    import tidal.runtime
    from torch.utils.data import DataLoader

    marks["imported"] = time.time()
    job = tidal.runtime.init()
    marks["init"] = time.time()
    torch, model, opt = build()
    model = job.wrap(model)
    policy = tidal.runtime.make_policy("strong", BATCH, noise_scale=a.noise_scale)
    loader = job.loader(DataLoader(Synthetic(a.steps * BATCH), batch_size=BATCH, shuffle=True), scaling=policy)
    log = StepLog(Path(a.out) / f"elastic-{job.worker_id}.jsonl")
    turns = Turns(a.turn, "el", a.phase_steps)
    _note_registration(job, marks)
    marks["ready"] = time.time()  # imports done, model and data built; the first epoch registers
    for _epoch in job.epochs(1):
        if "joined" not in marks:
            marks["joined"] = time.time()
            (Path(a.out) / f"elastic-start-{job.worker_id}.json").write_text(json.dumps(marks))
        for x, y in loader:
            turns.wait(job.step_count)
            t_start = time.time()  # the batch is in hand (after any switch the iterator performed)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            log.write(step=job.step_count, world=job.world_size, rank=job.rank, gen=job.gen.gen if job.gen else 0,
                      t_start=t_start, t_end=time.time(), cpu=time.process_time(), thread_cpu=time.thread_time(),
                      **({"threads": per_thread_ns(), "ru": rusage_counts()} if a.per_thread else {}))
    turns.finish()
    (Path(a.out) / f"elastic-summary-{job.worker_id}.json").write_text(json.dumps(job.summary(), default=str))
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
    turns = Turns(a.turn, a.turn_kind or "ddp", a.phase_steps)
    for step, (x, y) in enumerate(DataLoader(data, batch_sampler=batches), start=start_step):
        turns.wait(step)
        t_start = time.time()  # the batch is in hand
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        log.write(step=step + 1, world=world, rank=rank, t_start=t_start, t_end=time.time(), cpu=time.process_time(),
                  thread_cpu=time.thread_time(),
                  **({"threads": per_thread_ns(), "ru": rusage_counts()} if a.per_thread else {}))
    turns.finish()
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


def _rank0_log(d: Path) -> list[dict[str, Any]]:
    """The step log of the elastic job's rank 0 (w0 or w1, as they registered),
    compared with DDP's rank 0: rank 0 alone runs the heartbeat's exchanges."""
    for w in ("w0", "w1"):
        recs = read_log(d / f"elastic-{w}.jsonl")
        if recs and recs[0]["rank"] == 0:
            return recs
    raise RuntimeError(f"no elastic step log of rank 0 in {d}")


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


def _start_elastic(out: Path, workers: int, steps: int, extra: list[str] | None = None) -> tuple[Any, ...]:
    """Start ``tidal run`` in-process (a thread); returns (thread, result,
    output lines, master client) once the master answers."""
    home = out / "home"
    os.environ.update(_env(home))
    from tidal.runtime.client import MasterClient
    from tidal.runtime.launch import resolve_master, run_job

    job = f"bench-{os.getpid()}-{out.name}"
    res: dict[str, Any] = {}
    lines: list[str] = []
    t = threading.Thread(target=lambda: res.setdefault("rc", run_job(
        __file__, ["--role", "elastic", "--out", str(out), "--steps", str(steps), *(extra or [])], workers, job=job,
        timeout_s=900, out=lines.append)), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while True:
        try:
            return t, res, lines, MasterClient(resolve_master(job))
        except FileNotFoundError:
            if time.monotonic() > deadline or not t.is_alive():
                raise RuntimeError("the launcher did not start:\n" + "\n".join(lines)) from None
            time.sleep(0.05)


def _run_elastic(out: Path, workers: int, steps: int, schedule: list[int],
                 extra: list[str] | None = None) -> list[dict[str, Any]]:
    """Run ``tidal run`` in-process; apply ``schedule`` (world sizes) once the
    job has run 15 steps at each size. Returns the requests (size, time)."""
    t, res, lines, c = _start_elastic(out, workers, steps, extra)
    c.wait_for(workers, timeout_s=120)
    requests, current, outs = [], workers, 0
    for size in schedule:
        if size > current:  # a job that has run a while: its warm spares wait (TIDAL_WARM_SPARES)
            outs += 1
            _await_spares(lines, t, times=outs)  # (the ones the last scale-out took are warmed again)
        target = c.status().step + 15
        while c.status().step < target and c.status().state == "running":
            time.sleep(0.05)
        requests.append({"size": size, "t_req": request_size(c, size)})
        if c.wait_for(size, timeout_s=120).state == "finished":
            raise RuntimeError("job finished before the rescale; raise --steps")
        current = size
    t.join(timeout=900)
    if res.get("rc") != 0:
        raise RuntimeError("elastic run failed:\n" + "\n".join(lines))
    return requests


def _await_spares(lines: list[str], launcher: threading.Thread, timeout_s: float = 180.0, times: int = 1) -> None:
    """Wait until ``tidal run`` has said ``times`` times that its warm spares
    are ready (their warm-up takes a core for a second or two once the job is
    steady; it says so again each time it has replaced the ones a scale-out took)."""
    deadline = time.monotonic() + timeout_s
    while (sum("warm spare" in line for line in lines) < times and time.monotonic() < deadline
           and launcher.is_alive()):
        time.sleep(0.05)


def switch_pauses(out: Path, wid: str) -> list[tuple[int, int, float]]:
    """Every switch in a worker's step log: (size before, size after, pause)."""
    recs = read_log(out / f"elastic-{wid}.jsonl")
    return [(a["world"], b["world"], b["t_start"] - a["t_end"])
            for a, b in zip(recs, recs[1:]) if a["world"] != b["world"]]


def elastic_pause(out: Path, wid: str, from_size: int, to_size: int) -> float:
    """The pause of a worker's first switch from ``from_size`` to ``to_size``."""
    for f, t, pause in switch_pauses(out, wid):
        if (f, t) == (from_size, to_size):
            return pause
    raise RuntimeError(f"no {from_size}->{to_size} switch in {wid}'s log")


def request_to_switch(out: Path, t_req: float, size: int, until: float = math.inf) -> float:
    """Request -> the latest first step start, over the new generation's
    members (the workers with a step at ``size`` after the request and
    before ``until``, the next request)."""
    firsts = []
    for p in out.glob("elastic-w*.jsonl"):
        first = next((r["t_start"] for r in read_log(p) if t_req < r["t_start"] < until and r["world"] == size), None)
        if first is not None:
            firsts.append(first)
    if len(firsts) != size:
        raise RuntimeError(f"{len(firsts)} workers logged a step at size {size} after the request")
    return max(firsts) - t_req


def _newcomer_startup(out: Path, t_req: float, until: float = math.inf) -> list[float]:
    """Scale-out request -> registration answered, for each worker that
    joined the running job (its first step was not step 0) after ``t_req``
    and before ``until`` (the next request)."""
    vals = []
    for p in out.glob("elastic-start-*.json"):
        wid = p.stem[len("elastic-start-"):]
        recs = read_log(out / f"elastic-{wid}.jsonl")
        m = json.loads(p.read_text())
        if recs and recs[0]["step"] > 0 and "registered" in m and m["spawned"] == m["spawned"]:  # not NaN
            if t_req < m["registered"] < until:
                vals.append(m["registered"] - t_req)
    return vals


def _newcomer_script(out: Path) -> float | None:
    """The script's own set-up in a newcomer: ``init()`` returned -> model,
    optimizer and data pipeline built (median over the newcomers)."""
    vals = []
    for p in out.glob("elastic-start-*.json"):
        m = json.loads(p.read_text())
        recs = read_log(out / f"elastic-{p.stem[len('elastic-start-'):]}.jsonl")
        if recs and recs[0]["step"] > 0 and "init" in m:
            vals.append(m["ready"] - m["init"])
    return statistics.median(vals) if vals else None


def _torchrun(nproc: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__, *args]
    subprocess.run(cmd, env=_env(), check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# ---------------------------------------------------------------------------- measurements
def measure_rescale(base: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Elastic 2 -> 4 -> 2 -> ... -> 4 -> 3 in one job (``a.scaleouts``
    scale-outs, each as many scale-ins): pauses, request-to-switch and
    start-up, the median over the changes of each kind (and every value)."""
    d = base / "rescale"
    d.mkdir()
    n = max(1, a.scaleouts)
    steps = a.rescale_steps + 300 * (n - 1)  # each scale-out first waits until its spares are warm again
    reqs = _run_elastic(d, 2, steps, [4, 2] * (n - 1) + [4, 3], ["--noise-scale"] if a.noise_scale else [])
    w0 = read_log(d / "elastic-w0.jsonl")
    pauses = switch_pauses(d, "w0")
    outs = [p for f, t, p in pauses if t > f]
    ins = [p for f, t, p in pauses if t < f]
    times = [r["t_req"] for r in reqs] + [math.inf]
    r2s = [request_to_switch(d, r["t_req"], r["size"], times[k + 1]) for k, r in enumerate(reqs)]
    r2s_out, r2s_in = r2s[0::2], r2s[1::2]
    startup = [v for k in range(0, len(reqs), 2) for v in _newcomer_startup(d, times[k], times[k + 1])]
    return {
        "scaleout_pause_s": statistics.median(outs),
        "scaleout_pause_s_runs": [round(x, 3) for x in outs],
        "scalein_pause_s": statistics.median(ins),
        "scalein_pause_s_runs": [round(x, 3) for x in ins],
        "request_to_switch_s": statistics.median(r2s_out),
        "request_to_switch_s_runs": [round(x, 3) for x in r2s_out],
        "newcomer_startup_s": statistics.median(startup) if startup else None,
        "newcomer_script_s": _newcomer_script(d),
        "scalein_request_to_switch_s": statistics.median(r2s_in),
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


def _last_index(path: Path, offset: int) -> int:
    """The 0-based index of the last step in a step log (-1: none yet). Reads
    only the log's end: the driver asks every 20 ms, beside the jobs it times."""
    try:
        with path.open("rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 8192, 0))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return -1
    return json.loads(lines[-1])["step"] - offset if lines and lines[-1].endswith("}") else -1


def _phase_stats(recs: list[dict[str, Any]], offset: int, lo: int, hi: int) -> tuple[float, float]:
    """Median wall time and mean CPU time per step of the steps ``lo..hi-1``
    (0-based), from consecutive step ends inside the phase."""
    by = {r["step"] - offset: r for r in recs}
    ph = [by[i] for i in range(lo, hi)]
    wall = statistics.median(b["t_end"] - a["t_end"] for a, b in zip(ph, ph[1:]))
    return wall, (ph[-1]["cpu"] - ph[0]["cpu"]) / (len(ph) - 1)


def measure_steady(base: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Elastic vs DDP at 2 workers, both running at once but taking turns:
    phases of ``a.phase_steps`` steps alternate (ABBA) between the two jobs,
    so every elastic phase has a DDP phase seconds away (this VM's speed
    drifts by 10-30 % over tens of seconds). Phase 0 of each is warm-up;
    ``a.repeats`` pairs follow."""
    d = base / "steady"
    d.mkdir()
    turn, ph, n = d / "turn", a.phase_steps, a.repeats + 1
    turn.write_text("")
    total = ph * n
    per = ["--per-thread"] if a.per_thread else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--role", "ddp", "--out", str(d), "--tag", "steady", "--steps", str(total), "--total-steps", str(total),
           "--turn", str(turn), "--phase-steps", str(ph), *per]
    ddp = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    el = None
    try:
        el = _start_elastic(d, 2, total, ["--turn", str(turn), "--phase-steps", str(ph),
                                          *(["--noise-scale"] if a.noise_scale else []), *per])
        logs = {"el": (d / "elastic-w0.jsonl", 0), "ddp": (d / "ddp-steady-0.jsonl", 1)}
        _take_turns(turn, logs, n, ph, lambda: ddp.poll() in (None, 0) and el[0].is_alive(),
                    lambda: "\n".join(el[2]), lambda: _await_spares(el[2], el[0]))
        ddp.wait(timeout=120)
        el[0].join(timeout=120)
        if el[1].get("rc") != 0 or ddp.returncode != 0:
            raise RuntimeError("a run failed:\n" + "\n".join(el[2]))
    finally:
        if ddp.poll() is None:
            ddp.kill()
    er, dr = _rank0_log(d), read_log(logs["ddp"][0])
    el_s, dd_s, pairs, cpu_pairs = _paired(er, 0, dr, 1, ph, n)
    summ = json.loads((d / "elastic-summary-w0.json").read_text())
    if summ["heartbeats"] == 0:
        summ = json.loads((d / "elastic-summary-w1.json").read_text())
    return {
        "step_time_s": statistics.median(e[0] for e in el_s),
        "ddp_step_time_s": statistics.median(q[0] for q in dd_s),
        "overhead_pct": statistics.median(pairs),
        "overhead_pct_min": min(pairs),
        "overhead_pct_max": max(pairs),
        "overhead_pct_q1_q3": [round(x, 2) for x in statistics.quantiles(pairs, n=4)[::2]],
        "overhead_pct_runs": [round(x, 2) for x in pairs],
        "overhead_pct_ci90": median_interval(pairs),
        "cpu_step_ms": 1e3 * statistics.median(e[1] for e in el_s),
        "ddp_cpu_step_ms": 1e3 * statistics.median(q[1] for q in dd_s),
        "cpu_overhead_pct": statistics.median(cpu_pairs),
        "cpu_overhead_pct_runs": [round(x, 2) for x in cpu_pairs],
        "cpu_overhead_pct_ci90": median_interval(cpu_pairs),
        "coord_rtt_ms_p50": summ["coord_rtt_ms_p50"],
        "coord_rtt_ms_p99": summ["coord_rtt_ms_p99"],
        **({"noise_scale": summ["goodput"]["noise_scale"]} if "goodput" in summ else {}),
        **({"per_thread_ms": {"el": _per_thread(er, 0, ph, n), "ddp": _per_thread(dr, 1, ph, n)},
            "rusage_per_step": {"el": _rusage(er, 0, ph, n), "ddp": _rusage(dr, 1, ph, n)}}
           if a.per_thread else {}),
    }


def median_interval(values: list[float], level: float = 0.9, draws: int = 2000) -> list[float]:
    """A bootstrap interval of the median of ``values`` (percentile method,
    a fixed seed): how far one run's median may lie from the one that many
    runs would give."""
    rng, n = random.Random(0), len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(draws))
    lo = meds[int((1 - level) / 2 * draws)]
    hi = meds[min(int((1 + level) / 2 * draws), draws - 1)]
    return [round(lo, 2), round(hi, 2)]


def _paired(ra: list[dict[str, Any]], off_a: int, rb: list[dict[str, Any]], off_b: int, ph: int,
            n: int) -> tuple[list[tuple[float, float]], list[tuple[float, float]], list[float], list[float]]:
    """Per measured phase (1 .. n-1), each job's (wall, CPU) per step
    (:func:`_phase_stats`), and the paired wall and CPU values of the first
    against the second (%)."""
    sa = [_phase_stats(ra, off_a, k * ph, (k + 1) * ph) for k in range(1, n)]
    sb = [_phase_stats(rb, off_b, k * ph, (k + 1) * ph) for k in range(1, n)]
    return (sa, sb, [100.0 * (x[0] / y[0] - 1.0) for x, y in zip(sa, sb)],
            [100.0 * (x[1] / y[1] - 1.0) for x, y in zip(sa, sb)])


def _per_phase(recs: list[dict[str, Any]], offset: int, ph: int, n: int, counts: Callable[[dict[str, Any]], dict[str, float]],
               scale: float, digits: int) -> dict[str, float]:
    """Per name of ``counts(record)`` (running totals), its growth per step
    times ``scale``, the median over the measured phases (from the first to
    the last step end of each)."""
    by = {r["step"] - offset: r for r in recs}
    rows: dict[str, list[float]] = {}
    for k in range(1, n):
        a, b = counts(by[k * ph]), counts(by[(k + 1) * ph - 1])
        for name in b:
            rows.setdefault(name, []).append((b[name] - a.get(name, 0)) * scale / (ph - 1))
    return {name: round(statistics.median(v), digits) for name, v in sorted(rows.items())}


def _per_thread(recs: list[dict[str, Any]], offset: int, ph: int, n: int) -> dict[str, float]:
    """Rank 0's CPU per step by thread name (ms)."""
    return _per_phase(recs, offset, ph, n, lambda r: r["threads"], 1e-6, 3)


def _rusage(recs: list[dict[str, Any]], offset: int, ph: int, n: int) -> dict[str, float]:
    """Rank 0's minor page faults and voluntary and involuntary context
    switches per step."""
    return _per_phase(recs, offset, ph, n, lambda r: dict(zip(("minflt", "nvcsw", "nivcsw"), r["ru"])), 1.0, 2)


def _take_turns(turn: Path, logs: dict[str, tuple[Path, int]], n: int, ph: int, alive: Callable[[], bool],
                why: Callable[[], str], after_first: Callable[[], None]) -> None:
    """Hand ``n`` phases of ``ph`` steps to the jobs ``"el"`` and ``"ddp"``
    in ABBA order, each until its step log (path, step offset) shows the
    phase done; then ``end``. ``after_first``: runs after phase 0 of both."""
    for k in range(n):
        for kind in (("el", "ddp") if k % 2 == 0 else ("ddp", "el")):
            Turns.hand(turn, f"{kind} {k}")
            deadline = time.monotonic() + 300
            while _last_index(*logs[kind]) < (k + 1) * ph - 1:
                if time.monotonic() > deadline or not alive():
                    raise RuntimeError(f"phase {k} of {kind} did not finish:\n" + why())
                time.sleep(0.02)
        if k == 0:  # (the launcher warms its spares once the job is steady: part of the start, not of a step)
            after_first()
    Turns.hand(turn, "end")


def measure_aa(base: Path, a: argparse.Namespace) -> dict[str, Any]:
    """The overhead measurement of DDP against DDP (two torchrun jobs taking
    turns exactly as the elastic and DDP jobs do), ``a.aa`` times: the spread
    of its medians is the measurement's own, with no runtime difference."""
    wall, cpu = [], []
    for i in range(a.aa):
        d = base / f"aa{i}"
        d.mkdir()
        turn, ph, n = d / "turn", a.phase_steps, a.repeats + 1
        turn.write_text("")
        jobs = {}
        for kind, tag in (("el", "a"), ("ddp", "b")):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
                   "--role", "ddp", "--out", str(d), "--tag", tag, "--steps", str(ph * n), "--total-steps",
                   str(ph * n), "--turn", str(turn), "--phase-steps", str(ph), "--turn-kind", kind]
            jobs[kind] = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            logs = {"el": (d / "ddp-a-0.jsonl", 1), "ddp": (d / "ddp-b-0.jsonl", 1)}
            _take_turns(turn, logs, n, ph, lambda: all(j.poll() in (None, 0) for j in jobs.values()),
                        lambda: "a DDP job failed", lambda: None)
            for j in jobs.values():
                if j.wait(timeout=120) != 0:
                    raise RuntimeError("a DDP job failed")
        finally:
            for j in jobs.values():
                if j.poll() is None:
                    j.kill()
        _, _, w, c = _paired(read_log(logs["el"][0]), 1, read_log(logs["ddp"][0]), 1, ph, n)
        wall.append(statistics.median(w))
        cpu.append(statistics.median(c))
    return {"aa_overhead_pct_medians": [round(x, 2) for x in wall],
            "aa_cpu_overhead_pct_medians": [round(x, 2) for x in cpu]}


def _cpu_after(recs: list[dict[str, Any]], since: float) -> tuple[float, float]:
    """Process and training-thread CPU per step over the steps that began
    after ``since`` (wall time)."""
    ph = [r for r in recs if r["t_start"] > since]
    if len(ph) < 50:
        raise RuntimeError(f"only {len(ph)} steps after the warm-up; raise --alone-steps")
    n = len(ph) - 1
    return (ph[-1]["cpu"] - ph[0]["cpu"]) / n, (ph[-1]["thread_cpu"] - ph[0]["thread_cpu"]) / n


def measure_alone(base: Path, a: argparse.Namespace) -> dict[str, Any]:
    """CPU per step of rank 0 with each job alone: ``a.alone`` pairs, the
    elastic job (``tidal run``, 2 workers) and then the DDP one (torchrun),
    ``a.alone_steps`` steps each, never both alive. The elastic run counts
    from 1 s after its warm spares are ready, the DDP run from the same step.
    Beside the process's CPU (every thread: gloo's, the heartbeat's), the
    training thread's alone (``time.thread_time``)."""
    el_s, dd_s = [], []
    for k in range(a.alone):
        d = base / f"alone-{k}"
        d.mkdir()
        t, res, lines, _c = _start_elastic(d, 2, a.alone_steps)
        _await_spares(lines, t)
        ready = time.time() + 1.0
        t.join(timeout=900)
        if res.get("rc") != 0:
            raise RuntimeError("the elastic run failed:\n" + "\n".join(lines))
        er = _rank0_log(d)
        first = next(r["step"] for r in er if r["t_start"] > ready)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               "--role", "ddp", "--out", str(d), "--tag", "alone", "--steps", str(a.alone_steps),
               "--total-steps", str(a.alone_steps)]
        if subprocess.run(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          timeout=900).returncode != 0:
            raise RuntimeError("the DDP run failed")
        dr = read_log(d / "ddp-alone-0.jsonl")
        el_s.append(_cpu_after(er, ready))
        dd_s.append(_cpu_after(dr, next(r["t_start"] for r in dr if r["step"] >= first) - 1e-6))
    proc = [100.0 * (e[0] / q[0] - 1.0) for e, q in zip(el_s, dd_s)]
    thread = [100.0 * (e[1] / q[1] - 1.0) for e, q in zip(el_s, dd_s)]
    return {
        "alone_cpu_step_ms": 1e3 * statistics.median(e[0] for e in el_s),
        "alone_ddp_cpu_step_ms": 1e3 * statistics.median(q[0] for q in dd_s),
        "alone_cpu_overhead_pct": statistics.median(proc),
        "alone_cpu_overhead_pct_runs": [round(x, 2) for x in proc],
        "alone_thread_cpu_overhead_pct": statistics.median(thread),
        "alone_thread_cpu_overhead_pct_runs": [round(x, 2) for x in thread],
    }


def measure(a: argparse.Namespace) -> dict[str, Any]:
    """Every measurement asked for, in a scratch folder removed once they
    all succeeded (kept after a failure, or with ``--keep``, for its logs;
    its path is printed)."""
    base = Path(tempfile.mkdtemp(prefix="tidal-bench-"))
    try:
        res = _measure_in(base, a)
    except BaseException:
        print(f"runtime_rescale: the runs' logs are kept in {base}", file=sys.stderr)
        raise
    if a.keep:
        print(f"runtime_rescale: the runs' logs are kept in {base}", file=sys.stderr)
    else:
        shutil.rmtree(base, ignore_errors=True)
    return res


def _measure_in(base: Path, a: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {}
    if not a.skip_rescale:
        res |= measure_rescale(base, a)
        res |= measure_stop_resume(base, a)
        res["speedup_vs_stop_resume"] = res["stop_resume_pause_s"] / max(res["scaleout_pause_s"], 1e-9)
        res["scalein_pause_over_step"] = res["scalein_pause_s"] / res["step_time_3_s"]
    if a.repeats > 0:
        res |= measure_steady(base, a)
    if a.alone > 0:
        res |= measure_alone(base, a)
    if a.aa > 0:
        res |= measure_aa(base, a)
    res["config"] = {"model": f"MLP {DIM}-{HIDDEN}-{HIDDEN}-{CLASSES} fp32", "global_batch": BATCH,
                     "phase_steps": a.phase_steps, "repeats": a.repeats, "cores": os.cpu_count(),
                     "backend": "gloo", "load_avg_1m": round(os.getloadavg()[0], 2),
                     "noise_scale_measured": a.noise_scale}
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
    ap.add_argument("--scaleouts", type=int, default=3,
                    help="scale-outs (2 -> 4 workers) in the rescale run, each followed by a scale-in; "
                         "the pauses and request-to-switch times are medians over them")
    ap.add_argument("--repeats", type=int, default=61,
                    help="alternating elastic/DDP phase pairs for the overhead (>= 5 for the report; with a "
                         "CPU burner beside it, 21 pairs leave the median's 90%% interval about 4 points wide)")
    ap.add_argument("--phase-steps", type=int, default=40, help="steps per phase of the overhead measurement")
    ap.add_argument("--turn", default=None, help="(worker roles) the turn file of the overhead measurement")
    ap.add_argument("--skip-rescale", action="store_true", help="only the steady-state overhead")
    ap.add_argument("--alone", type=int, default=0,
                    help="also this many elastic/DDP pairs run one after the other, never together (CPU per step)")
    ap.add_argument("--alone-steps", type=int, default=600, help="steps per run of --alone")
    ap.add_argument("--aa", type=int, default=0,
                    help="also this many runs of the overhead measurement with DDP against DDP (its own spread)")
    ap.add_argument("--turn-kind", default=None, help="(ddp role) the name it waits for in the turn file")
    ap.add_argument("--per-thread", action="store_true",
                    help="the overhead measurement also reports rank 0's CPU per step by thread name")
    ap.add_argument("--keep", action="store_true", help="keep the runs' logs (their folder is printed)")
    ap.add_argument("--noise-scale", action="store_true",
                    help="the elastic job measures the gradient noise scale (tidal.runtime.noise)")
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
