"""``tidal demo``'s summary counts (shrinks and grows that took effect) and
its refusals of unusable options: one line, exit 2, no traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tidal.cli.demo import rescales
from tidal.cli.main import app

runner = CliRunner()


def test_rescales_counts_shrinks_and_grows_that_took_effect():
    changes = [{"kind": "scale_in", "from_size": 8, "to_size": 4}, {"kind": "scale_in", "from_size": 4, "to_size": 2},
               {"kind": "scale_out", "from_size": 2, "to_size": 4}, {"kind": "scale_out", "from_size": 4, "to_size": 8},
               {"kind": "reshare", "from_size": 8, "to_size": 8}]
    assert rescales({"progress": {"changes": changes}}) == (2, 2)
    assert rescales({"progress": None}) == (0, 0)


@pytest.mark.parametrize("args, says", [
    (["--sim", "--jobs", "0"], "--jobs 0"),
    (["--sim", "--cluster", "banana"], "--cluster banana"),
    (["--policy", "tiresas"], "did you mean tiresias"),
    (["--timeout", "-1"], "--timeout -1"),
])
def test_unusable_options_are_one_line(args, says, tmp_path):
    res = runner.invoke(app, ["demo", *args, "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert says in res.output and "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "o").exists()
