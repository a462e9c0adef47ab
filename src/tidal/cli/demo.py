"""``tidal demo``: the README's main job.

By default it starts an embedded cluster (a server and two agents with four
virtual GPUs each, all on this machine), submits a small mixed workload of
real elastic training jobs (PyTorch on CPU, gloo), shows the scheduler
reshaping them live (also in the web dashboard, whose URL it prints), and
ends with a summary; ``--keep`` keeps the cluster up afterwards until Ctrl-C. ``--sim`` instead compares every
built-in policy in the simulator on a synthetic workload.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from tidal.cli.app import app
from tidal.cli.tables import LineConsole

DONE = ("completed", "failed", "cancelled", "dropped")
COLORS = ["cyan", "magenta", "green", "yellow", "blue", "red"]


def _workload(script: str, rec: Path) -> list[tuple[float, dict]]:
    """(delay after the previous submission, spec): a long elastic job first
    (on all 8 GPUs), then two short jobs with tight deadlines and a rigid one:
    under EDF the long job shrinks for them (8 -> 4 -> 2 GPUs, never
    suspended: together they leave it 2) and grows back as they finish."""

    def spec(name, samples, epochs, gpus, deadline, elastic=True, st=0.01):
        return {"name": name, "script": script, "gpus": gpus, "iterations": samples * epochs // 64,
                "deadline": deadline, "elastic": elastic,
                "args": ["--samples", str(samples), "--epochs", str(epochs), "--sample-time", str(st),
                         "--record", str(rec / name)]}

    return [
        (0.0, spec("resnet-ish", 4096, 4, "1-8", 3600)),
        (20.0, spec("urgent-small", 1024, 1, "1-2", 300)),
        (0.0, spec("urgent-medium", 1024, 2, "1-2", 600)),
        (10.0, spec("rigid-pair", 1024, 1, 2, 1800, elastic=False)),
    ]


def _gpu_map(cluster: dict, colors: dict[str, str]) -> Table:
    t = Table(title="GPUs", show_header=False, box=None)
    for n in cluster["nodes"]:
        cells = []
        for g in n["gpus"]:
            j = g["job"]
            cells.append(f"[{colors.get(j, 'white')}]■[/]" if j else "[dim]□[/]")
        t.add_row(n["name"], " ".join(cells))
    return t


def rescales(j: dict) -> tuple[int, int]:
    """(shrinks, grows) the job's workers went through: the group changes
    that took effect (``progress.changes``, each with its measured pause); a
    grow still in flight when the job ended is not one."""
    sizes = [(int(ch.get("from_size") or 0), int(ch.get("to_size") or 0))
             for ch in (j.get("progress") or {}).get("changes") or () if isinstance(ch, dict)]
    return sum(b < a for a, b in sizes), sum(b > a for a, b in sizes)


def _jobs_table(jobs: list[dict], colors: dict[str, str], t0: float) -> Table:
    t = Table(title=f"jobs (t = {time.time() - t0:5.1f} s)")
    for c in ("job", "state", "GPUs", "progress", "shrinks", "grows"):
        t.add_column(c)
    for j in jobs:
        col = colors.get(j["id"], "white")
        pct = 100 * j["step"] / max(1, j["iterations"] or 1)
        down, up = rescales(j)
        t.add_row(f"[{col}]{j['id']}[/]", j["state"], str(len(j["gpus"])), f"{pct:5.1f}%", str(down), str(up))
    return t


def _summary(api, ids: list[str]) -> tuple[Table, bool]:
    """The summary table (each job's completion time, wait, shrinks, grows and
    the pauses its workers measured) and whether every job completed."""
    t = Table(title="summary")
    for c in ("job", "state", "JCT s", "wait s", "shrinks", "grows", "pauses (ms)"):
        t.add_column(c)
    ok = True
    for jid in ids:
        j = api.job(jid)
        changes = (j.get("progress") or {}).get("changes", [])
        pauses = ", ".join(f"{1e3 * ch.get('pause_s', 0):.0f}" for ch in changes) or "-"
        jct = (j["end_time"] - j["submit_time"]) if j["end_time"] else None
        wait = (j["start_time"] - j["submit_time"]) if j["start_time"] else None
        down, up = rescales(j)
        t.add_row(jid, j["state"], f"{jct:.1f}" if jct else "-", f"{wait:.1f}" if wait else "-",
                  str(down), str(up), pauses)
        ok = ok and j["state"] == "completed"
    return t, ok


def _dashboard_banner(con: Console, url: str, home: Path, tenant_token: str) -> None:
    """Where the web dashboard is and how to log in (docs/dashboard.md)."""
    con.print(f"[bold]Dashboard:[/] {url}/dashboard/  (open it in a browser on this machine)\n"
              f"  log in with the admin token in {home / 'admin.token'} (every job),\n"
              f"  or as the demo's tenant with: [bold]{tenant_token}[/]")


def _keep_up(con: Console, url: str) -> None:
    """Keep the cluster (and its dashboard) up until Ctrl-C."""
    con.print(f"the cluster stays up (--keep): dashboard at {url}/dashboard/, API at {url}; Ctrl-C stops it")
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        con.print("stopping the cluster")


def live_demo(con: Console, home: Optional[Path], policy: str, timeout_s: float, keep: bool = False) -> int:
    """The live demo; ``keep``: the cluster stays up after the jobs until Ctrl-C."""
    import tidal.control.demo_job as demo_job
    from tidal.control.local import LocalCluster

    tmp = tempfile.TemporaryDirectory(prefix="tidal-demo-") if home is None else None
    root = Path(tmp.name) if tmp else Path(home)
    con.print("[bold]Tidal demo[/] — an embedded cluster on this machine: a server and 2 agents × 4 virtual GPUs;\n"
              f"real elastic PyTorch jobs (CPU, gloo) scheduled by the [bold]{policy}[/] policy. State in {root}")
    cluster = LocalCluster(root / "home", nodes=2, gpus_per_node=4, policy=policy, tick_s=1.0)
    t0 = time.time()
    import signal

    def _term(*_args) -> None:  # `kill` stops the embedded cluster too
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    colors: dict[str, str] = {}
    ids: list[str] = []
    rc = 0
    try:
        with con.status("starting server and agents…"):
            cluster.start()
        token = cluster.api().add_user("demo", rotate=True)
        api = cluster.api(token)
        _dashboard_banner(con, cluster.url, cluster.home, token)
        plan = _workload(demo_job.__file__, root / "records")
        next_at = time.time()
        with Live(console=con, refresh_per_second=4, transient=False) as live:
            while True:
                if plan and time.time() >= next_at:
                    _, spec = plan.pop(0)
                    jid = api.submit(spec)["id"]
                    ids.append(jid)
                    colors[jid] = COLORS[len(colors) % len(COLORS)]
                    next_at = time.time() + (plan[0][0] if plan else 0)
                jobs = [api.job(j["id"]) for j in api.jobs()]  # with their progress (group changes)
                live.update(Group(_gpu_map(api.cluster(), colors), _jobs_table(jobs, colors, t0)))
                if not plan and jobs and all(j["state"] in DONE for j in jobs):
                    break
                if time.time() - t0 > timeout_s:
                    con.print("[red]demo timed out[/]")
                    rc = 1
                    break
                time.sleep(0.5)
        con.print()
        summary, ok = _summary(api, ids)
        rc = rc or (0 if ok else 1)
        con.print(summary)
        where = (f"; its state and logs stay in {root / 'home'}" if tmp is None
                 else " (run it with --home DIR to keep the cluster's state and logs)")
        con.print(f"demo finished in {time.time() - t0:.0f} s{where}")
        if keep:
            _keep_up(con, cluster.url)
    finally:
        cluster.stop()
        if tmp:
            tmp.cleanup()
    return rc


def sim_demo(con: Console, jobs: int, cluster: str, seed: int, out: Path) -> None:
    from tidal.cli.simulate import results_table, run_policies
    from tidal.core.topology import parse_cluster
    from tidal.scheduler.registry import policy_names
    from tidal.sim.metrics import summarize, write_outputs
    from tidal.sim.traces import poisson_jobs

    con.print("[bold]Tidal demo[/] — simulation mode: every built-in policy on a synthetic Poisson workload.")
    topo = parse_cluster(cluster)  # checked by the command (a bad spec is one line, exit 2)
    tr = poisson_jobs(jobs, rate_per_hour=12.0, seed=seed, deadline_factor=2.0)
    con.print(f"workload: {tr.describe()}")
    con.print(f"cluster: {topo.name} ({topo.num_gpus} virtual GPUs)")
    results = run_policies(list(tr.jobs), topo, policy_names(), console=con)
    con.print(results_table([summarize(r) for r in results], "policies on the demo workload"))
    try:
        write_outputs(results, out)
    except OSError as e:
        _fail(f"--out {out}: cannot write the plots and CSVs there ({e.strerror or e})", 1)
    con.print(f"plots and per-job CSVs in {out}/")


def _fail(msg: str, code: int = 2) -> None:
    LineConsole(stderr=True).print("[red]error:[/] " + escape(msg))
    raise typer.Exit(code)


def _check(sim: bool, policy: str, timeout: float, jobs: int, cluster: str, out: Path) -> None:
    """Refuse unusable options before anything starts, in one line each."""
    from difflib import get_close_matches

    from tidal.core.errors import InputError
    from tidal.core.topology import parse_cluster
    from tidal.scheduler.registry import get_policy, policy_names

    if sim:
        if jobs < 1:
            _fail(f"--jobs {jobs}: the synthetic workload needs at least 1 job")
        try:
            parse_cluster(cluster)
        except (InputError, ValueError) as e:
            _fail(f"--cluster {cluster}: {getattr(e, 'reason', e)}")
        if out.exists() and not out.is_dir():
            _fail(f"--out {out}: a file, not a directory")
        return
    try:
        get_policy(policy)
    except ValueError:
        near = get_close_matches(policy, policy_names(), n=1)
        _fail(f"--policy {policy}: unknown policy" + (f"; did you mean {near[0]}?" if near else "")
              + f" (known: {', '.join(policy_names())})")
    if not timeout > 0:
        _fail(f"--timeout {timeout:g}: give a number of seconds above 0")


@app.command()
def demo(
    sim: bool = typer.Option(False, "--sim", metavar="", help="Simulation comparison instead of the live cluster."),
    policy: str = typer.Option("edf", "--policy", help="Live mode: scheduling policy."),
    home: Optional[Path] = typer.Option(None, "--home", help="Live mode: keep state here (default: a temp dir)."),
    timeout: float = typer.Option(300.0, "--timeout", help="Live mode: give up after this many seconds."),
    jobs: int = typer.Option(200, "--jobs", help="Sim mode: synthetic jobs."),
    cluster: str = typer.Option("n4g8", "--cluster", help="Sim mode: cluster spec."),
    seed: int = typer.Option(1, "--seed", help="Seed of the demo's workload (--sim)."),
    out: Path = typer.Option(Path("out/demo"), "--out", help="Sim mode: output directory."),
    keep: bool = typer.Option(False, "--keep", metavar="", help="Live mode: keep the cluster and its dashboard up after the "
                                                    "jobs finish, until Ctrl-C."),
) -> None:
    """Run real elastic jobs on an embedded cluster and watch them reshape (or --sim)."""
    con = Console(width=None if sys.stdout.isatty() else 160)
    _check(sim, policy, timeout, jobs, cluster, out)
    if sim:
        sim_demo(con, jobs, cluster, seed, out)
        return
    raise typer.Exit(live_demo(con, home, policy, timeout, keep))
