"""``python -m tidal`` is the ``tidal`` command."""

from tidal.cli.main import app

app(prog_name="tidal")
