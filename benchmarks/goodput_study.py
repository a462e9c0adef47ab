"""The Pollux (OSDI'21) job-load study rerun in Tidal's simulator.

    python benchmarks/goodput_study.py                   # all 128 runs, a table of means
    python benchmarks/goodput_study.py --json            # one JSON line per (workload, load, policy)
    python benchmarks/goodput_study.py --markdown        # the table of docs/results.md
    python benchmarks/goodput_study.py --loads 1.0 --policies pollux,tiresias

Setup (docs/results.md, "Goodput: the Pollux study"): the artifact's eight
workloads (``pollux/workloads*/workload-1..8.csv``, 160 jobs each) at job
loads 0.5, 1.0, 1.5 and 2.0 on 16 nodes x 4 GPUs (``n16g4``), 60 s
scheduling rounds, goodput jobs (:mod:`tidal.sim.goodput`: progress in
statistical-efficiency units, done at the end of the initial batch's
validation run), a 30 s restart on every change of a job's GPUs
(:func:`tidal.sim.goodput.pollux_overheads`). Policies: ``tiresias``
(rigid at the workload's replicas and batch; one queue threshold at 16
GPU-hours), ``tiresias-tidal`` (Tidal's default thresholds, 500 and 10,000
GPU-s), ``optimus`` (fixed batch), ``pollux`` and ``tidal-goodput``. Each
JSON line carries the artifact's published average JCT for the same
workload, load and policy where its ``summary.json`` has one.

Runs go to ``--procs`` worker processes (default 2), one (load, workload)
each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

DATA = Path("/work/shared/data/pollux")
LOADS = ("0.5", "1.0", "1.5", "2.0")
POLICIES = ("tiresias", "tiresias-tidal", "optimus", "pollux", "tidal-goodput")
#: registry name and options of each study policy
SETUP: dict[str, tuple[str, dict[str, Any]]] = {
    "tiresias": ("tiresias", {"thresholds": (16 * 3600.0,)}),
    "tiresias-tidal": ("tiresias", {}),
    "optimus": ("optimus", {}),
    "pollux": ("pollux", {}),
    "tidal-goodput": ("tidal-goodput", {}),
}
ARTIFACT_NAME = {"tiresias": "tiresias", "optimus": "optimus", "pollux": "pollux"}
CLUSTER = "n16g4"
SLOT = 60.0


def workload_path(data: Path, load: str, k: int) -> Path:
    folder = "workloads" if load == "1.0" else f"workloads-{load}"
    return data / folder / f"workload-{k}.csv"


def artifact_avg(data: Path, policy: str, load: str, k: int) -> float | None:
    """The artifact's average JCT (s) for this policy, load and workload, if published."""
    name = ARTIFACT_NAME.get(policy)
    path = data / "results-jobload" / f"{name}-{load}" / "summary.json"
    if name is None or not path.exists():
        return None
    avg = json.loads(path.read_text()).get("avgs", {}).get(f"workload-{k}")
    return float(avg) if avg is not None else None


def run_case(args: tuple[str, int, tuple[str, ...], str]) -> list[dict[str, Any]]:
    """Every policy on one (load, workload)."""
    load, k, policies, data_s = args
    from tidal.core.topology import parse_cluster
    from tidal.scheduler.registry import get_policy_for_slot
    from tidal.sim.engine import simulate
    from tidal.sim.goodput import load_goodput_workload, pollux_overheads
    from tidal.sim.metrics import percentile

    data = Path(data_s)
    cluster = parse_cluster(CLUSTER)
    profile, jobs = load_goodput_workload(workload_path(data, load, k), cluster, data / "traces")
    rows = []
    for name in policies:
        reg, opts = SETUP[name]
        t0 = time.perf_counter()
        res = simulate(jobs, cluster, get_policy_for_slot(reg, SLOT, **opts), profiles=profile,
                       overheads=pollux_overheads(), slot=SLOT)
        wall = time.perf_counter() - t0
        jcts = [j.end_time - j.spec.submit_time for j in res.jobs
                if j.state.value == "completed" and j.end_time is not None]
        ends = [j.end_time for j in res.jobs if j.end_time is not None]
        rows.append({
            "workload": f"workload-{k}", "load": float(load), "policy": name, "jobs": len(jobs),
            "completed": len(jcts),
            "avg_jct_s": round(statistics.mean(jcts), 1) if jcts else None,
            "p99_jct_s": round(percentile(jcts, 99) or 0.0, 1) if jcts else None,
            "makespan_s": round(max(ends) - min(s.submit_time for s in jobs), 1) if ends else None,
            "artifact_avg_jct_s": artifact_avg(data, name, load, k),
            "wall_s": round(wall, 2),
        })
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[tuple[float, str], dict[str, float | None]]:
    """Per (load, policy): mean over workloads of the average JCT, p99 and
    makespan, and of the artifact's average JCT where published for all."""
    out: dict[tuple[float, str], dict[str, float | None]] = {}
    keys = sorted({(r["load"], r["policy"]) for r in rows}, key=lambda x: (x[0], POLICIES.index(x[1])))
    for key in keys:
        rs = [r for r in rows if (r["load"], r["policy"]) == key]
        art = [r["artifact_avg_jct_s"] for r in rs]
        out[key] = {
            "workloads": len(rs),
            "avg_jct_s": statistics.mean(r["avg_jct_s"] for r in rs),
            "p99_jct_s": statistics.mean(r["p99_jct_s"] for r in rs),
            "makespan_s": statistics.mean(r["makespan_s"] for r in rs),
            "artifact_avg_jct_s": statistics.mean(art) if all(a is not None for a in art) else None,
        }
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| load | policy | avg JCT (s) | artifact avg JCT (s) | ours / artifact | p99 JCT (s) | makespan (s) |",
             "|---|---|---|---|---|---|---|"]
    for (load, pol), s in summary(rows).items():
        art = s["artifact_avg_jct_s"]
        ratio = f"{s['avg_jct_s'] / art:.2f}" if art else "–"
        lines.append(f"| {load:g} | {pol} | {s['avg_jct_s']:,.0f} | {f'{art:,.0f}' if art else '–'} | {ratio} "
                     f"| {s['p99_jct_s']:,.0f} | {s['makespan_s']:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON line per (workload, load, policy)")
    ap.add_argument("--markdown", action="store_true", help="the summary table as markdown")
    ap.add_argument("--loads", default=",".join(LOADS))
    ap.add_argument("--workloads", default="1-8", help="e.g. 1-8 or 1,3")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--procs", type=int, default=2, help="worker processes (at most 2 on a shared machine)")
    ap.add_argument("--data", type=Path, default=DATA, help="the pollux/ data folder")
    a = ap.parse_args(argv)
    loads = [x.strip() for x in a.loads.split(",") if x.strip()]
    lo, _, hi = a.workloads.partition("-")
    ks = list(range(int(lo), int(hi) + 1)) if hi else [int(x) for x in a.workloads.split(",")]
    pols = tuple(p.strip() for p in a.policies.split(",") if p.strip())
    bad = [p for p in pols if p not in SETUP] + [x for x in loads if x not in LOADS]
    if bad:
        print(f"error: unknown policy or load: {', '.join(bad)} (policies: {', '.join(POLICIES)}; "
              f"loads: {', '.join(LOADS)})", file=sys.stderr)
        return 2
    cases = [(load, k, pols, str(a.data)) for load in loads for k in ks]
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=max(1, min(a.procs, 2))) as pool:
        for case_rows in pool.map(run_case, cases):
            rows += case_rows
            if a.json:
                for r in case_rows:
                    print(json.dumps(r), flush=True)
    took = time.perf_counter() - t0
    if a.markdown:
        print(markdown(rows))
    elif not a.json:
        for (load, pol), s in summary(rows).items():
            art = s["artifact_avg_jct_s"]
            print(f"load {load:g} {pol:15s} avg JCT {s['avg_jct_s']:8,.0f} s  artifact "
                  f"{f'{art:8,.0f}' if art else '       –'} s  p99 {s['p99_jct_s']:9,.0f} s  "
                  f"makespan {s['makespan_s']:9,.0f} s")
    print(f"# {len(rows)} runs in {took:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
