"""``tidal simulate``: run policies over a trace and compare them."""

from __future__ import annotations

import dataclasses

import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.markup import escape

from tidal.cli.app import app, interruptible
from tidal.cli.checks import bounded, dir_problem
from tidal.cli.tables import LineConsole
from tidal.core.errors import InputError


def _fmt(v: Any, kind: str = "") -> str:
    if v is None:
        return "-"
    if kind == "h":
        return f"{v / 3600:.2f}"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


#: (summary key, header, format, priority: 0 always shown, higher dropped first on a narrow terminal)
RESULT_COLS = [
    ("policy", "policy", "", 0),
    ("finished", "done", "", 2),
    ("dropped", "dropped", "", 2),
    ("avg_jct", "avg JCT h", "h", 0),
    ("median_jct", "med JCT h", "h", 3),
    ("p95_jct", "p95 JCT h", "h", 3),
    ("avg_pending", "avg wait h", "h", 1),
    ("makespan", "makespan h", "h", 1),
    ("utilization", "util", "pct", 1),
    ("cluster_efficiency", "CE", "pct", 2),
    ("deadline_ratio", "deadline", "pct", 0),
    ("rescales", "rescales", "", 3),
    ("wall_seconds", "wall s", "", 4),
]


def results_table(summaries: list[dict[str, Any]], title: str, wide: bool = False,
                  width: int | None = None) -> Table:
    """The summary table; on a narrow terminal the less important columns go
    (``wide`` keeps them), the kept ones are never cut."""
    from tidal.cli.tables import Col, fit

    cols = [Col(head, prio, justify="left" if head == "policy" else "right") for _, head, _, prio in RESULT_COLS]
    rows = [[_fmt(s.get(k), kind) for k, _, kind, _ in RESULT_COLS] for s in summaries]
    return fit(title, cols, rows, width or Console().width, wide, hint="--wide")


def run_policies(
    jobs: list,
    cluster,
    policies: list[str],
    *,
    profiles=None,
    overheads=None,
    slot: float = 60.0,
    show_progress: bool = True,
    console: Console | None = None,
    on_result=None,
    fidelity: str = "tidal",
):
    from tidal.scheduler.registry import get_policy_for_slot
    from tidal.sim.engine import Simulator

    console = console or Console(stderr=True)
    results = []
    with Progress(
        TextColumn("[bold]{task.description:<12}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not show_progress,
        transient=False,
    ) as progress:
        for name in policies:
            task = progress.add_task(name, total=len(jobs))

            def on_progress(done: int, total: int, _task=task) -> None:
                progress.update(_task, completed=done)

            if fidelity == "artifact":  # the ElasticFlow artifact's executor (docs/fidelity.md)
                from tidal.sim.artifact import run_artifact

                result = run_artifact(jobs, cluster, name, profiles, slot)
            else:
                result = Simulator(cluster, get_policy_for_slot(name, slot), jobs, profiles=profiles,
                                   overheads=overheads, slot=slot, on_progress=on_progress).run()
            progress.update(task, completed=len(jobs))
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


def _print_json(result) -> None:
    """One policy's summary as a JSON line on stdout, as soon as it is done
    (a run stopped later keeps the finished policies' lines)."""
    from tidal.sim.metrics import SUMMARY_KEYS, summarize

    s = summarize(result)
    obj = {k: s[k] for k in SUMMARY_KEYS}
    obj.update({k: v for k, v in s.items() if k not in obj})
    print(json.dumps(obj), flush=True)


def _on_result(err: Console, as_json: bool):
    """Per finished policy: a plain progress line on stderr when it is not a
    terminal (a terminal has the progress bar), and with --json its line."""
    def done(result) -> None:
        if not err.is_terminal:
            err.print(f"{result.policy}: done")
        if as_json:
            _print_json(result)
    return done


#: the files of ``--report`` (the page, and its plots while it is written)
REPORT_FILES = ("report.html", "report.tmp", "report.util.png", "report.jct.png")
MAX_SLOT_S = 86400.0  # a longer round makes every job wait that long: the JCTs would say nothing


def _too_big(jobs: list, topo: Any, source: str) -> Optional[str]:
    """Why the trace cannot run on the cluster: a job asking for more GPUs
    than the cluster has would never get its size (a rigid job would wait
    forever, an elastic one would be run at a size it never asked for), so
    the run is refused instead of reporting numbers for another workload."""
    big = [j for j in jobs if j.requested_gpus > topo.num_gpus]
    if not big:
        return None
    first = big[0]
    more = f" (and {len(big) - 1} more)" if len(big) > 1 else ""
    return (f"{source}: job {first.job_id!r} asks for {first.requested_gpus} GPUs{more}, but cluster {topo.name} "
            f"has {topo.num_gpus}; use a larger --cluster, or leave such jobs out of the trace")


def _fidelity_problem(topo: Any, fidelity: str) -> Optional[str]:
    """Why the cluster cannot run under ``--fidelity`` (None: it can)."""
    if fidelity == "artifact" and not topo.is_uniform:
        return (f"--fidelity artifact: the ElasticFlow artifact models clusters of alike nodes; {topo.name} "
                "mixes node sizes or GPU types (use --fidelity tidal)")
    return None


def _options_problem(names: list[str], fidelity: str, out: Optional[Path], trace: Path) -> Optional[str]:
    """Why ``tidal simulate`` cannot run with these options (checked before
    anything is read or simulated), or None."""
    from tidal.cli.checks import suggest
    from tidal.scheduler.registry import ALIASES, is_policy, policy_names

    bad = [n for n in names if not is_policy(n)]
    if not names or bad:
        hint = suggest(bad[0], [*policy_names(), *ALIASES]) if bad else ""
        return (f"unknown policy {', '.join(bad) or '(none)'}{hint} (known: {', '.join(policy_names())}; "
                f"aliases: {', '.join(sorted(ALIASES))})")
    if fidelity not in ("tidal", "artifact"):
        return f"--fidelity: choose tidal or artifact, not {fidelity!r}"
    if out is not None and (why := dir_problem(out, f"--out {out}")):
        return why
    if not str(trace).strip() or str(trace) == ".":
        return "--trace '': give a trace file (or a shipped trace's name: 195job, cluster10)"
    return None


def _load_inputs(trace: Path, fmt: str, topo: Any, profiles_dir: Optional[Path], *, seed: int,
                 limit: Optional[int], elastic: bool, progress: str = "auto") -> tuple[Any, Any]:
    """The throughput profiles and the trace. A Pollux/Sia workload brings
    its own: profiles fitted to the measured data of its ``traces/`` folder
    (or of ``--profiles`` when that is such a folder) for this cluster's GPU
    types (:mod:`tidal.sim.sia`); with ``progress="efficiency"`` its jobs are
    goodput jobs (:mod:`tidal.sim.goodput`); ``"auto"``: goodput jobs on a
    cluster of one GPU type, fixed-batch steps at each type's speed on a
    mixed one."""
    from tidal.core.profile import load_profiles
    from tidal.sim.traces import detect_format, load_trace, resolve_trace

    if progress not in ("auto", "efficiency", "steps"):
        raise InputError(f"must be auto, efficiency or steps, got {progress!r}", field="--progress")
    if progress == "auto":  # the goodput model is measured on one GPU type: per-type steps on a mixed cluster
        progress = "efficiency" if len({n.gpu_type for n in topo.nodes}) <= 1 else "steps"
    if (fmt if fmt != "auto" else detect_format(resolve_trace(trace))) == "pollux":
        from tidal.sim.sia import data_for, workload_profiles

        data = data_for(resolve_trace(trace), profiles_dir)
        tr = load_trace(trace, "pollux", limit=limit, elastic=elastic, data_dir=data.root)
        if progress == "steps":
            return workload_profiles(tr.jobs, topo, data), tr
        from tidal.sim.goodput import goodput_inputs

        gprof, jobs = goodput_inputs(tr.jobs, workload_profiles(tr.jobs, topo, data), data, topo)
        return gprof, dataclasses.replace(tr, jobs=tuple(jobs))
    prof = load_profiles(profiles_dir)
    return prof, load_trace(trace, fmt, seed=seed, limit=limit, profiles=prof, elastic=elastic)


def _overheads(overhead: str) -> Any:
    """The overhead model of ``--overhead`` (``restart``: Pollux's,
    :func:`tidal.sim.goodput.pollux_overheads`)."""
    from tidal.core.overhead import OverheadModel

    if overhead not in ("stop-free", "stop-resume", "restart"):
        raise InputError(f"overhead mode must be stop-free, stop-resume or restart, got {overhead!r}")
    mode = overhead
    if mode == "restart":
        from tidal.sim.goodput import pollux_overheads

        return pollux_overheads()
    return OverheadModel(mode=mode)


@app.command()
def simulate(
    trace: Path = typer.Option(..., "--trace", help="Trace CSV (ITP, Philly with deadlines, Philly, or a "
                                                         "Pollux/Sia workload)."),
    fmt: str = typer.Option("auto", "--format", help="auto | itp | philly | philly-ef | pollux"),
    cluster: str = typer.Option("n32g8", "--cluster", help="Cluster spec like n32g8, or a cluster CSV."),
    policy: str = typer.Option("fifo", "--policy", help="Policy name(s), comma separated."),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Output directory (default out/<trace>_<cluster>). It holds this run's files only: "
                            "the files a previous run wrote there (summary.json, *_jobs.csv, the plots, "
                            "report.html) are replaced or removed; other files are left alone."),
    seed: int = typer.Option(0, "--seed", help="Seed for trace synthesis (Philly models, batch sizes)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use only the first N jobs."),
    as_json: bool = typer.Option(False, "--json", metavar="", help="Print one JSON object per policy."),
    slot: float = typer.Option(60.0, "--slot", callback=bounded(low=0.0, high=MAX_SLOT_S, unit="s"),
                               help=f"Scheduling slot in seconds (0: schedule at every event; at most "
                                    f"{MAX_SLOT_S:g}, a day)."),
    overhead: str = typer.Option("stop-free", "--overhead", help="Rescale overhead model: stop-free | stop-resume "
                                 "| restart (Pollux's simulator: 30 s without progress on every change, the first "
                                 "start included)."),
    progress: str = typer.Option("auto", "--progress", help="A Pollux/Sia workload's progress: efficiency "
                                 "(goodput jobs, Pollux's statistical efficiency) | steps (fixed-batch steps at each "
                                 "GPU type's speed) | auto (efficiency on a cluster of one GPU type, else steps)."),
    profiles_dir: Optional[Path] = typer.Option(None, "--profiles", help="Throughput profile directory (default: shipped A100); for a Pollux/Sia workload, its "
                                                     "measured-data folder (default: the traces/ folder above it)."),
    rigid: bool = typer.Option(False, "--rigid", metavar="", help="Treat every job as rigid (not elastic)."),
    wide: bool = typer.Option(False, "--wide", metavar="", help="Every column of the table, however wide the terminal."),
    report: bool = typer.Option(False, "--report", metavar="", help="Also write OUT/report.html: one self-contained "
                                "page with the table, the plots and this command."),
    fidelity: str = typer.Option("tidal", "--fidelity", help="tidal (Tidal's own model) | artifact (the public "
                                 "ElasticFlow simulator's semantics: docs/fidelity.md)."),
) -> None:
    """Simulate one or more policies on a trace; print a table (or JSON) and
    write per-job CSVs, summary.json and plots."""
    from tidal.core.topology import parse_cluster

    err = LineConsole(stderr=True)
    names = [p.strip() for p in policy.split(",") if p.strip()]
    if why := _options_problem(names, fidelity, out, trace):
        err.print("[red]error:[/] " + escape(why))
        raise typer.Exit(2)
    try:
        with interruptible("simulate", "while reading the trace; nothing written"):
            topo = parse_cluster(cluster)
            prof, tr = _load_inputs(trace, fmt, topo, profiles_dir, seed=seed, limit=limit, elastic=not rigid,
                                    progress=progress)
            overheads = _overheads(overhead)
    except (InputError, ValueError) as exc:
        err.print("[red]error:[/] " + escape(f"{exc}"))
        raise typer.Exit(2)
    out_dir = out or Path("out") / re.sub(r"[^\w.-]+", "_", f"{Path(tr.source).stem}_{topo.name}")
    why = (_too_big(list(tr.jobs), topo, Path(tr.source).name) or _fidelity_problem(topo, fidelity)
           or dir_problem(out_dir, f"--out {out_dir}"))
    if why:
        err.print("[red]error:[/] " + escape(why))
        raise typer.Exit(2)
    with interruptible("simulate", f"nothing written to {out_dir}"):
        err.print(f"trace: {tr.describe()}")
        err.print(f"cluster: {topo.name} ({topo.num_gpus} GPUs, {topo.num_nodes} nodes, "
                  f"{topo.num_switches} switch{'es' if topo.num_switches != 1 else ''})")
        results = run_policies(
            list(tr.jobs), topo, names, profiles=prof, overheads=overheads, slot=slot,
            show_progress=sys.stderr.isatty(), console=err,
            on_result=_on_result(err, as_json), fidelity=fidelity,
        )
        _outputs(results, out_dir, f"{Path(tr.source).name} on {topo.name}", err, table=not as_json, wide=wide,
                 report=report)


def _outputs(results: list, out_dir: Path, title: str, err: Console, *, table: bool, wide: bool,
             report: bool) -> None:
    """The run's files, its table on stdout (unless --json) and with --report its page."""
    from tidal.cli.tables import wide_console
    from tidal.sim.metrics import clear_outputs, summarize, write_outputs

    summaries = [summarize(r) for r in results]
    page, existed = None, out_dir.exists()
    try:
        paths = write_outputs(results, out_dir, extra=REPORT_FILES)
        if report:
            from tidal.sim.report import write_report

            page = write_report(results, summaries, out_dir / "report.html", title=title,
                                command=shlex.join(["tidal", *sys.argv[1:]]))
    except BaseException as e:  # a full disk, or Ctrl-C while writing: none of the run's files stays
        clear_outputs(out_dir, REPORT_FILES)
        if not existed and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()  # made by this run, and nothing in it
        if not isinstance(e, OSError):
            raise
        err.print("[red]error:[/] " + escape(f"--out {out_dir}: cannot write {e.filename or 'the results'} "
                                              f"({e.strerror or e}); none of this run's files was left there"))
        raise typer.Exit(1)
    if table:
        # a pipe gets every column unless $COLUMNS says how wide to be
        con = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160)
        (wide_console(con) if wide else con).print(results_table(summaries, title, wide=wide, width=con.width))
    err.print(f"wrote {out_dir}/ (summary.json, *_jobs.csv, {paths['utilization'].name}, {paths['jct_cdf'].name})")
    if page is not None:
        err.print(f"report: {page}")
