"""Heterogeneity study: type-aware scheduling on Sia's cluster and workloads.

    python benchmarks/hetero_study.py --json                        # saturn workloads, one JSON line per case
    python benchmarks/hetero_study.py --workloads saturn,philly,newtrace
    python benchmarks/hetero_study.py --workloads saturn/workload-1 --policies gavel,tidal-hetero

Method (docs/policies/hetero.md):

- **Cluster**: Sia's (SOSP'23 §6) default heterogeneous cluster,
  ``6xT4:4,2xA100:8,3xRTX2080Ti:8`` (64 GPUs of three types).
- **Workloads**: Sia's workload CSVs (``sia/workloads/<suite>/workload-N.csv``,
  160 jobs each) with the profiles fitted to Sia's measured step times per GPU
  type (:mod:`tidal.sim.sia`), jobs elastic, exactly as ``tidal simulate
  --trace <csv> --cluster <cluster>`` loads them.
- **Policies**: ``fifo``, ``tiresias`` (rigid, type-blind), ``gavel``
  (Gavel's heterogeneity-aware max-min fairness, 360 s rounds, rigid),
  ``tidal-hetero`` and its type-blind variant ``tidal-hetero-agnostic``.
- **Simulator**: Tidal's, 60 s slots, stop-free overheads (the CLI's
  defaults). Metrics from :func:`tidal.sim.metrics.summarize`: average and
  p99 JCT, makespan; GPU hours are the GPU time held by jobs.

Cases run in at most two worker processes (``--procs``). With ``--json``,
one JSON line per (workload, policy), then one ``summary`` line: per suite,
each policy's mean average JCT, and whether ``tidal-hetero`` is at least
25% below its type-blind variant on average and no higher than ``gavel`` on
any workload.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "sia"
CLUSTER = "6xT4:4,2xA100:8,3xRTX2080Ti:8"
POLICIES = ("fifo", "tiresias", "gavel", "tidal-hetero", "tidal-hetero-agnostic")
SLOT_S = 60.0


def workload_files(spec: str, data: Path) -> list[Path]:
    """``saturn`` (every workload of a suite, by number) or ``saturn/workload-1``."""
    out: list[Path] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        path = data / "workloads" / part
        if path.is_dir():
            out += sorted(path.glob("workload-*.csv"), key=lambda p: int(p.stem.split("-")[-1]))
        elif path.with_suffix(".csv").is_file():
            out.append(path.with_suffix(".csv"))
        else:
            raise SystemExit(f"no workload {part!r} under {data / 'workloads'}")
    return out


def run_case(workload: str, policy: str, cluster_spec: str) -> dict:
    """One simulation: the workload's jobs and fitted profiles on the cluster."""
    from tidal.core.overhead import OverheadModel
    from tidal.core.topology import parse_cluster
    from tidal.scheduler.registry import get_policy_for_slot
    from tidal.sim.engine import Simulator
    from tidal.sim.metrics import summarize
    from tidal.sim.sia import data_for, workload_profiles
    from tidal.sim.traces import load_trace

    path = Path(workload)
    cluster = parse_cluster(cluster_spec)
    data = data_for(path)
    trace = load_trace(path, "pollux", elastic=True, data_dir=data.root)
    profiles = workload_profiles(trace.jobs, cluster, data)
    pol = get_policy_for_slot(policy, SLOT_S)
    took: list[float] = []  # CPU seconds of each call of the policy (its decision latency at this scale)
    schedule = pol.schedule

    def timed(snap):  # type: ignore[no-untyped-def]
        t0 = time.process_time()
        try:
            return schedule(snap)
        finally:
            took.append(time.process_time() - t0)

    pol.schedule = timed  # type: ignore[method-assign]
    sim = Simulator(cluster, pol, trace.jobs, profiles=profiles,
                    overheads=OverheadModel(mode="stop-free"), slot=SLOT_S)
    res = sim.run()
    took.sort()
    s = summarize(res)
    return {
        "suite": path.parent.name, "workload": path.stem, "policy": policy, "cluster": cluster_spec,
        "jobs": s["jobs"], "finished": s["finished"],
        "avg_jct_s": round(s["avg_jct"], 1) if s["avg_jct"] is not None else None,
        "p99_jct_s": round(s["p99_jct"], 1) if s["p99_jct"] is not None else None,
        "makespan_s": round(s["makespan"], 1) if s["makespan"] is not None else None,
        "gpu_hours": round(res.busy_gpu_s / 3600.0, 2),
        "preemptions": s["preemptions"], "rescales": s["rescales"], "migrations": s["migrations"],
        "wall_s": round(res.wall_seconds, 2), "gpus": cluster.num_gpus, "decisions": len(took),
        "decision_p95_ms": round(1000 * took[int(0.95 * (len(took) - 1))], 2) if took else None,
        "decision_max_ms": round(1000 * took[-1], 2) if took else None,
    }


def summary(rows: list[dict]) -> dict:
    """Per suite: each policy's mean average JCT, and the study's two checks."""
    out: dict = {}
    for suite in sorted({r["suite"] for r in rows}):
        mine = [r for r in rows if r["suite"] == suite and r["avg_jct_s"] is not None]
        by: dict[str, dict[str, float]] = {}
        for r in mine:
            by.setdefault(r["policy"], {})[r["workload"]] = r["avg_jct_s"]
        mean = {p: round(sum(v.values()) / len(v), 1) for p, v in by.items()}
        entry: dict = {"workloads": len({r["workload"] for r in mine}), "mean_avg_jct_s": mean}
        hetero, blind, gavel = by.get("tidal-hetero"), by.get("tidal-hetero-agnostic"), by.get("gavel")
        if hetero and blind:
            entry["hetero_vs_agnostic"] = round(mean["tidal-hetero"] / mean["tidal-hetero-agnostic"] - 1.0, 3)
            entry["hetero_25pct_below_agnostic"] = entry["hetero_vs_agnostic"] <= -0.25
        if hetero and gavel:
            worse = sorted(w for w in hetero if w in gavel and hetero[w] > gavel[w])
            entry["hetero_not_above_gavel"] = not worse
            entry["hetero_above_gavel_on"] = worse
        out[suite] = entry
    return out


def plot(rows: list[dict], out: Path) -> None:
    """Mean average JCT per suite and policy (bars), one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = sorted({r["suite"] for r in rows})
    policies = [p for p in POLICIES if any(r["policy"] == p for r in rows)]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / max(1, len(policies))
    for k, pol in enumerate(policies):
        means = []
        for suite in suites:
            v = [r["avg_jct_s"] for r in rows if r["suite"] == suite and r["policy"] == pol and r["avg_jct_s"]]
            means.append(sum(v) / len(v) / 3600.0 if v else 0.0)
        ax.bar([i + k * width for i in range(len(suites))], means, width, label=pol)
    ax.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(suites))], suites)
    ax.set_ylabel("mean average JCT (h)")
    ax.set_title("Sia's cluster 6xT4:4,2xA100:8,3xRTX2080Ti:8")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="saturn", help="suites or suite/workload-N, comma separated")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--cluster", default=CLUSTER)
    ap.add_argument("--data", type=Path, default=DATA, help="the Sia data folder (workloads/, traces/)")
    ap.add_argument("--procs", type=int, default=2, help="worker processes (at most 2)")
    ap.add_argument("--json", action="store_true", help="one JSON line per case, then a summary line")
    ap.add_argument("--from-jsonl", type=Path, default=None, help="read the cases' lines from this file, run nothing")
    ap.add_argument("--plot", type=Path, default=None, help="also draw the mean average JCTs into this PNG")
    args = ap.parse_args(argv)
    if args.from_jsonl is not None:
        rows = [json.loads(line) for line in args.from_jsonl.read_text().splitlines() if '"suite"' in line]
        if args.plot:
            plot(rows, args.plot)
        print(json.dumps({"summary": summary(rows)}))
        return 0
    files = workload_files(args.workloads, args.data)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    cases = [(str(f), p) for f in files for p in policies]
    rows: list[dict] = []
    with ProcessPoolExecutor(max_workers=max(1, min(args.procs, 2))) as pool:
        futures = [pool.submit(run_case, f, p, args.cluster) for f, p in cases]
        for fut in futures:
            row = fut.result()
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{row['suite']:>9} {row['workload']:>12} {row['policy']:>22}  avg JCT {row['avg_jct_s']:>9} s"
                      f"  p99 {row['p99_jct_s']:>9} s  makespan {row['makespan_s']:>9} s  {row['gpu_hours']:>8} GPU·h",
                      flush=True)
    summ = summary(rows)
    if args.plot:
        plot(rows, args.plot)
    print(json.dumps({"summary": summ}) if args.json else json.dumps(summ, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
