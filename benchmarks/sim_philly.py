"""Simulator speed on the Philly trace (82,247 jobs on n256g8; CPU-time targets
with one CPU-burning process running beside it: tiresias <= 5 s, every
elastic policy (elasticflow, e-backfill, tidal) <= 30 s).

    python benchmarks/sim_philly.py --json
    python benchmarks/sim_philly.py --policy fifo,tiresias --limit 5000 --json

Runs the ``tidal simulate`` path (policies get the slot as the CLI gives it)
minus writing outputs, and prints one JSON line: the trace load time and, per
policy, simulation wall and CPU time, rounds, finished jobs and average JCT.
A policy still running after ``--max-wall`` seconds is stopped and reported
with ``"error": "timeout"``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tidal.core.topology import parse_cluster
from tidal.scheduler.registry import get_policy_for_slot
from tidal.sim.engine import Simulator
from tidal.sim.metrics import summarize
from tidal.sim.traces import load_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "philly.csv"
TARGETS_S = {"tiresias": 5.0, "elasticflow": 30.0, "e-backfill": 30.0, "tidal": 30.0}


class _Timeout(Exception):
    pass


def _run(cluster, name: str, jobs: list, slot: float, max_wall: float) -> dict:
    w0, c0 = time.perf_counter(), time.process_time()

    def check(done: int, total: int) -> None:  # noqa: ARG001
        if time.perf_counter() - w0 > max_wall:
            raise _Timeout

    try:
        result = Simulator(cluster, get_policy_for_slot(name, slot), jobs, slot=slot, on_progress=check).run()
    except _Timeout:
        return {"error": "timeout", "max_wall_s": max_wall, "target_s": TARGETS_S.get(name)}
    s = summarize(result)
    return {
        "simulate_s": round(time.perf_counter() - w0, 2), "cpu_s": round(time.process_time() - c0, 2),
        "target_s": TARGETS_S.get(name), "rounds": s["rounds"], "finished": s["finished"], "avg_jct": s["avg_jct"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--cluster", default="n256g8")
    ap.add_argument("--policy", default="tiresias,elasticflow,e-backfill,tidal")
    ap.add_argument("--limit", type=int, default=None, help="first N jobs of the trace")
    ap.add_argument("--slot", type=float, default=60.0)
    ap.add_argument("--max-wall", type=float, default=600.0, help="give up on a policy after this many seconds")
    ap.add_argument("--json", action="store_true", help="print the JSON line only")
    args = ap.parse_args()
    t0 = time.perf_counter()
    trace = load_trace(args.trace, limit=args.limit)
    load_s = time.perf_counter() - t0
    cluster = parse_cluster(args.cluster)
    rows = {}
    for name in [p for p in args.policy.split(",") if p]:
        rows[name] = _run(cluster, name, list(trace.jobs), args.slot, args.max_wall)
        if not args.json:
            print(f"{name}: {rows[name]}", file=sys.stderr)
    print(json.dumps({"benchmark": "sim_philly", "trace": args.trace.name, "cluster": cluster.name,
                      "jobs": len(trace.jobs), "load_s": round(load_s, 2), "policies": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
