"""Simulator speed on a 16,000-job ITP-sized trace (CPU-time targets with one
CPU-burning process running beside it: elasticflow <= 15 s, edf <= 15 s on n128g8).

The trace is built here, never written to disk: the shared ITP cluster traces
(``../shared/data/traces/itp/cluster*.csv``) one after the other, each shifted
in time to start an hour after the previous one's last submission (deadlines
shifted with it, job ids prefixed by the file), cut at 16,000 jobs.

    python benchmarks/sim_itp16k.py --json
    python benchmarks/sim_itp16k.py --policy edf --jobs 4000 --json

Prints one JSON line: per policy the simulation wall and CPU time, rounds,
finished jobs and average JCT.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from tidal.core.job import JobSpec
from tidal.core.topology import parse_cluster
from tidal.scheduler.registry import get_policy_for_slot
from tidal.sim.engine import Simulator
from tidal.sim.metrics import summarize
from tidal.sim.traces import load_trace

ITP_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "itp"
TARGETS_S = {"elasticflow": 15.0, "edf": 15.0}
GAP_S = 3600.0


def itp_concat(directory: Path, jobs: int) -> list[JobSpec]:
    """The ITP cluster traces back to back in time, the first ``jobs`` jobs."""
    out: list[JobSpec] = []
    end = 0.0
    for path in sorted(directory.glob("cluster*.csv")):
        specs = sorted(load_trace(path).jobs, key=lambda s: (s.submit_time, s.job_id))
        shift = end + (GAP_S if out else 0.0) - specs[0].submit_time
        for s in specs:
            out.append(dataclasses.replace(
                s,
                job_id=f"{path.stem}-{s.job_id}",
                submit_time=s.submit_time + shift,
                deadline=None if s.deadline is None else s.deadline + shift,
            ))
        end = out[-1].submit_time
        if len(out) >= jobs:
            break
    return out[:jobs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--itp", type=Path, default=ITP_DIR)
    ap.add_argument("--jobs", type=int, default=16_000)
    ap.add_argument("--cluster", default="n128g8")
    ap.add_argument("--policy", default="elasticflow,edf")
    ap.add_argument("--slot", type=float, default=60.0)
    ap.add_argument("--json", action="store_true", help="print the JSON line only")
    args = ap.parse_args()
    t0 = time.perf_counter()
    specs = itp_concat(args.itp, args.jobs)
    load_s = time.perf_counter() - t0
    cluster = parse_cluster(args.cluster)
    rows = {}
    for name in [p for p in args.policy.split(",") if p]:
        w0, c0 = time.perf_counter(), time.process_time()
        result = Simulator(cluster, get_policy_for_slot(name, args.slot), specs, slot=args.slot).run()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        s = summarize(result)
        rows[name] = {
            "simulate_s": round(wall, 2), "cpu_s": round(cpu, 2), "target_s": TARGETS_S.get(name),
            "rounds": s["rounds"], "finished": s["finished"], "avg_jct": s["avg_jct"],
            "deadline_ratio": s["deadline_ratio"],
        }
        if not args.json:
            print(f"{name}: {wall:.1f} s wall, {cpu:.1f} s CPU", file=sys.stderr)
    print(json.dumps({"benchmark": "sim_itp16k", "cluster": cluster.name, "jobs": len(specs),
                      "load_s": round(load_s, 2), "policies": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
