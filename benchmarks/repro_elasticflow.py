"""Reproduce ElasticFlow Fig. 8(b): deadline satisfactory ratio per trace.

    python benchmarks/repro_elasticflow.py            # all traces, all policies
    python benchmarks/repro_elasticflow.py --traces cluster10,philly_103959

Cluster sizes as in the public artifact's Fig. 8(b) script: cluster01/02/03/
05/06 on n64g8, cluster10 and philly_103959 on n32g8; 60 s slots; A100
profiles. Writes docs/results/elasticflow_fig8.{md,json,png}.
"""

from __future__ import annotations

import argparse
import sys

from repro_common import DATA, RESULTS, Case, grouped_bars, markdown_table, run_cases, save

TRACES = {
    "cluster01": "n64g8", "cluster02": "n64g8", "cluster03": "n64g8", "cluster05": "n64g8",
    "cluster06": "n64g8", "cluster10": "n32g8", "philly_103959": "n32g8",
}
POLICIES = ["elasticflow", "tidal", "edf", "gandiva", "tiresias", "themis", "chronus"]
# The public artifact's own simulator's results on these traces (60 s slots,
# A100), for comparison.
REFERENCE = {
    ("cluster10", "elasticflow"): 0.962, ("cluster10", "edf"): 0.777, ("cluster10", "tiresias"): 0.477,
    ("cluster10", "themis"): 0.473, ("cluster10", "gandiva"): 0.331,
    ("philly_103959", "elasticflow"): 0.910, ("philly_103959", "tiresias"): 0.466,
    ("philly_103959", "edf"): 0.436, ("philly_103959", "gandiva"): 0.413,
}


def trace_path(name: str) -> str:
    return str(DATA / "traces" / (f"{name}.csv" if name.startswith("philly") else f"itp/{name}.csv"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--procs", type=int, default=None)
    args = ap.parse_args()
    traces = args.traces.split(",")
    policies = args.policies.split(",")
    cases = [Case(t, p, TRACES[t], trace=trace_path(t)) for t in traces for p in policies]
    res = run_cases(cases, procs=args.procs)
    by = {(r["label"], r["policy"]): r for r in res}
    rows = []
    for t in traces:
        row = [t, TRACES[t]]
        for p in policies:
            v = by[(t, p)]["deadline_ratio"]
            ref = REFERENCE.get((t, p))
            row.append(f"{v:.3f}" + (f" ({ref:.3f})" if ref is not None else ""))
        rows.append(row)
    table = markdown_table(rows, ["trace", "cluster", *policies])
    table += "\nDeadline satisfactory ratio (dropped jobs count as misses); in brackets the public artifact's figure where known.\n"
    print(table)
    save("elasticflow_fig8", res, table, " ".join(["python", *sys.argv]))
    grouped_bars(RESULTS / "elasticflow_fig8.png", traces,
                 {p: [by[(t, p)]["deadline_ratio"] for t in traces] for p in policies},
                 "deadline satisfactory ratio", "ElasticFlow Fig. 8(b) reproduction")


if __name__ == "__main__":
    main()
