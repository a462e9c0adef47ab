"""Contended deadline study: where the deadline policies differ.

    python benchmarks/contended_study.py                 # the whole study, rich tables
    python benchmarks/contended_study.py --json          # one JSON line
    python benchmarks/contended_study.py --markdown      # the tables of docs/results.md
    python benchmarks/contended_study.py --quick         # cluster10; elasticflow, tidal, edf
    python benchmarks/contended_study.py --artifact-traces cluster10,195job   # artifact mode on these only

Method (docs/results.md, "Contended study"):

1. **Best-effort share.** In every trace, ``round(0.3 * jobs)`` jobs drawn
   with ``numpy.random.default_rng(0).choice(n, k, replace=False)`` (indices
   in trace order) lose their deadline (``JobSpec.deadline = None``) and become
   best-effort jobs; the others keep theirs.
2. **Cluster size, per trace and per fidelity mode.** Start at the trace's
   public size (ElasticFlow Fig. 8(b): n64g8 for cluster01/05, n32g8 for
   cluster10 and philly_103959; n16g8 for 195job) and halve it
   (``n32g8 -> n16g8 -> ... -> n1g8 -> n1g4 -> ...``) until ElasticFlow's
   deadline ratio *on this workload, in that mode* is below 0.8.
3. **Policies.** ``--fidelity tidal``: every registry policy. ``--fidelity
   artifact``: the artifact's five as ``run_artifact`` runs them
   (elasticflow and gandiva on their ported executors), plus ``tidal`` on
   the artifact's round executor with :func:`tidal_artifact_setup`
   (planned without overheads, no slack, every running job charged);
   ``--artifact-traces`` limits this mode to some traces.
4. **Metrics.** Deadline ratio over the jobs that keep a deadline (dropped =
   missed); best-effort jobs' average JCT over those that completed (with how
   many completed: a dropped or never-started job has no JCT).

60 s slots, stop-free overheads (the CLI's defaults), A100 profiles. Cases run
in ``--procs`` worker processes. Plots (``--plots DIR``, default
``docs/img/contended/``): one PNG per trace, both modes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tidal.sim.engine import SimResult

REPO = Path(__file__).resolve().parents[1]
TRACE_DIR = REPO.parent / "shared" / "data" / "traces"
DEFAULT_PLOTS = REPO / "docs" / "img" / "contended"
DATE = "2026-11-25"

#: trace name -> (path under TRACE_DIR, public cluster size the halving starts from)
TRACES: dict[str, tuple[str, str]] = {
    "cluster10": ("itp/cluster10.csv", "n32g8"),
    "philly_103959": ("philly_103959.csv", "n32g8"),
    "195job": ("itp/195job.csv", "n16g8"),
    "cluster01": ("itp/cluster01.csv", "n64g8"),
    "cluster05": ("itp/cluster05.csv", "n64g8"),
}
QUICK_TRACES = ["cluster10"]
QUICK_POLICIES = ["elasticflow", "tidal", "edf"]
MODES = ("tidal", "artifact")
#: the policies the ElasticFlow artifact has, plus tidal under ElasticFlow's artifact setup
ARTIFACT_POLICIES = ["elasticflow", "tidal", "edf", "tiresias", "themis", "gandiva"]
BE_SHARE = 0.3
SEED = 0
THRESHOLD = 0.8
SLOT = 60.0


# -- workload ---------------------------------------------------------------


def halve(cluster: str) -> str | None:
    """The next smaller size: half the nodes, then (at one node) half the
    GPUs per node; None below one GPU. ``n32g8 -> n16g8``, ``n1g8 -> n1g4``."""
    body = cluster.removeprefix("n")
    nodes, gpus = (int(x) for x in body.split("g"))
    if nodes > 1:
        return f"n{nodes // 2}g{gpus}"
    if gpus > 1:
        return f"n1g{gpus // 2}"
    return None


def best_effort_split(jobs: list, share: float = BE_SHARE, seed: int = SEED) -> tuple[list, frozenset[str]]:
    """``round(share * len(jobs))`` jobs, drawn with ``seed``, lose their
    deadline; returns the new job list (same order) and their ids."""
    import numpy as np

    k = round(share * len(jobs))
    picked = set(np.random.default_rng(seed).choice(len(jobs), size=k, replace=False).tolist())
    out = [dataclasses.replace(j, deadline=None) if i in picked else j for i, j in enumerate(jobs)]
    return out, frozenset(jobs[i].job_id for i in picked)


def trace_path(trace: str) -> Path:
    """The trace in ../shared/data, or the package's copy when the shared data lacks it (cluster10)."""
    from tidal.sim.traces import resolve_trace

    p = TRACE_DIR / TRACES[trace][0]
    return p if p.exists() else resolve_trace(trace)


@lru_cache(maxsize=None)
def workload(trace: str, share: float = BE_SHARE, seed: int = SEED) -> tuple[tuple, frozenset[str]]:
    """The study's jobs for ``trace`` (cached per process) and the best-effort ids."""
    from tidal.sim.traces import load_trace

    jobs, be = best_effort_split(list(load_trace(trace_path(trace)).jobs), share, seed)
    return tuple(jobs), be


# -- one simulation -----------------------------------------------------------


def tidal_artifact_setup() -> tuple[dict[str, Any], Any]:
    """``tidal``'s options and executor semantics in artifact mode, as close
    to the artifact's ElasticFlow as a registry policy gets: planned without
    overheads, no migration slack; every running job charged each round, the
    last round's overhead not counted against the deadline. (The artifact's
    own ElasticFlow loop, tidal.sim.artifact_ef, is not a policy: it also
    declines a round's arrivals together.)"""
    from tidal.core.overhead import OverheadModel
    from tidal.sim.artifact import ArtifactSemantics

    none = OverheadModel(mode="stop-free", pause_s=0.0, warmup_s=0.0, stop_resume_s=0.0, launch_s=0.0)
    return ({"assumed_overheads": none, "reserve_rescales": 0.0},
            ArtifactSemantics(slot=SLOT, charge="all", last_overhead_counts=False))


def simulate(jobs: list, cluster: str, policy: str, mode: str) -> "SimResult":
    """One run. Artifact mode runs ``tidal`` (which the artifact lacks) with
    :func:`tidal_artifact_setup`, every other policy as ``run_artifact`` does."""
    from tidal.core.topology import parse_cluster
    from tidal.sim.artifact import ArtifactSimulator, simulate_fidelity

    topo = parse_cluster(cluster)
    if mode == "artifact" and policy == "tidal":
        from tidal.core.profile import load_profiles
        from tidal.scheduler.registry import get_policy_for_slot

        options, sem = tidal_artifact_setup()
        pol = get_policy_for_slot("tidal", SLOT, **options)
        return ArtifactSimulator(topo, pol, jobs, load_profiles(), sem).run()
    return simulate_fidelity(jobs, topo, policy, slot=SLOT, fidelity=mode)


def run_case(trace: str, cluster: str, policy: str, mode: str) -> dict[str, Any]:
    """Simulate one (trace, cluster, policy, mode); the study's metrics."""
    from tidal.sim.metrics import job_rows

    t0 = time.perf_counter()
    jobs, be = workload(trace)
    rows = job_rows(simulate(list(jobs), cluster, policy, mode))
    ddl = [r for r in rows if r["job_id"] not in be]
    ber = [r for r in rows if r["job_id"] in be]
    jcts = [r["jct"] for r in ber if r["jct"] is not None]
    return {
        "trace": trace, "cluster": cluster, "policy": policy, "mode": mode,
        "deadline_jobs": len(ddl),
        "deadline_met": sum(1 for r in ddl if r["met_deadline"]),
        "deadline_ratio": sum(1 for r in ddl if r["met_deadline"]) / len(ddl) if ddl else None,
        "deadline_dropped": sum(1 for r in ddl if r["state"] == "dropped"),
        "be_jobs": len(ber),
        "be_completed": len(jcts),
        "be_dropped": sum(1 for r in ber if r["state"] == "dropped"),
        "be_avg_jct": sum(jcts) / len(jcts) if jcts else None,
        "be_median_jct": sorted(jcts)[len(jcts) // 2] if jcts else None,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def find_size(trace: str, mode: str, threshold: float = THRESHOLD) -> dict[str, Any]:
    """Halve from the public size until ElasticFlow's deadline ratio is below
    ``threshold``; the smallest size tried if it never is (``reached`` False)."""
    cluster: str | None = TRACES[trace][1]
    probes: list[tuple[str, float]] = []
    last: dict[str, Any] = {}
    while cluster is not None:
        last = run_case(trace, cluster, "elasticflow", mode)
        probes.append((cluster, last["deadline_ratio"]))
        if last["deadline_ratio"] < threshold:
            break
        cluster = halve(cluster)
    return {"trace": trace, "mode": mode, "cluster": probes[-1][0], "probes": probes,
            "reached": probes[-1][1] < threshold, "elasticflow": last}


# -- the study ----------------------------------------------------------------


def mode_policies(mode: str, policies: list[str]) -> list[str]:
    return [p for p in policies if mode == "tidal" or p in ARTIFACT_POLICIES]


def run_study(traces: list[str], policies: list[str], procs: int, quiet: bool = False,
              artifact_traces: list[str] | None = None) -> dict[str, Any]:
    """Sizes first (in parallel per trace and mode), then every policy at them.
    ``artifact_traces``: the traces run in artifact mode (default: all)."""
    t0 = time.perf_counter()
    art = traces if artifact_traces is None else [t for t in traces if t in artifact_traces]
    pairs = [(t, m) for t in traces for m in MODES if m == "tidal" or t in art]
    with ProcessPoolExecutor(max_workers=procs) as pool:
        sized = [pool.submit(find_size, t, m) for t, m in pairs]
        sizes = {(s["trace"], s["mode"]): s for s in (f.result() for f in sized)}
        if not quiet:
            for s in sizes.values():
                probes = ", ".join(f"{c} {r:.3f}" for c, r in s["probes"])
                print(f"size {s['trace']} [{s['mode']}]: {s['cluster']} ({probes})", file=sys.stderr, flush=True)
        # ElasticFlow at the chosen size is the search's last probe
        cases = [(t, sizes[(t, m)]["cluster"], p, m) for t, m in pairs for p in mode_policies(m, policies)
                 if p != "elasticflow"]
        # the largest traces first, so the pool's last cases are short
        order = sorted(range(len(cases)), key=lambda i: -trace_path(cases[i][0]).stat().st_size)
        futs: dict[int, Future] = {i: pool.submit(run_case, *cases[i]) for i in order}
        done: dict[int, dict[str, Any]] = {}
        for i in order:
            res = done[i] = futs[i].result()
            if not quiet:
                print(f"[{len(done)}/{len(cases)}] {res['trace']} {res['mode']} {res['policy']} "
                      f"{res['wall_s']:.1f}s", file=sys.stderr, flush=True)
    ef = [sizes[p].pop("elasticflow") for p in pairs]
    results = (ef if "elasticflow" in policies else []) + [done[i] for i in range(len(cases))]
    return {
        "benchmark": "contended_study", "date": DATE, "be_share": BE_SHARE, "seed": SEED,
        "threshold": THRESHOLD, "slot": SLOT, "traces": traces, "artifact_traces": art, "policies": policies,
        "sizes": [sizes[p] for p in pairs], "results": results,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


# -- output -------------------------------------------------------------------


def _hours(v: float | None) -> str:
    return "–" if v is None else f"{v / 3600:.2f}"


def _ratio(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def _cell(r: dict[str, Any] | None, metric: str) -> str:
    """``ratio``: the deadline ratio; ``jct``: best-effort average JCT in
    hours, with ``(completed/all)`` when not every best-effort job completed."""
    if r is None:
        return "–"
    if metric == "ratio":
        return _ratio(r["deadline_ratio"])
    cell = _hours(r["be_avg_jct"])
    return cell + (f" ({r['be_completed']}/{r['be_jobs']})" if r["be_completed"] < r["be_jobs"] else "")


def grid(study: dict[str, Any], mode: str, metric: str = "both") -> tuple[list[str], list[list[str]]]:
    """One row per trace: its size, then per policy the ``metric`` cell
    (``both``: ``ratio / BE JCT h``)."""
    by = {(r["trace"], r["policy"]): r for r in study["results"] if r["mode"] == mode}
    pols = [p for p in mode_policies(mode, study["policies"]) if any(k[1] == p for k in by)]
    size = {s["trace"]: s["cluster"] for s in study["sizes"] if s["mode"] == mode}
    rows = []
    for t in study["traces"]:
        cells = [by.get((t, p)) for p in pols]
        if metric == "both":
            row = [f"{_cell(r, 'ratio')} / {_cell(r, 'jct')}" if r else "–" for r in cells]
        else:
            row = [_cell(r, metric) for r in cells]
        if t in size:
            rows.append([t, size[t], *row])
    return ["trace", "cluster", *pols], rows


def markdown(study: dict[str, Any]) -> str:
    """Per mode, a deadline-ratio table and a best-effort JCT table."""
    titles = {"ratio": "deadline ratio (jobs with a deadline)",
              "jct": "best-effort average JCT, hours (completed/all when some did not complete)"}
    out = []
    for mode in MODES:
        for metric, title in titles.items():
            head, rows = grid(study, mode, metric)
            out.append(f"`--fidelity {mode}` — {title}\n")
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "---|" * len(head))
            out += ["| " + " | ".join(r) + " |" for r in rows]
            out.append("")
    if "tidal" in study["policies"] and "elasticflow" in study["policies"]:
        out += ["`tidal` against `elasticflow`\n", versus(study), ""]
    return "\n".join(out)


def versus(study: dict[str, Any], a: str = "tidal", b: str = "elasticflow") -> str:
    """Markdown: per mode and trace, ``b -> a`` on deadline ratio and
    best-effort JCT, and whether ``a`` meets at least ``b``'s ratio with a
    lower best-effort JCT over at least as many completed jobs."""
    by = {(r["mode"], r["trace"], r["policy"]): r for r in study["results"]}
    out = [f"| mode | trace | ratio {b} → {a} | BE JCT h {b} → {a} (completed) | holds |", "|---|---|---|---|---|"]
    for mode in MODES:
        for t in study["traces"]:
            x, y = by.get((mode, t, b)), by.get((mode, t, a))
            if x is None or y is None or x["be_avg_jct"] is None or y["be_avg_jct"] is None:
                continue
            ratio_ok = y["deadline_ratio"] >= x["deadline_ratio"]
            jct_ok = y["be_avg_jct"] < x["be_avg_jct"] and y["be_completed"] >= x["be_completed"]
            why = "yes" if ratio_ok and jct_ok else ", ".join(
                w for w, bad in (("ratio", not ratio_ok), ("BE JCT", not jct_ok)) if bad)
            jct = f"{_hours(x['be_avg_jct'])} → {_hours(y['be_avg_jct'])} ({x['be_completed']} → {y['be_completed']})"
            out.append(f"| {mode} | {t} | {_ratio(x['deadline_ratio'])} → {_ratio(y['deadline_ratio'])} | {jct} | {why} |")
    return "\n".join(out)


def print_rich(study: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 200)
    titles = {"ratio": "deadline ratio", "jct": "best-effort avg JCT (h)"}
    for mode in MODES:
        for metric, title in titles.items():
            head, rows = grid(study, mode, metric)
            table = Table(title=f"--fidelity {mode}: {title}")
            for h in head:
                table.add_column(h, justify="left" if h in ("trace", "cluster") else "right")
            for r in rows:
                table.add_row(*r)
            con.print(table)
    sizes = "; ".join(f"{s['trace']} ({s['mode']}) {s['cluster']}" for s in study["sizes"])
    con.print(f"sizes: {sizes}\nwall: {study['wall_s']} s", markup=False)


def _bars(ax: Any, names: list[str], vals: list[float | None], ylabel: str, title: str) -> None:
    colors = ["tab:red" if n.startswith("tidal") else "tab:blue" if n == "elasticflow" else "tab:gray"
              for n in names]
    ax.bar(range(len(names)), [v if v is not None else 0.0 for v in vals], color=colors)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize="small")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize="medium")


def plot(study: dict[str, Any], out_dir: Path) -> list[Path]:
    """Per trace: deadline ratio and best-effort average JCT per policy, one
    row per mode (tidal, artifact)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    size = {(s["trace"], s["mode"]): s["cluster"] for s in study["sizes"]}
    paths = []
    for t in study["traces"]:
        fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), gridspec_kw={"width_ratios": [1, 1]})
        for row, mode in enumerate(MODES):
            res = [r for r in study["results"] if r["trace"] == t and r["mode"] == mode]
            if not res:
                axes[row][0].set_axis_off()
                axes[row][1].set_axis_off()
                continue
            res.sort(key=lambda r: study["policies"].index(r["policy"]))
            names = [r["policy"] for r in res]
            where = f"{mode} mode, {size[(t, mode)]}"
            _bars(axes[row][0], names, [r["deadline_ratio"] for r in res], "deadline ratio",
                  f"deadline ratio ({where})")
            axes[row][0].set_ylim(0, 1.05)
            _bars(axes[row][1], names, [None if r["be_avg_jct"] is None else r["be_avg_jct"] / 3600 for r in res],
                  "best-effort avg JCT (h, log)", f"best-effort avg JCT ({where})")
            axes[row][1].set_yscale("log")
        fig.suptitle(f"{t}: {int(study['be_share'] * 100)}% best-effort (seed {study['seed']})")
        fig.tight_layout()
        path = out_dir / f"{t}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON line (no table)")
    ap.add_argument("--markdown", action="store_true", help="print the Markdown tables")
    ap.add_argument("--quick", action="store_true", help=f"traces {QUICK_TRACES}, policies {QUICK_POLICIES}")
    ap.add_argument("--traces", default=None, help=f"comma separated, of {', '.join(TRACES)}")
    ap.add_argument("--artifact-traces", default=None,
                    help="comma separated: the traces also run in artifact mode (default: all)")
    ap.add_argument("--policies", default=None, help="comma separated (default: every registry policy)")
    ap.add_argument("--plots", type=Path, default=DEFAULT_PLOTS, help="plot directory")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                    help="re-render the tables and plots of a saved --json line instead of running")
    args = ap.parse_args(argv)
    from tidal.scheduler.registry import policy_names

    traces = args.traces.split(",") if args.traces else (QUICK_TRACES if args.quick else list(TRACES))
    policies = args.policies.split(",") if args.policies else (
        QUICK_POLICIES if args.quick else sorted(policy_names(), key=lambda p: (p != "elasticflow", p != "tidal", p)))
    bad = [t for t in traces + (args.artifact_traces.split(",") if args.artifact_traces else []) if t not in TRACES] + [p for p in policies if p not in policy_names()]
    if bad:
        ap.error(f"unknown trace or policy: {', '.join(bad)}")
    if args.from_json is not None:
        study = json.loads(args.from_json.read_text())
    else:
        art = args.artifact_traces.split(",") if args.artifact_traces else None
        study = run_study(traces, policies, args.procs, artifact_traces=art)
        study["command"] = " ".join(["python", "benchmarks/contended_study.py",
                                     *(argv if argv is not None else sys.argv[1:])])
    if not args.no_plots:
        study["plots"] = [str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)
                          for p in plot(study, args.plots)]
    if args.json:
        print(json.dumps(study), flush=True)
    elif args.markdown:
        print(markdown(study))
    else:
        print_rich(study)
    return 0


if __name__ == "__main__":
    sys.exit(main())
