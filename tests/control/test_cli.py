"""The live-cluster CLI against a real server process (no agents)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tidal.cli.main import app
from tidal.control.local import LocalCluster

runner = CliRunner()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("cli"), policy="fifo")
    c.start_server()
    yield c
    c.stop()


def cli(server, *args, token=None):
    return runner.invoke(app, [*args, "--server", server.url, "--token", token or server.admin_token])


def test_submit_list_show_cancel(server, tmp_path):
    token = cli(server, "user", "carol").stdout.strip()
    spec = tmp_path / "job.yaml"
    spec.write_text("name: t\nscript: train.py\ngpus: 2-4\niterations: 50\n")
    (tmp_path / "train.py").write_text("")  # resolved against the spec's folder
    res = cli(server, "submit", str(spec), token=token)
    assert res.exit_code == 0, res.output
    jid = res.stdout.split()[-1]
    jobs = json.loads(cli(server, "jobs", "--json", token=token).stdout)
    assert [j["id"] for j in jobs] == [jid]
    assert json.loads(cli(server, "job", jid, "--json", token=token).stdout)["events"][0]["kind"] == "job.submitted"
    assert "pinned at 3" in runner.invoke(app, ["scale", jid, "3", "--server", server.url, "--token", token]).stdout
    assert "cancel" in cli(server, "cancel", jid, token=token).stdout
    # another user does not see it
    other = cli(server, "user", "dave").stdout.strip()
    assert cli(server, "job", jid, token=other).exit_code == 1
    assert json.loads(cli(server, "jobs", "--json", token=other).stdout) == []


def test_bad_spec_and_no_server_are_clear_errors(server, tmp_path):
    deep = tmp_path / ("a-folder-with-a-long-name-" * 4)  # the path is wider than the terminal
    deep.mkdir()
    spec = deep / "bad.yaml"
    spec.write_text("name: t\nscript: train.py\ngpus: lots\niterations: 50\n")
    res = cli(server, "submit", str(spec))
    assert res.exit_code == 2 and str(spec) in res.output and "gpus" in res.output
    res = runner.invoke(app, ["submit", "--name", "x", "--script", "t.py", "--gpus", "2",
                              "--server", server.url, "--token", server.admin_token])
    assert res.exit_code == 2 and "iterations or epochs" in res.output
    res = runner.invoke(app, ["jobs", "--server", "http://127.0.0.1:9", "--token", "x"])
    assert res.exit_code == 1 and "cannot reach the server" in res.output
    assert cli(server, "jobs", token="wrong").exit_code == 1


def test_bad_submissions_get_one_clear_line_before_any_request(tmp_path):
    """No server is needed: these are refused while the spec is read."""
    binary = tmp_path / "spec.yaml"
    binary.write_bytes(bytes(range(256)))
    base = ["submit", "--name", "a", "--script", "x.py", "--iterations", "5"]
    cases = [([*base, "--gpus", "1,x"], "field 'gpus': an allowed set must look like '1,2,4'"),
             ([*base, "--gpus", "-2"], "field 'gpus': must be >= 1"),
             (["submit", "--name", "a", "--script", "x.py", "--gpus", "2"], "give iterations or epochs"),
             (["submit", str(binary)], "not a text (UTF-8) file"),
             (["agent", "--virtual-gpus", "1", "--label", "rack1"], "--label 'rack1': expected KEY=VALUE")]
    for args, message in cases:
        res = runner.invoke(app, [*args, "--server", "http://127.0.0.1:9", "--token", "t"])
        assert res.exit_code == 2, (args, res.output)
        assert res.exception is None or isinstance(res.exception, SystemExit), (args, repr(res.exception))
        assert message in " ".join(res.output.split()), (args, res.output)
        assert "Value error" not in res.output and "field ''" not in res.output


def test_no_server_and_a_wrong_token_say_what_to_do(server, monkeypatch, tmp_path):
    monkeypatch.setenv("TIDAL_HOME", str(tmp_path))
    res = runner.invoke(app, ["jobs", "--server", "http://127.0.0.1:9", "--token", "t"])
    text = " ".join(res.output.split())
    assert res.exit_code == 1 and "cannot reach the server at http://127.0.0.1:9" in text and "tidal up" in text
    res = runner.invoke(app, ["jobs", "--server", server.url, "--token", "not-a-token"])
    text = " ".join(res.output.split())
    assert res.exit_code == 1 and "401" in text and "admin.token" in text, text


def test_tables_fit_80_columns_and_never_cut_an_id(server, tmp_path):
    """`COLUMNS=80 tidal jobs`: whole job ids (they are pasted into the next
    command), no line wider than the terminal; -o wide/json/yaml."""
    import os
    import subprocess
    import sys

    import yaml

    token = cli(server, "user", "erin").stdout.strip()
    ids = []
    for name in ("a-rather-long-resnet50-imagenet-job", "bert-large-finetune-squad-v2"):
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(f"name: {name}\nscript: train.py\ngpus: 1-2\niterations: 50\n")
        (tmp_path / "train.py").write_text("")
        ids.append(cli(server, "submit", str(spec), token=token).stdout.split()[-1])

    def tidal(*args: str, columns: str = "80") -> str:
        env = dict(os.environ, COLUMNS=columns, TIDAL_SERVER=server.url, TIDAL_TOKEN=token)
        res = subprocess.run([sys.executable, "-m", "tidal", *args], env=env, capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        return res.stdout

    out = tidal("jobs")
    assert all(i in out for i in ids), out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    assert "…" not in out
    wide = tidal("jobs", "-o", "wide")
    assert "submitted" in wide and "rescales" in wide and all(i in wide for i in ids)
    assert [j["id"] for j in yaml.safe_load(tidal("jobs", "-o", "yaml"))] == [j["id"] for j in
                                                                              json.loads(tidal("jobs", "-o", "json"))]
    shown = tidal("job", ids[0])
    assert ids[0] in shown and "job.submitted" in shown and max(len(x) for x in shown.splitlines()) <= 80
    res = runner.invoke(app, ["jobs", "-o", "xml", "--server", server.url, "--token", token])
    assert res.exit_code == 2 and "choose one of table, wide, json, yaml" in " ".join(res.output.split())


@pytest.mark.slow  # 7 s: the default suite stays within 5 min
def test_logs_follow_prints_every_line_once_while_the_logs_grow(server, tmp_path):
    """`tidal logs ID -f` while three processes' logs grow (lines written in
    pieces, as an agent ships them): every line exactly once, whole, in each
    process's order, and the last line of each, also one without a newline,
    after the job ends."""
    import os
    import subprocess
    import sys
    import threading
    import time

    from tidal.control.db import Process, Store

    token = cli(server, "user", "fay").stdout.strip()
    spec = tmp_path / "job.yaml"
    spec.write_text("name: logs\nscript: train.py\ngpus: 100\niterations: 5\n")  # never fits: stays queued
    (tmp_path / "train.py").write_text("")
    jid = cli(server, "submit", str(spec), token=token).stdout.split()[-1]
    store = Store(f"sqlite:///{server.home / 'tidal.db'}", run_migrations=False)
    names = ("master", "w0", "w1")
    with store.session() as s:
        for n in names:
            s.add(Process(job_id=jid, name=n, kind="master" if n == "master" else "worker", node="n", argv=[], env={}))
    d = server.home / "logs" / jid
    d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TIDAL_SERVER=server.url, TIDAL_TOKEN=token)
    follower = subprocess.Popen([sys.executable, "-m", "tidal", "logs", jid, "-f"], env=env, stdout=subprocess.PIPE,
                                text=True)

    def write() -> None:
        for i in range(12):
            for n in names:
                with open(d / f"{n}.log", "a") as f:
                    f.write(f"{n} line {i} part one, ")
                    f.flush()
                    time.sleep(0.05)
                    f.write(f"part two of {i}\n")
            time.sleep(0.2)
        with open(d / "master.log", "a") as f:
            f.write("master's last words")  # no newline

    w = threading.Thread(target=write)
    w.start()
    w.join()
    time.sleep(1.5)
    assert cli(server, "cancel", jid, token=token).exit_code == 0
    out, _ = follower.communicate(timeout=60)
    assert follower.returncode == 0
    lines = out.splitlines()
    for n in names:
        mine = [x for x in lines if x.startswith(f"[{n}] ")]
        want = [f"[{n}] {n} line {i} part one, part two of {i}" for i in range(12)]
        assert mine[:12] == want, mine
    assert lines.count("[master] master's last words") == 1
    assert len(lines) == 37
