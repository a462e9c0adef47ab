"""The `tidal simulate` contract that other tools call, and `tidal demo`."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from tidal.cli.main import app
from tidal.sim.metrics import SUMMARY_KEYS

runner = CliRunner()


def test_simulate_json_contract_and_outputs(tmp_path, shared):
    trace = shared / "traces" / "itp" / "cluster10.csv"
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
    trace = shared / "traces" / "itp" / "cluster10.csv"
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
