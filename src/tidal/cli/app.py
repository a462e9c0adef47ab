"""The ``tidal`` Typer app. Command modules attach their commands to it;
:mod:`tidal.cli.main` imports them all."""

from __future__ import annotations

import logging

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
