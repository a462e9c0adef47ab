"""``tidal run``, ``tidal scale``, ``tidal migrate`` and ``tidal profile``:
launch one elastic job locally and act on it from another terminal. The
logic lives in :mod:`tidal.runtime.launch`; this module only registers the
commands."""

from __future__ import annotations

from typing import Optional

import typer

from tidal.cli.app import app, interruptible
from tidal.cli.checks import bounded

_SECONDS = bounded(low=0.0, low_open=True, unit="s")  # a timeout: more than 0 s

_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.command("run", context_settings=_EXTRA)
def run(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="Training script; arguments after it are passed to it."),
    workers: int = typer.Option(2, "--workers", "-n", help="Initial size: the number of workers."),
    max_workers: Optional[int] = typer.Option(None, "--max-workers", help="Largest size scale-out may reach.",
                                                 callback=bounded(low=1)),
    job: Optional[str] = typer.Option(None, "--job", help="Job name for `tidal scale` (default: script name)."),
    state: Optional[str] = typer.Option(None, "--state", help="Master state backend: file://PATH or sqlite://PATH."),
    switch_lead: float = typer.Option(0.0, "--switch-lead", help="T_a in seconds: lead time of a planned switch.",
                                     callback=bounded(low=0.0, unit="s")),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Stop the job after this many seconds.",
                                             callback=_SECONDS),
    straggler_policy: str = typer.Option(
        "report", "--straggler-policy",
        help="A worker >1.2x the median compute time for 10 steps: report | remove | replace | share (EDL §5.2)."),
    replication: str = typer.Option(
        "topology", "--replication",
        help="How newcomers get the state: topology (nearest live worker, concurrent) | single | broadcast."),
    hang_timeout: float = typer.Option(30.0, "--hang-timeout", help="Kill a worker hung this many seconds (0: never).",
                                      callback=bounded(low=0.0, unit="s")),
    bind: Optional[str] = typer.Option(
        None, "--bind", help="Address the master listens on (0.0.0.0: every interface); default $TIDAL_BIND_ADDR "
                             "or 127.0.0.1."),
    advertise_addr: Optional[str] = typer.Option(None, "--advertise-addr",
                                                 help="Address given to workers and joining hosts."),
    port: int = typer.Option(0, "--port", min=0, max=65535, help="The master's HTTP port (0: any free one)."),
    join: Optional[str] = typer.Option(
        None, "--join", metavar="HOST:PORT",
        help="Add --workers workers on this host to the running job whose master is at HOST:PORT."),
    replace_host: Optional[str] = typer.Option(
        None, "--replace-host", metavar="HOST",
        help="With --join: the new workers replace HOST's workers in one switch (a migration)."),
    max_steps: Optional[int] = typer.Option(
        None, "--max-steps", min=1,
        help="End the job at this global step whatever the script's own loop says ($TIDAL_MAX_STEPS)."),
) -> None:
    """Run SCRIPT as an elastic job with a local job master (torchrun-like),
    or with --join add this host's workers to one running elsewhere."""
    from tidal.runtime.launch import run_job

    if why := _run_problem(job, state, bind, advertise_addr, port, join, straggler_policy, replication):
        typer.echo(f"tidal run: {why}", err=True)
        raise typer.Exit(2)
    if join:
        _join(join, script, list(ctx.args), workers, timeout, replace_host, max_steps)
    rc = run_job(script, list(ctx.args), workers, max_size=max_workers, job=job, state_url=state,
                 switch_lead_s=switch_lead, timeout_s=timeout, out=typer.echo, straggler_policy=straggler_policy,
                 replication=replication, hang_timeout_s=hang_timeout, bind=bind, advertise=advertise_addr,
                 port=port, max_steps=max_steps)
    raise typer.Exit(rc)


def _join(join: str, script: str, args: list[str], workers: int, timeout: Optional[float],
          replace_host: Optional[str], max_steps: Optional[int]) -> None:
    """``tidal run --join``: this host's workers join the job at ``join``; exits."""
    import os

    from tidal import settings
    from tidal.runtime.join import join_job

    if max_steps:
        os.environ[settings.MAX_STEPS.name] = str(max_steps)  # the workers started here inherit it
    with interruptible("run --join", "this host's workers are stopped"):
        rc = join_job(join, script, args, workers, timeout_s=timeout or 120.0, out=typer.echo,
                      replace_host=replace_host)
    raise typer.Exit(rc)


def _run_problem(job: Optional[str], state: Optional[str], bind: Optional[str], advertise: Optional[str],
                 port: int, join: Optional[str], straggler_policy: str, replication: str) -> Optional[str]:
    """Why ``tidal run`` cannot start with these options (checked before any
    process starts), or None."""
    from pathlib import Path

    from tidal import settings
    from tidal.cli.checks import address_problem, home_problem, name_problem, port_problem, state_problem
    from tidal.net import bind_addr
    from tidal.runtime.replication import MODES
    from tidal.runtime.stragglers import STRAGGLER_POLICIES

    if straggler_policy not in STRAGGLER_POLICIES:
        return f"--straggler-policy {straggler_policy}: one of {', '.join(STRAGGLER_POLICIES)}"
    if replication not in MODES:
        return f"--replication {replication}: one of {', '.join(MODES)}"
    if join:
        return None
    if why := name_problem("--job", job) or state_problem(state):
        return why
    if advertise is not None and not advertise.strip():
        return "--advertise-addr '': give an address, or leave the option out"
    host = bind if bind is not None else bind_addr(None)
    return (address_problem(host, "--bind" if bind is not None else f"${settings.BIND_ADDR.name}")
            or port_problem(port, host) or home_problem(Path(settings.home())))


@app.command("migrate")
def migrate(
    job: str = typer.Argument(..., help="The name given to `tidal run` (or its master URL)."),
    ranks: list[int] = typer.Argument(..., help="Ranks to move."),
    timeout: float = typer.Option(120.0, "--timeout", help="Give up after this many seconds.", callback=_SECONDS),
) -> None:
    """Move workers of a `tidal run` job in one change (EDL §5.2): replacements
    start and warm up while the job trains, then the old ones leave and the
    new ones join at one agreed step."""
    from tidal.runtime.launch import migrate_job

    with interruptible("migrate", "the migration may still complete"):
        rc = migrate_job(job, list(ranks), timeout_s=timeout, out=typer.echo)
    raise typer.Exit(rc)


@app.command("profile")
def profile_cmd(
    job: str = typer.Argument(..., help="The name given to `tidal run` (or its master URL)."),
    min_p: int = typer.Option(1, "--min", help="Smallest worker count to measure.", callback=bounded(low=1)),
    max_p: int = typer.Option(..., "--max", help="Largest worker count (the job is scaled there first).",
                              callback=bounded(low=1)),
    batch: int = typer.Option(..., "--batch", help="The job's global batch size (the profile's row).",
                              callback=bounded(low=1)),
    steps: int = typer.Option(20, "--steps", help="Steps measured per size.", callback=bounded(low=1)),
    out: str = typer.Option("profiles", "--out", help="Directory of the profile CSV."),
    model: str = typer.Option("job", "--model", help="Model name: the CSV is OUT/MODEL.csv."),
) -> None:
    """Measure a running job's scaling curve in place (EDL §5.2): from --max
    workers down to --min, one scale-in at a time; writes the scheduler's
    profile CSV, which `tidal simulate --profiles OUT` reads."""
    from rich.console import Console
    from rich.table import Table

    from tidal.runtime.launch import resolve_master
    from tidal.runtime.profiling import profile

    from pathlib import Path

    from tidal.cli.checks import dir_problem

    if why := dir_problem(Path(out), f"--out {out}"):
        typer.echo(f"tidal profile: {why}", err=True)
        raise typer.Exit(2)
    try:
        url = resolve_master(job)
    except FileNotFoundError as e:
        typer.echo(f"tidal profile: {e}", err=True)
        raise typer.Exit(2)
    res = profile(url, min_p, max_p, batch, steps=steps, out_dir=out, model=model)
    t = Table(title=f"{model}: global batch {batch}, {res.total_s:.1f} s")
    t.add_column("workers", justify="right")
    t.add_column("iterations/s", justify="right")
    for n, v in sorted(res.its.items()):
        t.add_row(str(n), f"{v:.2f}")
    Console().print(t)
    typer.echo(f"wrote {res.path}")


@app.command("scale")
def scale(
    job: str = typer.Argument(..., help="Job: a live-cluster job id, or the name given to `tidal run` (or its master URL)."),
    gpus: Optional[int] = typer.Argument(None, help="Live cluster: pin the job at this many GPUs until released with 0."),
    workers: Optional[int] = typer.Option(None, "--workers", "-n", help="`tidal run` job: target number of workers."),
    timeout: float = typer.Option(120.0, "--timeout", help="Give up after this many seconds.", callback=_SECONDS),
    wait: bool = typer.Option(True, "--wait/--no-wait",
                              metavar="", help="`tidal run` job: wait until it runs at the new size (a live-cluster job's pin "
                                   "returns at once; the policy applies it in its next round)."),
    server: Optional[str] = typer.Option(None, "--server", help="Live cluster: server URL."),
    token: Optional[str] = typer.Option(None, "--token", help="Live cluster: API token."),
    remove_host: Optional[str] = typer.Option(
        None, "--remove-host", help="`tidal run` job: remove every worker on this host (as the workers registered "
                                    "it: $TIDAL_HOST, $TIDAL_NODE or the host name)."),
) -> None:
    """Rescale a job: `tidal scale ID N` for a live-cluster job (pins it at N
    GPUs, never suspended by the policy, until `tidal scale ID 0`), `tidal scale NAME --workers N` for a job started by `tidal run`
    (scales out or in, retrying while busy), `tidal scale NAME --remove-host H`
    to take a host's workers out of it."""
    if remove_host is not None and gpus is None and workers is None:
        from tidal.runtime.launch import remove_host_workers

        raise typer.Exit(remove_host_workers(job, remove_host, timeout_s=timeout, wait=wait, out=typer.echo))
    if (gpus is None) == (workers is None):
        typer.echo("give either N (a live-cluster job), --workers N or --remove-host H (a `tidal run` job)", err=True)
        raise typer.Exit(2)
    if gpus is not None:
        from tidal.cli.cluster import cluster_scale

        cluster_scale(job, gpus, server, token)
        return
    from tidal.runtime.launch import scale_job

    with interruptible("scale", "a change already accepted goes on"):
        rc = scale_job(job, workers, timeout_s=timeout, wait=wait, out=typer.echo)
    raise typer.Exit(rc)
