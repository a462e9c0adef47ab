"""The ``tidal`` Typer app. Command modules attach their commands to it;
:mod:`tidal.cli.main` imports them all."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import typer

app = typer.Typer(
    name="tidal",
    help="Tidal: elastic deep learning on shared GPU clusters.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", metavar="", help="Debug logging.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@contextlib.contextmanager
def interruptible(command: str, after: str = "") -> Iterator[None]:
    """Ctrl-C inside: one line (``tidal COMMAND: interrupted (Ctrl-C)`` and
    ``after``, what was left) on stderr and exit code 130, as a shell
    reports a command stopped by SIGINT; never a traceback."""
    try:
        yield
    except KeyboardInterrupt:
        typer.echo(f"tidal {command}: interrupted (Ctrl-C){'; ' + after if after else ''}", err=True)
        raise typer.Exit(130) from None
