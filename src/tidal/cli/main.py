"""The ``tidal`` command line (the console script ``tidal.cli.main:app``).
Each command group lives in its own module and attaches its commands to the
app of :mod:`tidal.cli.app`; importing them here registers them, in the order
``tidal --help`` lists them."""

from __future__ import annotations

from tidal.cli.app import app
from tidal.cli import simulate  # noqa: F401  (simulator commands)
from tidal.cli import demo  # noqa: F401
from tidal.cli import cluster  # noqa: F401  (live-cluster commands)
from tidal.cli import run  # noqa: F401  (runtime commands)

__all__ = ["app"]
