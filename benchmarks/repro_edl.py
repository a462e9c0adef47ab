"""Reproduce EDL Table 3: Tiresias vs Elastic-Tiresias JCT on the Philly trace.

    python benchmarks/repro_edl.py [--clusters n256g8,n64g8]

EDL (§5.1, Table 3) reports Elastic-Tiresias cutting mean JCT by 89.5%,
median by 48% and p95 by 95% against Tiresias. The Philly trace needs a model
per job (seeded; docs/traces.md). n256g8 (2,048 GPUs) is the issue's scale
setting and is lightly loaded (~18% of GPU time); n64g8 (512 GPUs) is a busy
cluster where queueing — what elasticity removes — matters.
Writes docs/results/edl_table3.{md,json,png}.
"""

from __future__ import annotations

import argparse
import sys

from repro_common import DATA, RESULTS, Case, markdown_table, plt, run_cases, save

PAPER = {"avg_jct": -89.5, "median_jct": -48.0, "p95_jct": -95.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--clusters", default="n256g8,n64g8")
    ap.add_argument("--procs", type=int, default=None)
    args = ap.parse_args()
    trace = str(DATA / "traces" / "philly.csv")
    clusters = args.clusters.split(",")
    cases = [Case(f"philly/{c}", p, c, trace=trace) for c in clusters for p in ("tiresias", "elastic-tiresias", "tidal")]
    res = run_cases(cases, procs=args.procs)
    by = {(r["cluster"], r["policy"]): r for r in res}
    rows = []
    for c in clusters:
        base, el, td = by[(c, "tiresias")], by[(c, "elastic-tiresias")], by[(c, "tidal")]
        for k, name in (("avg_jct", "mean"), ("median_jct", "median"), ("p95_jct", "p95")):
            change = 100 * (el[k] - base[k]) / base[k]
            rows.append([c, name, base[k], el[k], f"{change:+.1f}%", f"{PAPER[k]:+.1f}%", td[k],
                         f"{100 * (td[k] - base[k]) / base[k]:+.1f}%"])
    table = markdown_table(rows, ["cluster", "JCT", "tiresias (s)", "elastic-tiresias (s)", "change", "EDL Table 3",
                                  "tidal (s)", "tidal change"])
    print(table)
    save("edl_table3", res, table, " ".join(["python", *sys.argv]))
    p = plt()
    fig, axes = p.subplots(1, len(clusters), figsize=(4.5 * len(clusters), 3.5), squeeze=False)
    for ax, c in zip(axes[0], clusters):
        keys = ["avg_jct", "median_jct", "p95_jct"]
        xs = range(len(keys))
        for off, pol in ((-0.27, "tiresias"), (0.0, "elastic-tiresias"), (0.27, "tidal")):
            ax.bar([x + off for x in xs], [by[(c, pol)][k] / 3600 for k in keys], 0.27, label=pol)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(["mean", "median", "p95"])
        ax.set_yscale("log")
        ax.set_ylabel("JCT (hours, log)")
        ax.set_title(f"Philly on {c}")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(RESULTS / "edl_table3.png", dpi=120)


if __name__ == "__main__":
    main()
