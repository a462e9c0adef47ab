"""Simulator speed on the Philly scale trace (target: < 60 s).

    python benchmarks/sim_philly.py --json
    python benchmarks/sim_philly.py --policy fifo,tiresias --cluster n256g8 --json

Prints one JSON line per policy: trace load time, simulation wall time (the
whole ``tidal simulate`` path minus writing outputs), rounds and job counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tidal.core.topology import parse_cluster
from tidal.scheduler.registry import get_policy
from tidal.sim.engine import Simulator
from tidal.sim.metrics import summarize
from tidal.sim.traces import load_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "philly.csv"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--cluster", default="n256g8")
    ap.add_argument("--policy", default="tiresias")
    ap.add_argument("--slot", type=float, default=60.0)
    ap.add_argument("--json", action="store_true", help="print JSON lines only")
    args = ap.parse_args()
    t0 = time.perf_counter()
    trace = load_trace(args.trace)
    load_s = time.perf_counter() - t0
    cluster = parse_cluster(args.cluster)
    for name in args.policy.split(","):
        t1 = time.perf_counter()
        result = Simulator(cluster, get_policy(name), list(trace.jobs), slot=args.slot).run()
        sim_s = time.perf_counter() - t1
        s = summarize(result)
        line = {
            "benchmark": "sim_philly",
            "trace": args.trace.name,
            "cluster": cluster.name,
            "policy": name,
            "jobs": s["jobs"],
            "finished": s["finished"],
            "rounds": s["rounds"],
            "load_s": round(load_s, 2),
            "simulate_s": round(sim_s, 2),
            "total_s": round(load_s + sim_s, 2),
            "avg_jct": s["avg_jct"],
        }
        print(json.dumps(line))
        if not args.json:
            print(f"{name}: {line['total_s']} s for {line['jobs']} jobs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
