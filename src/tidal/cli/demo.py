"""``tidal demo``: the README's main job.

Until the live cluster (control plane + agents) exists, the demo runs a short
simulation comparison on an embedded synthetic workload and the shipped A100
profiles, and says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from tidal.cli.main import app


@app.command()
def demo(
    jobs: int = typer.Option(200, "--jobs", help="Synthetic jobs to submit."),
    cluster: str = typer.Option("n4g8", "--cluster", help="Cluster spec."),
    seed: int = typer.Option(1, "--seed"),
    out: Path = typer.Option(Path("out/demo"), "--out"),
) -> None:
    """Compare the built-in policies on an embedded synthetic workload."""
    from tidal.cli.simulate import results_table, run_policies
    from tidal.core.topology import parse_cluster
    from tidal.scheduler.api import policy_names
    from tidal.sim.metrics import summarize, write_outputs
    from tidal.sim.traces import poisson_jobs

    con = Console(width=None if sys.stdout.isatty() else 160)
    con.print(
        "[bold]Tidal demo[/] — simulation mode: the live cluster (server + agents) is not built yet,\n"
        "so this runs every built-in policy on a synthetic Poisson workload in the simulator."
    )
    topo = parse_cluster(cluster)
    tr = poisson_jobs(jobs, rate_per_hour=12.0, seed=seed, deadline_factor=2.0)
    con.print(f"workload: {tr.describe()}")
    con.print(f"cluster: {topo.name} ({topo.num_gpus} virtual GPUs)")
    results = run_policies(list(tr.jobs), topo, policy_names(), console=con)
    con.print(results_table([summarize(r) for r in results], "policies on the demo workload"))
    write_outputs(results, out)
    con.print(f"plots and per-job CSVs in {out}/")
