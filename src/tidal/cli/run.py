"""``tidal run`` and ``tidal scale``: launch one elastic job locally and
rescale it from another terminal (issue 4, item 6). The logic lives in
:mod:`tidal.runtime.launch`; this module only registers the commands."""

from __future__ import annotations

from typing import Optional

import typer

from tidal.cli.main import app

_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.command("run", context_settings=_EXTRA)
def run(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="Training script; arguments after it are passed to it."),
    workers: int = typer.Option(2, "--workers", "-n", help="Initial number of workers."),
    max_workers: Optional[int] = typer.Option(None, "--max-workers", help="Upper bound for scale-out."),
    job: Optional[str] = typer.Option(None, "--job", help="Job name for `tidal scale` (default: script name)."),
    state: Optional[str] = typer.Option(None, "--state", help="Master state backend: file://PATH or sqlite://PATH."),
    switch_lead: float = typer.Option(0.5, "--switch-lead", help="T_a in seconds: lead time of a planned switch."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Stop the job after this many seconds."),
) -> None:
    """Run SCRIPT as an elastic job with a local job master (torchrun-like)."""
    from tidal.runtime.launch import run_job

    rc = run_job(script, list(ctx.args), workers, max_workers=max_workers, job=job, state_url=state,
                 switch_lead_s=switch_lead, timeout_s=timeout, out=typer.echo)
    raise typer.Exit(rc)


@app.command("scale")
def scale(
    job: str = typer.Argument(..., help="Job: a live-cluster job id, or the name given to `tidal run` (or its master URL)."),
    gpus: Optional[int] = typer.Argument(None, help="Live cluster: pin the job at this many GPUs."),
    workers: Optional[int] = typer.Option(None, "--workers", "-n", help="`tidal run` job: target number of workers."),
    timeout: float = typer.Option(120.0, "--timeout", help="Give up after this many seconds."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until the job runs at the new size."),
    server: Optional[str] = typer.Option(None, "--server", help="Live cluster: server URL."),
    token: Optional[str] = typer.Option(None, "--token", help="Live cluster: API token."),
) -> None:
    """Rescale a job: `tidal scale ID N` for a live-cluster job (pins it at N
    GPUs), `tidal scale NAME --workers N` for a job started by `tidal run`
    (scales out or in, retrying while busy)."""
    if (gpus is None) == (workers is None):
        typer.echo("give either N (a live-cluster job) or --workers N (a `tidal run` job)", err=True)
        raise typer.Exit(2)
    if gpus is not None:
        from tidal.cli.cluster import cluster_scale

        cluster_scale(job, gpus, server, token)
        return
    from tidal.runtime.launch import scale_job

    raise typer.Exit(scale_job(job, workers, timeout_s=timeout, wait=wait, out=typer.echo))
