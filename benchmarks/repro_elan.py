"""Reproduce Elan Fig. 20/22: FIFO, E-FIFO, Backfill, E-Backfill — pending
time, JCT and makespan, with stop-free (Elan) and stop-resume rescaling.

    python benchmarks/repro_elan.py [--trace 195job --cluster n16g8]

Elan evaluated on its own production trace; we use the ITP ``195job`` trace
(195 jobs over two days, ~115 GPUs of demand) on 128 GPUs, a busy cluster.
Writes docs/results/elan_fig20.{md,json,png}.
"""

from __future__ import annotations

import argparse
import sys

from repro_common import DATA, RESULTS, Case, markdown_table, plt, run_cases, save

POLICIES = ["fifo", "e-fifo", "backfill", "e-backfill", "tidal"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", default="195job")
    ap.add_argument("--cluster", default="n16g8")
    ap.add_argument("--procs", type=int, default=None)
    args = ap.parse_args()
    path = str(DATA / "traces" / "itp" / f"{args.trace}.csv")
    cases = [Case(args.trace, p, args.cluster, trace=path, overhead=o)
             for o in ("stop-free", "stop-resume") for p in POLICIES]
    res = run_cases(cases, procs=args.procs)
    rows = [[r["overhead"], r["policy"], r["avg_pending"], r["avg_jct"], r["makespan"], r["rescales"],
             r.get("overhead_gpu_s")] for r in res]
    table = markdown_table(rows, ["rescaling", "policy", "avg pending (s)", "avg JCT (s)", "makespan (s)",
                                  "rescales", "GPU·s lost to rescaling"])
    print(table)
    save("elan_fig20", res, table, " ".join(["python", *sys.argv]))
    p = plt()
    fig, axes = p.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, name in zip(axes, ("avg_pending", "avg_jct", "makespan"), ("avg pending", "avg JCT", "makespan")):
        for k, mode in enumerate(("stop-free", "stop-resume")):
            vals = [next(r[key] for r in res if r["policy"] == pol and r["overhead"] == mode) / 3600 for pol in POLICIES]
            ax.bar([i + (k - 0.5) * 0.4 for i in range(len(POLICIES))], vals, 0.4, label=mode)
        ax.set_xticks(range(len(POLICIES)))
        ax.set_xticklabels(POLICIES)
        ax.set_title(f"{name} (hours)")
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(RESULTS / "elan_fig20.png", dpi=120)


if __name__ == "__main__":
    main()
