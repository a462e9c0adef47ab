"""The CLI's tables at 80 columns (``COLUMNS=80``) with 64-character job
names, through the real commands (``tidal jobs``, ``job``, ``cluster`` against
an in-process server over HTTP; ``tidal simulate`` on a trace): every line
fits, every border stays, a state, a number or a time is never cut (only a
job's name may be shortened, with "…", keeping its unique end), and an info
line never breaks a word."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from served import served as served_app

from tidal.cli.main import app
from tidal.cli.tables import Col, fit, middle

runner = CliRunner()
WIDTH = 80
NAME = "a-rather-long-job-name-that-a-user-typed-to-say-what-it-trains-x"  # 64 characters
STATES = ("running", "pending", "completed", "cancelled", "submitted")


def _run(*args: str):
    res = runner.invoke(app, list(args), env={"COLUMNS": str(WIDTH)})
    assert res.exit_code == 0, res.output
    return res


def _tables_fit(out: str) -> list[list[str]]:
    """Every line fits; every table row has its left and right border; the
    rows' cells (stripped), for the caller to check."""
    rows = []
    for line in out.splitlines():
        assert len(line) <= WIDTH, f"{len(line)} characters: {line!r}"
        if line.startswith("│"):
            assert line.rstrip().endswith("│"), f"right border lost: {line!r}"
            rows.append([c.strip() for c in line.strip()[1:-1].split("│")])
        elif line[:1] in "┏┡└":
            assert line.rstrip()[-1] in "┓┩┘", f"right border lost: {line!r}"
    return rows


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """An in-process server (no scheduling loop) on one 4-GPU node with a
    long name, and three jobs with 64-character names after one round: two
    running, one pending."""
    from fastapi.testclient import TestClient

    from tidal.control.db import Store
    from tidal.control.server import create_app

    home = tmp_path_factory.mktemp("columns")
    store = Store(f"sqlite:///{home / 't.db'}")
    srv = create_app(store, admin_token="admin-tok", home=home, start_loop=False)
    client = TestClient(srv)
    hdr = {"Authorization": "Bearer admin-tok"}
    client.post("/internal/agents/register", json={"name": "node-with-a-rather-long-name-0", "num_gpus": 4,
                                                   "virtual": True}, headers=hdr)
    assert len(NAME) == 64
    ids = [client.post("/v1/jobs", json={"name": NAME, "script": "train.py", "gpus": "1-2", "iterations": 100000,
                                         "deadline": 600}, headers=hdr).json()["id"] for _ in range(3)]
    srv.state.coordinator.round()
    with served_app(srv) as base:
        yield ["--server", base, "--token", "admin-tok"], ids


def _same_job(cell: str, job_id: str) -> bool:
    """The cell is the id, whole or shortened in its middle (its unique end kept)."""
    if cell == job_id:
        return True
    head, _, tail = cell.partition("…")
    return bool(tail) and job_id.startswith(head) and job_id.endswith(tail) and len(tail) >= 6


def test_jobs_at_80_columns(server):
    opts, ids = server
    rows = _tables_fit(_run("jobs", *opts).stdout)
    body = [r for r in rows if r[0] != "id"]
    assert len(body) == 3
    for r, jid in zip(body, ids):
        assert _same_job(r[0], jid), r
        assert r[1] in STATES, f"state cut: {r[1]!r}"
        assert r[2].isdigit()
    assert sorted(r[1] for r in body) == ["pending", "running", "running"]
    assert len({r[0] for r in body}) == 3  # still told apart


def test_job_at_80_columns(server):
    opts, ids = server
    out = _run("job", ids[2], *opts).stdout
    rows = _tables_fit(out)
    assert _same_job(rows[0][0], ids[2]) and rows[0][1] == "pending"
    events = [r for r in rows if re.fullmatch(r"\d\d:\d\d:\d\d", r[0])]
    assert {r[1] for r in events} >= {"job.submitted", "job.admitted"}  # event kinds whole


def test_cluster_at_80_columns(server):
    opts, ids = server
    rows = _tables_fit(_run("cluster", *opts).stdout)
    body = [r for r in rows if r[0] != "node"]
    assert len(body) == 4
    for r in body:
        assert r[0] == "node-with-a-rather-long-name-0" and r[1] == "up" and re.fullmatch(r"\d \(#\d\)", r[2]), r
        assert r[3] == "-" or any(_same_job(r[3], j) for j in ids), r


def test_simulate_at_80_columns(tmp_path):
    trace = tmp_path / "a-trace-whose-file-name-is-long-enough-to-wrap-an-80-column-line.csv"
    lines = ["job_id,submission_time,num_iteration,model_name,deadline,batch_size,num_gpu,duration"]
    lines += [f"{NAME[:58]}-{k:05d},{60 * k},1000,resnet50,{60 * k + 7200},64,2,600" for k in range(4)]
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    res = _run("simulate", "--trace", str(trace), "--cluster", "n2g4", "--policy", "fifo,edf,elastic-tiresias",
               "--out", str(out))
    rows = _tables_fit(res.stdout)
    body = [r for r in rows if r[0] != "policy"]
    assert [r[0] for r in body] == ["fifo", "edf", "elastic-tiresias"]
    for r in body:
        assert all(re.fullmatch(r"[\d.]+%?", c) for c in r[1:]), r  # numbers whole
    # the info lines (stderr) keep their words whole: each file name is on one line
    text = res.output
    for word in ("summary.json,", "*_jobs.csv,", "utilization.png,", "jct_cdf.png)", trace.name):
        assert word in text, f"{word!r} broken across lines:\n{text}"


def test_fit_shortens_only_the_longest_name_in_its_middle():
    rows = [["x" * 57 + "-abc123", "pending", "2", "a reason with words"]]
    cols = (Col("id"), Col("state"), Col("GPUs"), Col("reason", 1, wrap=True))
    from rich.console import Console

    con = Console(width=40, record=True)
    con.print(fit("jobs", cols, rows, 40))
    text = con.export_text()
    assert "pending" in text and "-abc123" in text and "…" in text
    assert all(len(line) <= 40 for line in text.splitlines())
    assert middle("abcdefghij", 5) == "ab…ij" and middle("abc", 5) == "abc"
