"""Shared runner for the reproduction studies (benchmarks/repro_*.py).

Each study is a list of cases (trace, cluster, policy, options); cases run in
parallel worker processes (``--procs``, default: the machine's cores), each
prints one JSON line, and the study writes its table (Markdown), raw results
(JSON) and plots into ``docs/results/``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
RESULTS = REPO / "docs" / "results"


@dataclass(frozen=True)
class Case:
    label: str  # e.g. the trace name
    policy: str
    cluster: str
    trace: str | None = None  # path; None: jobs come from `workload`
    workload: str | None = None  # name of a workload factory in the study module
    seed: int = 0
    slot: float = 60.0
    overhead: str = "stop-free"
    options: tuple[tuple[str, Any], ...] = field(default=())


def run_case(case: Case, workloads: dict[str, Callable[[int], list]] | None = None) -> dict[str, Any]:
    from tidal.core.overhead import OverheadModel
    from tidal.core.topology import parse_cluster
    from tidal.scheduler.registry import get_policy_for_slot
    from tidal.sim.engine import Simulator
    from tidal.sim.metrics import summarize
    from tidal.sim.traces import load_trace

    t0 = time.perf_counter()
    if case.trace is not None:
        jobs = list(load_trace(case.trace, seed=case.seed).jobs)
    else:
        assert workloads is not None and case.workload in workloads
        jobs = workloads[case.workload](case.seed)
    sim = Simulator(
        parse_cluster(case.cluster),
        get_policy_for_slot(case.policy, case.slot, **dict(case.options)),
        jobs,
        overheads=OverheadModel(mode=case.overhead),
        slot=case.slot,
    )
    s = summarize(sim.run())
    s.update(label=case.label, seed=case.seed, overhead=case.overhead, case_wall_s=time.perf_counter() - t0)
    return s


def run_cases(
    cases: list[Case],
    workloads: dict[str, Callable[[int], list]] | None = None,
    procs: int | None = None,
) -> list[dict[str, Any]]:
    """Run every case; print one JSON line per finished case to stdout and a
    progress line to stderr. Results come back in the order of ``cases``."""
    procs = procs or os.cpu_count() or 1
    out: list[dict[str, Any] | None] = [None] * len(cases)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=procs) as pool:
        futs = {pool.submit(run_case, c, workloads): i for i, c in enumerate(cases)}
        for done, fut in enumerate(as_completed(futs), start=1):
            i = futs[fut]
            res = fut.result()
            out[i] = res
            print(json.dumps({k: res[k] for k in ("label", "policy", "cluster", "seed", "overhead", "jobs",
                                                   "finished", "dropped", "avg_jct", "median_jct", "p95_jct",
                                                   "avg_pending", "makespan", "deadline_ratio", "rescales",
                                                   "case_wall_s")}), flush=True)
            print(f"[{done}/{len(cases)}] {res['label']} {res['policy']} {res['case_wall_s']:.1f}s "
                  f"(elapsed {time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
    return [r for r in out if r is not None]


def markdown_table(rows: list[list[Any]], header: list[str]) -> str:
    def fmt(v: Any) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def save(name: str, results: list[dict[str, Any]], table: str, command: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (RESULTS / f"{name}.md").write_text(f"Command: `{command}`\n\n{table}")


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as p

    return p


def grouped_bars(path: Path, groups: list[str], series: dict[str, list[float | None]], ylabel: str, title: str) -> None:
    """One group of bars per label (trace), one bar per policy."""
    p = plt()
    fig, ax = p.subplots(figsize=(max(7, 1.3 * len(groups) + 3), 3.8))
    n = len(series)
    width = 0.8 / max(n, 1)
    for k, (name, vals) in enumerate(series.items()):
        xs = [i + (k - (n - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0 for v in vals], width, label=name)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    p.close(fig)
