"""The `tidal simulate` contract that other tools call, and `tidal demo`."""

from __future__ import annotations

import json

from datafiles import data_file
from typer.testing import CliRunner

from tidal.cli.main import app
from tidal.sim.metrics import SUMMARY_KEYS

runner = CliRunner()


def test_simulate_json_contract_and_outputs(tmp_path, shared):
    trace = data_file("traces/itp/cluster10.csv")
    res = runner.invoke(app, ["simulate", "--trace", str(trace), "--cluster", "n32g8",
                              "--policy", "fifo,backfill,tiresias,edf", "--out", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [o["policy"] for o in lines] == ["fifo", "backfill", "tiresias", "edf"]
    for o in lines:
        assert list(o)[: len(SUMMARY_KEYS)] == list(SUMMARY_KEYS)
        assert o["jobs"] == 260 and o["finished"] + o["dropped"] == 260
        assert 0 < o["deadline_ratio"] <= 1
    # elastic EDF uses idle GPUs: it meets more deadlines than rigid FIFO
    by = {o["policy"]: o for o in lines}
    assert by["edf"]["deadline_ratio"] > by["fifo"]["deadline_ratio"]
    for name in ("summary.json", "utilization.png", "jct_cdf.png", "edf_jobs.csv"):
        assert (tmp_path / name).stat().st_size > 0
    rows = (tmp_path / "fifo_jobs.csv").read_text().splitlines()
    assert len(rows) == 261 and rows[0].startswith("job_id,")


def test_simulate_table_output(tmp_path, shared):
    trace = data_file("traces/itp/cluster10.csv")
    res = runner.invoke(app, ["simulate", "--trace", str(trace), "--policy", "fifo,tiresias", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "avg JCT h" in res.stdout and "tiresias" in res.stdout


def test_simulate_bad_input_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text(
        "job_id,submission_time,num_iteration,model_name,deadline,batch_size,num_gpu,duration\n"
        "a,0,100,resnet50,1000,64,1,10\n"
        "b,5,oops,resnet50,1000,64,1,10\n"
    )
    res = runner.invoke(app, ["simulate", "--trace", str(bad), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert "bad.csv" in res.output and "line 3" in res.output and "num_iteration" in res.output
    assert not (tmp_path / "o").exists()  # nothing half-written
    res = runner.invoke(app, ["simulate", "--trace", str(bad), "--policy", "nope"])
    assert res.exit_code == 2 and "unknown policy" in res.output


def test_demo_runs(tmp_path):
    res = runner.invoke(app, ["demo", "--sim", "--jobs", "30", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "simulation mode" in res.stdout
    assert (tmp_path / "summary.json").exists()
    assert len(json.loads((tmp_path / "summary.json").read_text())) >= 4


def test_error_text_with_markup_characters_is_printed_not_parsed(tmp_path):
    """A file name or field containing ``[/...]`` used to crash rich's
    printer (MarkupError) instead of showing the error."""
    (tmp_path / "x[").mkdir()
    bad = tmp_path / "x[" / "y].csv"  # the path contains "[/y]"
    bad.write_text("this is not,a trace\n[/x],1\n")
    res = runner.invoke(app, ["simulate", "--trace", str(bad), "--policy", "fifo"])
    assert res.exit_code != 0
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "x[/y].csv" in res.output


def test_tidal_run_refuses_bad_arguments_before_starting_anything(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    cases = [(["--workers", "0", str(script)], "--workers must be at least 1"),
             (["--workers", "-1", str(script)], "--workers must be at least 1"),
             (["--workers", "4", "--max-workers", "2", str(script)], "more than --max-workers 2"),
             (["--state", "bogus://x", str(script)], "unknown state backend 'bogus'"),
             ([str(tmp_path / "nope.py")], "no such script"),
             (["--join", "bad", str(script)], "expected HOST:PORT"),
             (["--join", "127.0.0.1:9", str(tmp_path / "nope.py")], "no such script")]
    for args, message in cases:
        res = runner.invoke(app, ["run", *args])
        assert res.exit_code == 2, (args, res.output)
        assert message in res.output, (args, res.output)
        assert not list((tmp_path).glob("**/jobs/*.json"))  # no master was started


def test_simulate_table_fits_80_columns_with_whole_numbers(tmp_path, shared):
    """`COLUMNS=80 tidal simulate ...`: no cell cut ("fi…", "9.…"); the less
    important columns go, --wide brings them back."""
    import os
    import subprocess
    import sys

    trace = data_file("traces/itp/cluster10.csv")
    args = [sys.executable, "-m", "tidal", "simulate", "--trace", str(trace), "--cluster", "n32g8", "--policy",
            "fifo,backfill,tiresias,edf", "--limit", "120", "--out", str(tmp_path)]
    env = dict(os.environ, COLUMNS="80")
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120).stdout
    lines = out.splitlines()
    assert lines and max(len(x) for x in lines) <= 80, out
    assert "…" not in out and "more columns with --wide" in " ".join(out.split())
    for name in ("fifo", "backfill", "tiresias", "edf"):
        assert any(x.split("│")[1].strip() == name for x in lines if x.count("│") > 2), out
    summary = json.loads((tmp_path / "summary.json").read_text())
    by = {s["policy"]: s for s in (summary if isinstance(summary, list) else summary["policies"])}
    assert f"{by['edf']['avg_jct'] / 3600:.2f}" in out  # a whole number, not cut
    wide = subprocess.run([*args, "--wide"], env=env, capture_output=True, text=True, timeout=120).stdout
    assert "p95 JCT h" in wide and "wall s" in wide
