"""Benchmark of the runtime's failure recovery: a worker is killed
with SIGKILL (``kill -9``, via ``$TIDAL_FAULTS``) in a 3-worker job under
``tidal run``; the survivors detect it, re-form without it and redo the step
(EDL §4.2 forced exit as a scale-in, Elan §V-D, DLRover §5.3).

One file, two roles:

* driver (default): runs ``--repeats`` jobs (victim and step drawn with
  :func:`tidal.runtime.faults.random_kill`, seeded) and prints a report, or
  one JSON object with ``--json``;
* ``--role worker``: the training script (an MLP on synthetic data) that logs,
  per applied step, the dataset indices it consumed.

Definitions (medians over the repeats; wall clocks of one host):

* ``detect_s``: from the kill (the victim logs its wall time just before
  SIGKILL) until the *last* survivor's collective failed (``job.summary()
  ["failures"]``);
* ``regroup_s``: from that moment until the last survivor finished recovery
  (new process group formed and state taken from the most advanced survivor);
* ``lost_steps``: global steps never applied; ``duplicated_samples`` /
  ``lost_samples``: sample indices used more than once / never, per epoch
  (summed over repeats: all must be 0).

Stragglers (EDL §5.2, DLRover §5.4): a job (``--straggler-policy remove``,
10 epochs, 10 ms of non-compute time per step) in which ``w2`` becomes 100 %
slower (``slow:w2@10=100``) at step 10:

* ``straggler_detect_s``: from the start of the slowdown (fault log) until
  rank 0 flagged it (slower than 1.2x the median compute time for 10
  consecutive steps);
* ``straggler_remove_s``: from that detection until the survivors finished
  the scale-in switch without it.

Profiling (EDL §5.2): ``profile(1, 3)`` on one job started at 3 workers,
measuring ``PROFILE_STEPS`` steps (after ``PROFILE_WARMUP``) at 3, 2 and 1
workers with a scale-in between sizes, vs one separate ``tidal run`` job per
size running the same number of steps:

* ``profile_s``: from launching the job until the curve is written;
* ``profile_separate_jobs_s``: the summed wall time of the separate jobs
  (launch to exit, each includes its start-up, like the profile job).

``--profile-only`` runs only this part.

Hung worker: ``w1`` is stopped (SIGSTOP) at step 8 under ``--hang-timeout 5``:

* ``hang_detect_s``: from the stop until the last survivor's collective
  failed (the master killed ``w1`` after 5 s without liveness beats);
* ``hang_regroup_s``: from then until the survivors re-formed.

State replication (Elan §IV): ``benchmarks/state_replication.py`` with its
defaults (64 MiB to 4 newcomers from 4 live workers): ``replication_single_s``
vs ``replication_concurrent_s`` on raw loopback, and the ``capped`` pair with
each source's egress capped at 100 MB/s (see that file).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("runtime_recovery")

N, BATCH, EPOCHS, WORKERS, DIM = 960, 48, 3, 3, 64
PROFILE_STEPS, PROFILE_WARMUP = 20, 3


def role_worker(a: argparse.Namespace) -> None:
    import torch

    import tidal.runtime

    job = tidal.runtime.init()
    g = torch.Generator().manual_seed(0)
    n = a.n or N
    x, y = torch.randn(n, DIM, generator=g), torch.randint(0, 10, (n,), generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job.register_state(model, opt)
    data = [(x[i], y[i]) for i in range(n)]
    out = Path(a.out)
    loader = job.data(data, batch_size=BATCH, epochs=a.epochs, seed=0)
    with open(out / f"steps-{job.worker_id}.jsonl", "w") as f:
        for xb, yb in loader:
            rec = {"step": job.step_count, "epoch": loader.epoch, "idx": loader.last_indices}
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            if job.step():
                f.write(json.dumps(rec) + "\n")
                f.flush()  # the victim is SIGKILLed: no buffered lines may be lost
            if a.sleep and not (out / "fast").exists():
                time.sleep(a.sleep)  # non-compute time per step (I/O), not counted as compute
    (out / f"summary-{job.worker_id}.json").write_text(json.dumps(job.summary()))
    job.close()


def _env(fault: str, flog: Path, home: Path) -> dict[str, str]:
    e = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TIDAL_HOME=str(home),
             TIDAL_FAULTS=fault, TIDAL_FAULT_LOG=str(flog))
    src = str(Path(__file__).resolve().parent.parent / "src")
    e["PYTHONPATH"] = os.pathsep.join([src, e.get("PYTHONPATH", "")])
    return e


def one_run(seed: int, tmp: Path) -> dict[str, Any]:
    from tidal.runtime.faults import random_kill

    steps_total = EPOCHS * (-(-N // BATCH))
    fault = random_kill(seed, WORKERS, steps_total)
    out, flog = tmp / f"run{seed}", tmp / f"faults{seed}.jsonl"
    out.mkdir()
    cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", str(WORKERS), "--job", f"rec{seed}",
           "--timeout", "120", __file__, "--role", "worker", "--out", str(out)]
    p = subprocess.run(cmd, env=_env(fault.to_spec(), flog, tmp / "home"), capture_output=True, text=True, timeout=150)
    if p.returncode != 0:
        raise RuntimeError(f"job failed ({fault}): {p.stdout[-2000:]} {p.stderr[-2000:]}")
    killed_at = [json.loads(l) for l in flog.read_text().splitlines()][0]["wall"]
    survivors = [w for w in (f"w{i}" for i in range(WORKERS)) if w != fault.target]
    summ = [json.loads((out / f"summary-{w}.json").read_text()) for w in survivors]
    detected = max(s["failures"][0]["detected_at"] for s in summ)
    recovered = max(pz["wall_start"] + pz["pause_s"] for s in summ for pz in s["pauses"] if pz.get("kind") == "recover")
    applied: set[int] = set()
    used: dict[int, list[int]] = {e: [] for e in range(EPOCHS)}
    for f in out.glob("steps-*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            applied.add(r["step"])
            used[r["epoch"]].extend(r["idx"])
    dup = sum(len(v) - len(set(v)) for v in used.values())
    lost = sum(N - len(set(v)) for v in used.values())
    return {"fault": fault.to_spec(), "detect_s": detected - killed_at, "regroup_s": recovered - detected,
            "lost_steps": steps_total - len(applied & set(range(steps_total))), "duplicated_samples": dup,
            "lost_samples": lost}


def straggler_run(tmp: Path) -> dict[str, Any]:
    out, flog = tmp / "strag", tmp / "faults-strag.jsonl"
    out.mkdir()
    cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", str(WORKERS), "--job", "strag",
           "--timeout", "120", "--straggler-policy", "remove", __file__, "--role", "worker", "--out", str(out),
           "--epochs", "10", "--sleep", "0.01"]
    p = subprocess.run(cmd, env=_env("slow:w2@10=100", flog, tmp / "home"), capture_output=True, text=True, timeout=150)
    if p.returncode != 0:
        raise RuntimeError(f"straggler job failed: {p.stdout[-2000:]} {p.stderr[-2000:]}")
    slow_at = [json.loads(l) for l in flog.read_text().splitlines()][0]["wall"]
    summ = [json.loads(f.read_text()) for f in sorted(out.glob("summary-*.json"))]
    allreps = sorted((r for s in summ for r in s["stragglers"]), key=lambda r: r["detected_at"])
    reps = [r for r in allreps if r["gen"] == 1]
    if [r["worker_id"] for r in reps] != ["w2"]:
        raise RuntimeError(f"expected exactly w2 to be flagged in generation 1, got {allreps}")
    # (after w2 left, 2-core scheduling noise can flag another worker later on: reported in "later_reports")
    detected = reps[0]["detected_at"]
    switched = max(pz["wall_start"] + pz["pause_s"] for s in summ for pz in s["pauses"] if pz["to"] == WORKERS - 1)
    return {"straggler_detect_s": detected - slow_at, "straggler_remove_s": switched - detected,
            "straggler_step": reps[0]["step"], "straggler_ratio": reps[0]["ratio"],
            "later_reports": [r for r in allreps if r["gen"] != 1]}


HANG_TIMEOUT_S = 5.0


def hang_run(tmp: Path) -> dict[str, Any]:
    """A worker stopped (SIGSTOP) at step 8 for longer than the job: the
    master finds it hung after ``HANG_TIMEOUT_S`` without liveness beats and
    kills it; the survivors then recover as after a crash."""
    out, flog = tmp / "hang", tmp / "faults-hang.jsonl"
    out.mkdir()
    cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", str(WORKERS), "--job", "hang",
           "--timeout", "120", "--hang-timeout", str(HANG_TIMEOUT_S), __file__, "--role", "worker", "--out", str(out)]
    p = subprocess.run(cmd, env=_env("stop:w1@8=300", flog, tmp / "home"), capture_output=True, text=True, timeout=150)
    if p.returncode != 0 or "worker w1 is hung" not in p.stdout:
        raise RuntimeError(f"hung-worker job failed: {p.stdout[-2000:]} {p.stderr[-2000:]}")
    stopped_at = [json.loads(l) for l in flog.read_text().splitlines()][0]["wall"]
    summ = [json.loads((out / f"summary-{w}.json").read_text()) for w in ("w0", "w2")]
    detected = max(s["failures"][0]["detected_at"] for s in summ)
    recovered = max(pz["wall_start"] + pz["pause_s"] for s in summ for pz in s["pauses"] if pz.get("kind") == "recover")
    return {"hang_timeout_s": HANG_TIMEOUT_S, "hang_detect_s": detected - stopped_at, "hang_regroup_s": recovered - detected}


def profile_run(tmp: Path, min_p: int = 1, max_p: int = WORKERS) -> dict[str, Any]:
    from tidal.core.profile import load_profiles
    from tidal.runtime.client import MasterClient
    from tidal.runtime.profiling import profile

    out, home = tmp / "prof", tmp / "home"
    out.mkdir()
    env = _env("", tmp / "faults-prof.jsonl", home)
    # 5 ms of non-compute time per step keeps the scale-ins' 0.5 s switch lead within the data
    cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", str(max_p), "--job", "prof",
           "--timeout", "120", __file__, "--role", "worker", "--out", str(out), "--epochs", "200", "--sleep", "0.005"]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        f = home / "jobs" / "prof.json"
        while not f.exists():
            if p.poll() is not None or time.perf_counter() - t0 > 60:
                raise RuntimeError("profile job did not start")
            time.sleep(0.01)
        c = MasterClient(json.loads(f.read_text())["url"], patience_s=10)
        res = profile(c, min_p, max_p, BATCH, steps=PROFILE_STEPS, warmup=PROFILE_WARMUP, out_dir=tmp / "profiles",
                      model="mlp64", poll_s=0.005)
        profile_s = time.perf_counter() - t0
        (out / "fast").write_text("")
        p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    curve = load_profiles(tmp / "profiles").curves["mlp64"][BATCH]
    separate, sep_its = 0.0, {}
    n_sep = BATCH * (PROFILE_STEPS + PROFILE_WARMUP)  # one epoch = the same number of steps
    for w in range(max_p, min_p - 1, -1):
        o = tmp / f"sep{w}"
        o.mkdir()
        cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", str(w), "--job", f"sep{w}",
               "--timeout", "120", __file__, "--role", "worker", "--out", str(o), "--epochs", "1", "--n", str(n_sep),
               "--sleep", "0.005"]
        t1 = time.perf_counter()
        q = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
        separate += time.perf_counter() - t1
        if q.returncode != 0:
            raise RuntimeError(f"separate job at {w} failed: {q.stdout[-2000:]}")
        s0 = json.loads((o / "summary-w0.json").read_text())
        sep_its[w] = 1.0 / s0["step_time_s"] if s0["step_time_s"] else None
    return {"profile_s": profile_s, "profile_separate_jobs_s": separate, "profile_call_s": res.total_s,
            "its": {str(k): v for k, v in sorted(res.its.items())}, "csv_counts": list(curve.counts),
            "separate_its_median_step": {str(k): v for k, v in sorted(sep_its.items())}}


def measure(repeats: int, seed: int, profile_only: bool = False, profile_max: int = WORKERS) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        prof = profile_run(Path(d), max_p=profile_max)
        if profile_only:
            return {"profile_s": prof["profile_s"], "profile_separate_jobs_s": prof["profile_separate_jobs_s"],
                    "profile": prof}
        runs = [one_run(seed + i, Path(d)) for i in range(repeats)]
        strag = straggler_run(Path(d))
        hang = hang_run(Path(d))
    import state_replication  # beside this file

    repl = state_replication.measure()
    for r in runs:
        log.info("run %s", r)
    return {
        "detect_s": statistics.median(r["detect_s"] for r in runs),
        "regroup_s": statistics.median(r["regroup_s"] for r in runs),
        "lost_steps": sum(r["lost_steps"] for r in runs),
        "duplicated_samples": sum(r["duplicated_samples"] for r in runs),
        "lost_samples": sum(r["lost_samples"] for r in runs),
        "straggler_detect_s": strag["straggler_detect_s"],
        "straggler_remove_s": strag["straggler_remove_s"],
        "profile_s": prof["profile_s"],
        "profile_separate_jobs_s": prof["profile_separate_jobs_s"],
        "replication_single_s": repl["replication_single_s"],
        "replication_concurrent_s": repl["replication_concurrent_s"],
        "replication_capped_single_s": repl["replication_capped_single_s"],
        "replication_capped_concurrent_s": repl["replication_capped_concurrent_s"],
        "hang_detect_s": hang["hang_detect_s"],
        "hang_regroup_s": hang["hang_regroup_s"],
        "repeats": repeats,
        "runs": runs,
        "straggler": strag,
        "profile": prof,
        "replication": repl,
        "hang": hang,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["driver", "worker"], default="driver")
    ap.add_argument("--out", default="")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-only", action="store_true", help="only profile() vs separate jobs")
    ap.add_argument("--profile-max", type=int, default=WORKERS, help="profile sizes 1..this (default %d)" % WORKERS)
    ap.add_argument("--n", type=int, default=0, help="(worker role) dataset size (default %d)" % N)
    ap.add_argument("--epochs", type=int, default=EPOCHS, help="(worker role)")
    ap.add_argument("--sleep", type=float, default=0.0, help="(worker role) non-compute seconds per step")
    a = ap.parse_args()
    if a.role == "worker":
        role_worker(a)
        return
    logging.basicConfig(level=logging.INFO if not a.json else logging.WARNING, format="%(message)s")
    res = measure(a.repeats, a.seed, a.profile_only, a.profile_max)
    if a.json:
        sys.stdout.write(json.dumps(res) + "\n")
        return
    for k, v in res.items():
        if k != "runs":
            log.warning("%-24s %s", k, v)


if __name__ == "__main__":
    main()
