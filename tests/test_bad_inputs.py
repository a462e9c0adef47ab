"""The first hour's mistakes, as a corpus: every bad input to the CLI
(simulate, run, submit, scale, user, logs, ...) and to the HTTP API gets
one clear answer naming what is wrong: no traceback, no hang, a non-zero
exit (or a 4xx), and never a silent acceptance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tidal.cli.main import app
from tidal.control.local import LocalCluster, free_port

runner = CliRunner()
DEAD = f"http://127.0.0.1:{free_port()}"  # nothing listens there

# (arguments, a phrase the answer must contain); {d} is a directory of bad files, {t} a real trace
OFFLINE = [
    (["simulate"], "Missing option '--trace'"),
    (["simulate", "--trace", "{d}/none.csv"], "trace file does not exist"),
    (["simulate", "--trace", "{d}/garbage.csv"], "unknown trace format"),
    (["simulate", "--trace", "{d}/x[/y].csv"], "unknown trace format"),
    (["simulate", "--trace", "{d}/binary.csv"], "not a readable CSV file"),
    (["simulate", "--trace", "{d}/empty.csv"], "empty"),
    (["simulate", "--trace", "{t}", "--cluster", "n0g8"], "at least one node"),
    (["simulate", "--trace", "{t}", "--cluster", "banana"], "not a cluster spec"),
    (["simulate", "--trace", "{t}", "--cluster", "n4g8s3"], "do not divide"),
    (["simulate", "--trace", "{t}", "--cluster", "{d}/none-cluster.csv"], "not a cluster spec"),
    (["simulate", "--trace", "{t}", "--policy", "nope"], "unknown policy nope"),
    (["simulate", "--trace", "{t}", "--policy", ","], "unknown policy"),
    (["simulate", "--trace", "{t}", "--slot", "-5"], "--slot"),
    (["simulate", "--trace", "{t}", "--limit", "-3"], "field 'limit'"),
    (["simulate", "--trace", "{t}", "--limit", "0"], "field 'limit'"),
    (["simulate", "--trace", "{t}", "--limit", "x"], "--limit"),
    (["simulate", "--trace", "{t}", "--overhead", "magic"], "overhead mode"),
    (["simulate", "--trace", "{t}", "--format", "xml"], "unknown trace format 'xml'"),
    (["simulate", "--trace", "{t}", "--profiles", "{d}/none"], "profile directory does not exist"),
    (["simulate", "--trace", "{t}", "--seed", "x"], "--seed"),
    (["run"], "Missing argument"),
    (["run", "{d}/none.py"], "no such script"),
    (["run", "--workers", "0", "{d}/ok.py"], "--workers must be at least 1"),
    (["run", "--workers", "-1", "{d}/ok.py"], "--workers must be at least 1"),
    (["run", "--workers", "4", "--max-workers", "2", "{d}/ok.py"], "more than --max-workers"),
    (["run", "--state", "bogus://x", "{d}/ok.py"], "unknown state backend"),
    (["run", "--join", "nohostport", "{d}/ok.py"], "expected HOST:PORT"),
    (["run", "--join", "127.0.0.1:99999", "{d}/ok.py"], "not a TCP port"),
    (["run", "--join", DEAD.removeprefix("http://"), "--timeout", "3", "{d}/ok.py"], "no job master answers"),
    (["run", "--port", "70000", "{d}/ok.py"], "--port"),
    (["run", "--straggler-policy", "zap", "{d}/ok.py"], "--straggler-policy"),
    (["run", "--replication", "zap", "{d}/ok.py"], "--replication"),
    (["run", "--workers", "x", "{d}/ok.py"], "--workers"),
    (["scale"], "Missing argument"),
    (["scale", "x", "-2"], "No such option"),
    (["scale", "x", "two"], "gpus"),
    (["migrate", "nojob", "0"], "no running job 'nojob'"),
    (["profile"], "Missing argument"),
    (["submit"], "field 'name'"),
    (["submit", "{d}/none.yaml"], "no such file"),
    (["submit", "{d}/broken.yaml"], "not valid YAML"),
    (["submit", "{d}/markup.yaml"], "field 'name'"),
    (["submit", "{d}/noiter.yaml"], "give iterations or epochs"),
    (["submit", "{d}/binary.yaml"], "not a text (UTF-8) file"),
    (["submit", "{d}/list.yaml"], "mapping"),
    (["submit", "--name", "a", "--script", "x.py", "--gpus", "0", "--iterations", "5"], "field 'gpus'"),
    (["submit", "--name", "a", "--script", "x.py", "--gpus", "8-2", "--iterations", "5"], "field 'gpus'"),
    (["submit", "--name", "a", "--script", "x.py", "--gpus", "abc", "--iterations", "5"], "field 'gpus'"),
    (["submit", "--name", "a", "--script", "x.py", "--gpus", "1,x", "--iterations", "5"], "field 'gpus'"),
    (["submit", "--name", "a", "--script", "x.py", "--gpus", "-2", "--iterations", "5"], "field 'gpus'"),
    (["submit", "--name", "a", "--script", "x.py", "--gpus", "2", "--iterations", "-5"], "field 'iterations'"),
    (["submit", "--name", "a", "--script", "x.py", "--gpus", "2", "--iterations", "5", "--deadline", "-1"],
     "field 'deadline'"),
    (["submit", "--name", "", "--script", "x.py", "--gpus", "2", "--iterations", "5"], "field 'name'"),
    (["submit", "--name", "a", "--script", "x.py", "--gpus", "2", "--iterations", "5", "--batch-size", "0"],
     "field 'global_batch_size'"),
    (["submit", "--name", "a", "--script", "x.py", "--gpus", "2"], "give iterations or epochs"),
    (["user"], "Missing argument"),
    (["user", ""], "must not be empty"),
    (["logs"], "Missing argument"),
    (["jobs", "-o", "xml"], "choose one of"),
    (["cluster", "-o", "xml"], "choose one of"),
    (["job", "x", "-o", "xml"], "choose one of"),
    (["agent", "--virtual-gpus", "0"], "--virtual-gpus"),
    (["agent", "--virtual-gpus", "1", "--label", "rack1"], "expected KEY=VALUE"),
    (["server", "--policy", "nope"], "--policy nope: unknown policy"),
    (["server", "--port", "99999"], "--port"),
    (["server", "--tls-cert", "{d}/none.pem", "--tls-key", "{d}/none.key"], "no such file"),
    (["server", "--tls-cert", "{d}/ok.py"], "together"),
    (["demo", "--seed", "x"], "--seed"),
    (["nosuchcommand"], "No such command"),
    (["jobs", "--server", DEAD], "cannot reach the server"),
    (["cancel", "x", "--server", DEAD], "cannot reach the server"),
]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    (d / "garbage.csv").write_text("garbage,,\n1,2\n")
    (d / "x[").mkdir()
    (d / "x[" / "y].csv").write_text("[/bold],x\n")
    (d / "binary.csv").write_bytes(bytes(range(256)) * 4)
    (d / "empty.csv").write_text("")
    (d / "ok.py").write_text("print('ok')\n")
    (d / "broken.yaml").write_text("{bad yaml")
    (d / "markup.yaml").write_text('name: ["[/x]"]\nscript: t.py\ngpus: 2\niterations: 5\n')
    (d / "noiter.yaml").write_text("name: x\nscript: t.py\ngpus: 2\n")
    (d / "binary.yaml").write_bytes(bytes(range(256)))
    (d / "list.yaml").write_text("- a\n- b\n")
    (d / "noscript.yaml").write_text("name: x\nscript: missing.py\ngpus: 2\niterations: 5\n")
    return d


def _args(args: list[str], d: Path, trace: Path) -> list[str]:
    return [a.replace("{d}", str(d)).replace("{t}", str(trace)) for a in args]


def test_the_corpus_is_large_enough():
    assert len(OFFLINE) + len(ONLINE) + len(HTTP) >= 80


@pytest.mark.timeout(300)
def test_every_bad_cli_input_gets_one_clear_error(bad_files, tmp_path, monkeypatch):
    """In-process (CliRunner): fast, and a traceback shows as an exception."""
    monkeypatch.setenv("TIDAL_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    trace = Path(__file__).resolve().parent / "data" / "tiny_itp.csv"
    if not trace.exists():
        trace = bad_files / "tiny.csv"
        trace.write_text("job_id,submission_time,num_iteration,model_name,deadline,batch_size,num_gpu,"
                         "elastic\n1,0,100,resnet50,3600,256,2,1\n")
    bad = []
    for args, phrase in OFFLINE:
        argv = _args(args, bad_files, trace)
        res = runner.invoke(app, argv)
        text = " ".join(res.output.split())
        if res.exit_code == 0 or (res.exception is not None and not isinstance(res.exception, SystemExit)) \
                or phrase not in text or "Traceback" in text:
            bad.append((argv, res.exit_code, repr(res.exception), text[:300]))
    assert bad == [], "\n".join(map(str, bad))


# -- against a running server (no agents) -------------------------------------------
ONLINE = [
    (["user", "b;ob"], "user name"),
    (["submit", "--name", "a", "--script", "-c", "--gpus", "2", "--iterations", "5"], "interpreter option"),
    (["submit", "--name", "a", "--script", "{d}/ok.py", "--gpus", "64", "--iterations", "5"], "GPU"),
    # the server is on this host: a script that is not here cannot be where its agents are
    (["submit", "--name", "a", "--script", "{d}/nope.py", "--gpus", "2", "--iterations", "5"],
     "field 'script': {d}/nope.py does not exist"),
    (["submit", "{d}/noscript.yaml"], "field 'script': {d}/missing.py does not exist"),
    (["submit", "--name", "a", "--script", "{d}", "--gpus", "2", "--iterations", "5"],
     "field 'script': {d} is not a readable file"),
    (["scale", "nojob", "3"], "no job nojob"),
    (["logs", "nojob"], "no job nojob"),
    (["cancel", "nojob"], "no job nojob"),
    (["job", "nojob"], "no job nojob"),
    (["jobs", "--token", "wrong"], "401"),
]

# (method, path, body, expected status[, "admin": sent with the admin token])
HTTP = [
    ("POST", "/v1/jobs", {"name": "a", "script": "x.py", "gpus": "2", "epochs": float("inf")}, 422),
    ("POST", "/v1/jobs", {"name": "a", "script": "x.py", "gpus": "2", "iterations": -1}, 422),
    ("POST", "/v1/jobs", {"name": "a", "script": "x.py", "gpus": "2", "iterations": 5, "priority": 1e300}, 422),
    ("POST", "/v1/jobs", {"name": "a", "script": "x.py", "gpus": "1e40", "iterations": 5}, 422),
    ("POST", "/v1/jobs", {"name": "a", "script": "x.py", "gpus": "2", "iterations": 5, "deadline": -5}, 422),
    ("POST", "/v1/jobs", {"name": "a", "script": "x.py", "gpus": "2", "iterations": 5,
                          "env": {"LD_PRELOAD": "/tmp/x.so"}}, 422),
    ("POST", "/v1/jobs", {"name": "a", "script": "x.py", "gpus": "2", "iterations": 5,
                          "env": {"PYTHONPATH": "/tmp/x"}}, 422),
    ("POST", "/v1/jobs", {"name": "a", "script": "-c", "gpus": "2", "iterations": 5}, 422),
    ("POST", "/v1/jobs", {"name": "a", "script": "x.py", "gpus": "2", "iterations": 5, "elastic": False,
                          "min_gpus": 3}, 422),
    ("POST", "/v1/jobs", [1, 2, 3], 422),
    ("POST", "/v1/jobs", "not json", 422),
    ("POST", "/v1/jobs", {}, 422),
    ("POST", "/v1/jobs/nojob/scale", {"gpus": 2}, 404),
    ("POST", "/v1/jobs/nojob/cancel", None, 404),
    ("GET", "/v1/jobs/nojob/logs?worker=../../admin", None, 404),
    ("GET", "/v1/events?since=x", None, 422, "admin"),
    ("POST", "/v1/users/b%3Bob", None, 422, "admin"),
    ("POST", "/v1/users/admin", None, 409, "admin"),
    ("GET", "/v1/events", None, 403),
    ("POST", "/internal/agents/register", {"name": "evil", "num_gpus": 8}, 403),
    ("GET", "/v1/nothing", None, 404),
    ("DELETE", "/v1/jobs", None, 405),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("badsrv"), policy="fifo")
    c.start_server()
    from tidal.httpjson import JsonHttp

    # an 8-GPU node (no agent behind it): submissions are checked against the cluster's size
    JsonHttp(c.url, token=c.admin_token).call("POST", "/internal/agents/register", {"name": "n0", "num_gpus": 8})
    yield c
    c.stop()


@pytest.mark.timeout(300)
def test_bad_requests_to_a_running_server_get_a_clear_answer(server, bad_files, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # long paths on one line
    token = runner.invoke(app, ["user", "zed", "--server", server.url, "--token", server.admin_token]).stdout.strip()
    bad = []
    for args, phrase in ONLINE:
        args = _args(args, bad_files, bad_files)
        phrase = phrase.replace("{d}", str(bad_files))
        argv = [*args, "--server", server.url] + ([] if "--token" in args else ["--token", token])
        if args[0] == "user":
            argv = [*args, "--server", server.url, "--token", server.admin_token]
        res = runner.invoke(app, argv)
        text = " ".join(res.output.split())
        if res.exit_code == 0 or (res.exception is not None and not isinstance(res.exception, SystemExit)) \
                or phrase not in text:
            bad.append((args, res.exit_code, repr(res.exception), text[:300]))
    from tidal.httpjson import JsonHttp

    user = JsonHttp(server.url, token=token, patience_s=5)
    admin = JsonHttp(server.url, token=server.admin_token, patience_s=5)
    for method, path, body, status, *who in HTTP:
        http = admin if who == ["admin"] else user
        if body == "not json":
            r = http.send(method, path, None)
        else:
            r = http.send(method, path, body)
        ok = r.status == status and (r.status < 500) and len(r.body) < 20_000
        if ok and r.status >= 400 and r.is_json:
            ok = "detail" in r.json()
        if not ok:
            bad.append((method, path, r.status, r.text[:300]))
    assert bad == [], "\n".join(map(str, bad))


def test_no_bad_input_hangs_the_cli(bad_files, tmp_path):
    """The two that hung (tidal run --workers 0 / -1), as real processes."""
    env = dict(os.environ, TIDAL_HOME=str(tmp_path))
    for workers in ("0", "-1"):
        res = subprocess.run([sys.executable, "-m", "tidal", "run", "--workers", workers, str(bad_files / "ok.py")],
                             env=env, capture_output=True, text=True, timeout=30)
        assert res.returncode == 2 and "--workers must be at least 1" in res.stdout + res.stderr
