"""The ``tidal`` command line. Each command group lives in its own module and
is attached here, so that packages do not edit each other's files."""

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
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _register() -> None:
    from tidal.cli import simulate as _simulate  # noqa: F401  (registers commands)
    from tidal.cli import demo as _demo  # noqa: F401
    from tidal.cli import cluster as _cluster  # noqa: F401  (live-cluster commands)

    try:
        from tidal.cli import run as _run  # noqa: F401  (runtime commands)
    except ImportError:  # pragma: no cover - runtime not built yet
        pass


_register()
