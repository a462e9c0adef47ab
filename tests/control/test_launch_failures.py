"""A job spec that can never launch must not break the cluster.

The real agent (its ``tick``) against the real server over HTTP: a launch
that fails (EACCES, a missing workdir) is tried once and reported ``failed``
with the OS error in ``Process.error``, while another job's process on the
same node starts in the same heartbeat; a lone surrogate in a report never
breaks the heartbeat; a row told to stop before it ever ran is reported
ended (a cancel completes). The submission refuses what can never launch
(422 naming the field, nothing stored) but takes ``TIDAL_CHECKPOINT_DIR``;
a job master's reported step never goes back."""

from __future__ import annotations

import errno
import json
import os
import pwd
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from tidal.agent.agent import Agent, launch_error, one_line, popen_launcher
from tidal.agent.limits import Limiter
from tidal.agent.proctable import Handle
from tidal.control.db import Event, Job, Process, Store
from tidal.control.local import free_port
from tidal.control.server import create_app

TOKEN = "admin-tok"
HDR = {"Authorization": f"Bearer {TOKEN}"}
GOOD = {"name": "j", "script": "/srv/train.py", "gpus": 1, "iterations": 10}


class Counting:
    """The default launcher, counting the launches of each process row."""

    def __init__(self, fail: OSError | None = None, failures: int = 0) -> None:
        self.calls: Counter[str] = Counter()
        self.fail, self.failures = fail, failures

    def __call__(self, w: dict[str, Any], argv: list[str], env: dict[str, str], cwd: str | None,
                 log_path: Path) -> Handle:
        self.calls[w["name"]] += 1
        if self.fail is not None and self.calls[w["name"]] <= self.failures:
            raise self.fail
        return popen_launcher(w, argv, env, cwd, log_path)


@pytest.fixture
def server(tmp_path):
    """The real app on a loopback port (SQLite), node n0 registered."""
    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    app = create_app(store, admin_token=TOKEN, home=tmp_path / "home", start_loop=False)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    c = TestClient(app)
    assert c.post("/internal/agents/register", json={"name": "n0", "num_gpus": 2, "virtual": True},
                  headers=HDR).status_code == 200
    yield f"http://127.0.0.1:{port}", store, c, tmp_path / "home"
    srv.should_exit = True
    t.join(timeout=10)


def agent_for(url: str, tmp_path: Path, launcher: Counting) -> Agent:
    a = Agent(url, TOKEN, "n0", 2, virtual=True, workdir=tmp_path / "agent", launcher=launcher,
              limiter=Limiter(None))
    a.registered = True  # the admin token heart-beats for n0 (registered by the fixture)
    return a


def add_rows(store: Store, *rows: dict[str, Any]) -> dict[str, int]:
    with store.session() as s:
        ps = [Process(node="n0", kind="worker", env={}, **r) for r in rows]
        s.add_all(ps)
        s.flush()
        return {p.name: p.id for p in ps}


def rows(store: Store) -> dict[str, Process]:
    with store.session(write=False) as s:
        out = {p.name: p for p in s.scalars(select(Process))}
        s.expunge_all()
        return out


def test_a_launch_that_fails_is_tried_once_reported_failed_and_the_other_job_starts(server, tmp_path):
    url, store, _, _ = server
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\necho never\n")
    script.chmod(0)  # no execute bit: exec gives EACCES, for root too
    ids = add_rows(store,
                   {"job_id": "bad", "name": "eacces", "argv": [str(script)]},
                   {"job_id": "bad", "name": "nodir", "argv": [sys.executable, "-c", "pass"],
                    "cwd": str(tmp_path / "no" / "such" / "dir")},
                   {"job_id": "other", "name": "good", "argv": [sys.executable, "-c", "print('trained')"]})
    launcher = Counting()
    agent = agent_for(url, tmp_path, launcher)
    agent.tick()  # the first heartbeat: every row launched once, the good one runs
    assert launcher.calls == {"eacces": 1, "nodir": 1, "good": 1}
    assert ids["good"] in agent.procs and ids["eacces"] not in agent.procs
    for _ in range(3):
        agent.tick()
    assert launcher.calls == {"eacces": 1, "nodir": 1, "good": 1}  # never tried again
    got = rows(store)
    assert got["eacces"].state == "failed" and got["eacces"].exit_code is None
    assert got["eacces"].error.startswith("launch failed: [Errno 13] Permission denied")
    assert str(script) in got["eacces"].error
    assert got["nodir"].state == "failed" and "[Errno 2] No such file or directory" in got["nodir"].error
    assert got["good"].state in ("running", "exited") and got["good"].error == ""
    with store.session(write=False) as s:
        failed = s.scalars(select(Event).where(Event.kind == "proc.failed")).all()
        assert {e.detail.get("proc") for e in failed} == {"eacces", "nodir"}
        assert all(e.detail["error"].startswith("launch failed") for e in failed)
    log = (tmp_path / "home" / "logs" / "bad" / "eacces.log").read_text()
    assert "launch failed" in log  # `tidal logs` shows why


def test_a_row_told_to_stop_before_it_ran_is_reported_ended(server, tmp_path):
    url, store, _, _ = server
    add_rows(store, {"job_id": "c", "name": "never", "argv": [sys.executable, "-c", "pass"], "desired": "stop"})
    launcher = Counting()
    agent = agent_for(url, tmp_path, launcher)
    agent.tick()
    agent.tick()
    got = rows(store)["never"]
    assert (got.state, got.exit_code, got.error) == ("exited", None, "")
    assert launcher.calls["never"] == 0


def test_a_lone_surrogate_in_a_report_never_breaks_the_heartbeat(server, tmp_path):
    url, store, c, home = server
    ids = add_rows(store, {"job_id": "s", "name": "w0", "argv": ["true"]},
                   {"job_id": "s", "name": "w1", "argv": [sys.executable, "-c", "pass"]})
    # as the server sees a lone surrogate (a JSON escape no UTF-8 text can hold)
    body = json.dumps({"procs": [{"id": ids["w0"], "state": "running", "pid": 1, "log": "bad \udc80 line\n",
                                  "error": "x\udc80"}]})
    r = c.post("/internal/agents/n0/heartbeat", content=body, headers={**HDR, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert "bad \\udc80 line" in (home / "logs" / "s" / "w0.log").read_text()
    bogus = json.dumps({"procs": [{"id": ids["w1"], "state": "\udc80"}]})
    r = c.post("/internal/agents/n0/heartbeat", content=bogus, headers={**HDR, "Content-Type": "application/json"})
    assert r.status_code == 422
    # the agent's own report holding one (e.g. read back from its process table) is delivered
    agent = agent_for(url, tmp_path, Counting())
    agent.finished[ids["w0"]] = {"id": ids["w0"], "state": "failed", "pid": 0, "exit_code": None,
                                 "log": "\udc80\n", "error": "launch failed: \udc80"}
    agent.tick()
    agent.tick()
    got = rows(store)
    assert got["w0"].state == "failed" and got["w0"].error == "launch failed: \\udc80"
    assert got["w1"].state in ("running", "exited")  # the same heartbeat launched the other row


def test_one_bad_row_never_stops_the_others_and_its_reason_stays_short(tmp_path):
    launcher = Counting()
    agent = Agent("http://127.0.0.1:9", TOKEN, "n0", 1, virtual=True, workdir=tmp_path, launcher=launcher,
                  limiter=Limiter(None))
    wanted = [{"id": 1, "job": "j", "name": "huge", "argv": [sys.executable, "x" * 200_000], "desired": "run"},
              {"id": 2, "job": "j", "name": "nul", "argv": [sys.executable, "a\0b"], "desired": "run"},
              {"id": 3, "job": "j", "name": "garbage"},  # no argv, no desired: an agent error, reported
              {"id": 4, "job": "j", "name": "ok", "argv": [sys.executable, "-c", "pass"], "desired": "run"}]
    agent._reconcile(wanted)
    agent._reconcile(wanted)
    assert 4 in agent.procs and launcher.calls == {"huge": 1, "nul": 1, "ok": 1}
    huge, nul, garbage = (agent.finished[i] for i in (1, 2, 3))
    assert huge["error"] == f"launch failed: [Errno 7] Argument list too long: '{sys.executable}'"
    assert nul["error"] == "launch failed: ValueError: embedded null byte"
    assert garbage["state"] == "failed" and "KeyError" in garbage["error"]
    assert all(r["state"] == "failed" and r["exit_code"] is None for r in (huge, nul, garbage))
    long = launch_error(OSError(errno.E2BIG, "Argument list too long", "y" * 200_000 + "\udc80\n"))
    assert len(long) <= 2000 and long.endswith("\\udc80\\n'") and "\n" not in long
    assert one_line("a\0b") == "a\\x00b"


def test_a_transient_launch_error_is_tried_again_a_few_times(tmp_path):
    row = {"id": 7, "job": "j", "name": "w", "argv": [sys.executable, "-c", "pass"], "desired": "run"}
    flaky = Counting(OSError(errno.EAGAIN, "Resource temporarily unavailable"), failures=2)
    agent = Agent("http://127.0.0.1:9", TOKEN, "n0", 1, virtual=True, workdir=tmp_path / "a", launcher=flaky,
                  limiter=Limiter(None))
    for _ in range(4):
        agent._reconcile([row])
    assert flaky.calls["w"] == 3 and 7 in agent.procs and 7 not in agent.finished
    broken = Counting(OSError(errno.EAGAIN, "Resource temporarily unavailable"), failures=99)
    agent = Agent("http://127.0.0.1:9", TOKEN, "n0", 1, virtual=True, workdir=tmp_path / "b", launcher=broken,
                  limiter=Limiter(None))
    for _ in range(5):
        agent._reconcile([row])
    assert broken.calls["w"] == 3 and agent.finished[7]["error"].startswith("launch failed: [Errno 11]")


# -- the submission ---------------------------------------------------------------------------
@pytest.fixture
def api(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    app = create_app(store, admin_token=TOKEN, home=tmp_path, start_loop=False)
    c = TestClient(app, raise_server_exceptions=False)
    c.post("/internal/agents/register", json={"name": "n0", "num_gpus": 4, "virtual": True}, headers=HDR)
    return c, store


def _jobs(store: Store) -> int:
    with store.session(write=False) as s:
        return int(s.scalar(select(func.count()).select_from(Job)))


@pytest.mark.parametrize("extra, field, reason", [
    ({"args": ["x" * 200 * 1024]}, "args", "over the 131071"),
    ({"args": ["y" * 120 * 1024] * 5}, "script, args and env", "ARG_MAX"),
    ({"script": "/srv/tr\0ain.py"}, "script", "NUL"),
    ({"args": ["--lr", "\udc80"]}, "args", "lone surrogate"),
    ({"workdir": "/srv/a\nb"}, "workdir", "control character"),
    ({"env": {"A=B": "1"}}, "env", "not a variable name"),
    ({"env": {"APP_X": "a\0b"}}, "env", "NUL"),
    ({"model": "\udc80"}, "model", "lone surrogate"),
])
def test_what_can_never_launch_is_refused_naming_the_field(api, extra, field, reason):
    c, store = api
    body = json.dumps({**GOOD, **extra}).encode()  # a lone surrogate travels as its JSON escape
    r = c.post("/v1/jobs", content=body, headers={**HDR, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert field in r.text and reason in r.text and len(r.text) < 2000  # named, never echoed
    assert _jobs(store) == 0


def test_a_job_may_set_its_checkpoint_directory_but_not_the_control_planes_variables(api, monkeypatch):
    c, store = api
    env = {"TIDAL_CHECKPOINT_DIR": "/shared/ckpt/j", "TIDAL_CHECKPOINT_SHARED": "1"}
    assert c.post("/v1/jobs", json={**GOOD, "env": env}, headers=HDR).status_code == 201
    for bad in ({"TIDAL_CHECKPOINT_DIR": "ckpt"}, {"TIDAL_MASTER_URL": "http://x"}, {"TIDAL_WORKER_ID": "w0"},
                {"TIDAL_JOB_TOKEN": "t"}):
        r = c.post("/v1/jobs", json={**GOOD, "env": bad}, headers=HDR)
        assert r.status_code == 422 and f"env.{next(iter(bad))}" in r.text
    monkeypatch.setenv("TIDAL_TENANT_ROOT", "/srv/tenants")
    r = c.post("/v1/jobs", json={**GOOD, "env": {"TIDAL_CHECKPOINT_DIR": "/etc/x"}}, headers=HDR)
    assert r.status_code == 422 and "outside" in r.text
    assert _jobs(store) == 1


def test_a_masters_reported_step_never_goes_back(api):
    c, store = api
    job = c.post("/v1/jobs", json=GOOD, headers=HDR).json()["id"]
    assert c.post(f"/internal/jobs/{job}/status", json={"state": "running", "step": 486, "world_size": 2},
                  headers=HDR).status_code == 200
    # a master restarted on another host reports from where it stands, once 0
    assert c.post(f"/internal/jobs/{job}/status", json={"state": "changing", "step": 0, "world_size": 1},
                  headers=HDR).status_code == 200
    with store.session(write=False) as s:
        j = s.get(Job, job)
        first_at = j.progress.pop("step_at")
        assert j.progress.pop("reported_at") >= first_at
        assert j.progress == {"state": "changing", "step": 486, "world_size": 1} and j.done == 486
    c.post(f"/internal/jobs/{job}/status", json={"state": "running", "step": 490, "world_size": 2}, headers=HDR)
    with store.session(write=False) as s:
        assert s.get(Job, job).progress["step"] == 490 and s.get(Job, job).done == 490
        moved_at = s.get(Job, job).progress["step_at"]
    # the stall judge's clock: when the step last advanced (a report at the same step keeps it)
    assert moved_at >= first_at
    c.post(f"/internal/jobs/{job}/status", json={"state": "running", "step": 490, "world_size": 2,
                                                  "step_at": 1.0}, headers=HDR)
    with store.session(write=False) as s:
        assert s.get(Job, job).progress["step_at"] == moved_at


@pytest.mark.skipif(os.geteuid() != 0, reason="the run-as launcher needs root")
def test_run_as_never_hands_over_a_directory_it_did_not_make(tmp_path):
    from tidal.agent.runas import RunAs

    nobody = pwd.getpwnam("nobody")
    ra = RunAs("nobody")
    theirs = tmp_path / "etc"
    theirs.mkdir(mode=0o755)
    ra.private_dir(theirs)  # a job's env named an existing directory that is not the user's
    assert (theirs.stat().st_uid, theirs.stat().st_mode & 0o777) == (0, 0o755)
    link = tmp_path / "link"
    link.symlink_to(theirs)
    ra.private_dir(link)
    assert theirs.stat().st_uid == 0
    fresh = tmp_path / "ckpt" / "j"
    ra.private_dir(fresh)
    assert (fresh.stat().st_uid, fresh.stat().st_mode & 0o777) == (nobody.pw_uid, 0o700)
    ra.private_dir(fresh)  # the user's already: kept
    assert fresh.stat().st_uid == nobody.pw_uid


def test_the_status_answer_names_the_workers_that_ended_badly(api):
    c, store = api
    job = c.post("/v1/jobs", json=GOOD, headers=HDR).json()["id"]
    with store.session() as s:
        s.add(Process(job_id=job, name="master", kind="master", node="n", state="running"))
        for name, state, code in (("w0", "running", None), ("w1", "failed", -9), ("w2", "exited", 0),
                                  ("w3", "failed", 1), ("w4", "lost", None)):
            s.add(Process(job_id=job, name=name, kind="worker", node="n", state=state, exit_code=code))
    r = c.post(f"/internal/jobs/{job}/status", json={"state": "forming", "step": 0, "world_size": 0}, headers=HDR)
    assert r.json()["ended"] == {"w1": -9, "w3": 1, "w4": -9}
