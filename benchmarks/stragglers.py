"""Step time with one worker slowed 2x, under each straggler policy
(EDL §5.2, DLRover §5.4): nothing (``report``), ``remove`` (scale-in) and
``share`` (a smaller share of the global batch), against the same job
without a slow worker.

The job: 4 workers under ``tidal run``, global batch 64, a small model whose
"GPU compute" is simulated by sleeping 2 ms per local sample (a GPU step's
time grows with the local batch while the host waits; sleeping keeps four
workers honest on a 2-core machine). Worker ``w3`` is slowed from its first
step by ``TIDAL_FAULTS=slow:w3@0=100`` (its compute takes twice as long).
Each run lasts ``--steps`` steps; the step time is the median over the last
``--tail`` steps of rank 0 (after detection: 10 slow steps, and the policy's
switch). Expected from the model: even split 16 samples = 32 ms; nothing:
the slow rank's 2 x 32 = 64 ms; remove: 3 ranks of 21.3 = 43 ms; share:
speeds 1, 1, 1, 0.5 give the fast ranks 64 / 3.5 = 18.3 samples = 37 ms.

Prints a table, or ONE JSON line with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))  # this tree's tidal, not whichever one is installed

WORKERS, BATCH, PER_SAMPLE_S = 4, 64, 0.002
RUNS = (("no straggler", "report", False), ("nothing (report)", "report", True),
        ("remove", "remove", True), ("share", "share", True))


def role_worker(a: argparse.Namespace) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import tidal.runtime

    job = tidal.runtime.init()
    torch.manual_seed(0)
    model = job.wrap(torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(a.steps * BATCH, 32, generator=g), torch.randint(0, 4, (a.steps * BATCH,), generator=g))
    loader = job.loader(DataLoader(ds, batch_size=BATCH, shuffle=True))
    log = open(Path(a.out) / f"steps-{job.worker_id}.jsonl", "a")
    for _epoch in job.epochs(1):
        for x, y in loader:
            time.sleep(PER_SAMPLE_S * len(x))  # the simulated GPU's compute for this local batch
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            log.write(json.dumps({"worker": job.worker_id, "step": job.step_count, "rank": job.rank, "world": job.world_size,
                                  "local": len(x), "t": time.time()}) + "\n")
            log.flush()
    job.close()


def run_policy(base: Path, name: str, policy: str, slow: bool, steps: int) -> dict[str, Any]:
    from tidal.runtime.launch import run_job

    out = base / policy / ("slow" if slow else "even")
    out.mkdir(parents=True)
    os.environ["TIDAL_HOME"] = str(out / "home")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if slow:
        os.environ["TIDAL_FAULTS"] = "slow:w3@0=100"
    else:
        os.environ.pop("TIDAL_FAULTS", None)
    lines: list[str] = []
    t0 = time.time()
    rc = run_job(__file__, ["--role", "worker", "--out", str(out), "--steps", str(steps)], WORKERS,
                 job=f"strag-{policy}-{int(slow)}-{os.getpid()}", straggler_policy=policy, timeout_s=600,
                 out=lines.append)
    wall = time.time() - t0
    if rc != 0:
        raise RuntimeError(f"{name}: the job failed:\n" + "\n".join(lines))
    return {"name": name, "policy": policy, "slow": slow, "wall_s": wall, "log": lines,
            "recs": [json.loads(x) for f in sorted(out.glob("steps-*.jsonl")) for x in f.read_text().splitlines()]}


def summarize(run: dict[str, Any], tail: int) -> dict[str, Any]:
    """Rank 0's median step time over the last ``tail`` steps, the world
    size and the slow worker's local batch at the end."""
    r0 = sorted((r for r in run["recs"] if r["rank"] == 0), key=lambda r: r["step"])
    ends = [r["t"] for r in r0][-tail - 1 :]
    slow = sorted((r for r in run["recs"] if r["worker"] == "w3"), key=lambda r: r["step"])
    last = r0[-1]
    return {"step_time_ms": 1e3 * statistics.median(b - a for a, b in zip(ends, ends[1:])),
            "world_at_end": last["world"], "rank0_local_batch_at_end": last["local"],
            "w3_last_step": slow[-1]["step"] if slow else None,
            "w3_local_batch_at_end": slow[-1]["local"] if slow else None,
            "job_wall_s": round(run["wall_s"], 2),
            "actions": [x.strip() for x in run["log"] if "straggler" in x][:3]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["driver", "worker"], default="driver")
    ap.add_argument("--out", default=".")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tail", type=int, default=80, help="steps at the end the step time is taken over")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.role == "worker":
        role_worker(a)
        return
    base = Path(tempfile.mkdtemp(prefix="tidal-strag-"))
    res: dict[str, Any] = {}
    for name, policy, slow in RUNS:
        s = summarize(run_policy(base, name, policy, slow, a.steps), a.tail)
        res[name] = s
        if not a.json:
            print(f"{name:18s} {s['step_time_ms']:7.1f} ms/step  world {s['world_at_end']}  "
                  f"rank-0 local batch {s['rank0_local_batch_at_end']}", flush=True)
    even = res["no straggler"]["step_time_ms"]
    for s in res.values():
        s["vs_no_straggler"] = round(s["step_time_ms"] / even, 3)
    res["config"] = {"workers": WORKERS, "global_batch": BATCH, "per_sample_s": PER_SAMPLE_S,
                     "slowdown": "w3 2x from step 0", "steps": a.steps, "tail": a.tail,
                     "load_avg_1m": round(os.getloadavg()[0], 2)}
    if a.json:
        print(json.dumps(res))
    else:
        for name, s in res.items():
            if name != "config":
                print(f"{name:18s} x{s['vs_no_straggler']:.2f} of the job without a straggler; {s['actions']}")


if __name__ == "__main__":
    main()
