"""One job cannot reach another's credential, files or logs on a shared
host: an agent running as root with ``--run-as LO-HI`` starts jobs A and B
under uids of their own; B's process attacks A's running process the ways a
tenant's script could (its ``/proc`` environment, its credential file, its
private and checkpoint directories, its log, a signal) and is denied each
time, while it reads its own credential. Without run-as the job's directory
and credential file are still made (the agent's own, 0700 and 0600) and go
once the job has no process here and the server wants none."""

from __future__ import annotations

import json
import os
import pwd
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tidal import settings
from tidal.agent import Agent
from tidal.agent.limits import Limiter
from tidal.agent.runas import RunAs, proc_uids

RANGE = "200000-299999"

# a Python the unprivileged users may run (this machine's pyenv lives under /root, 0700)
PYTHON = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable)
               if os.access(p, os.X_OK) and not p.startswith("/root/")), sys.executable)

VICTIM = """
import sys, time
print("ready", flush=True)
time.sleep(60)
"""

ATTACKER = """
import json, os, signal, sys
cfg = json.loads(sys.argv[1])
out = {}

def attempt(name, fn):
    try:
        fn()
        out[name] = "ALLOWED"
    except PermissionError:
        out[name] = "denied"
    except OSError as e:
        out[name] = "error: %s" % e

pids = []
for d in os.listdir("/proc"):
    if d.isdigit():
        try:
            if cfg["marker"].encode() in open("/proc/%s/cmdline" % d, "rb").read().split(b"\\0"):
                pids.append(int(d))
        except OSError:
            pass
out["victim_pids"] = pids
for pid in pids:
    attempt("environ", lambda: open("/proc/%d/environ" % pid, "rb").read())
    attempt("mem", lambda: open("/proc/%d/mem" % pid, "rb").read(1))
    attempt("cwd", lambda: os.listdir("/proc/%d/cwd" % pid))
    attempt("signal", lambda: os.kill(pid, 0))
    attempt("sigkill", lambda: os.kill(pid, signal.SIGKILL))
for name in ("token", "job_dir", "log", "log_dir", "ckpt", "jobs"):
    path = cfg[name]
    is_dir = name in ("job_dir", "log_dir", "ckpt", "jobs")
    attempt(name, (lambda p=path: os.listdir(p)) if is_dir else (lambda p=path: open(p, "rb").read()))
out["own_token"] = open(os.environ[cfg["token_var"]]).read()
out["own_token_in_env"] = "secret-B" in open("/proc/self/environ", "rb").read().decode(errors="replace")
print(json.dumps(out), flush=True)
"""


def wait_for(cond, timeout: float = 15.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def row(wid: int, job: str, argv: list[str], cwd: Path, **env: str) -> dict[str, Any]:
    return {"id": wid, "job": job, "name": f"w{wid}", "kind": "worker", "cwd": str(cwd), "argv": argv,
            "env": env, "desired": "run"}


@pytest.mark.skipif(os.geteuid() != 0, reason="starting processes as other users needs root")
def test_a_job_cannot_reach_another_jobs_credential_files_logs_or_processes(open_tmp):
    base = open_tmp
    work = base / "agent"
    agent = Agent("http://127.0.0.1:9", "t", "n0", 2, virtual=True, workdir=work, launcher=RunAs(RANGE),
                  limiter=Limiter(None))
    work.chmod(0o755)
    for name, text in (("victim.py", VICTIM), ("attacker.py", ATTACKER)):
        (base / name).write_text(text)
        (base / name).chmod(0o644)
    marker = f"victim-{os.getpid()}-{time.monotonic_ns()}"
    ckpt_a, ckpt_b = base / "ckpt" / "job-a", base / "ckpt" / "job-b"
    try:
        agent._launch(row(1, "job-a", [PYTHON, str(base / "victim.py"), marker], base,
                          **{settings.JOB_TOKEN.name: "secret-A", settings.CHECKPOINT_DIR.name: str(ckpt_a)}))
        a = agent.procs[1]
        assert wait_for(lambda: "ready" in a.log_path.read_text()), a.log_path.read_text()
        (ckpt_a / "step-1.pt").write_bytes(b"A's weights")
        cfg = {"marker": marker, "token_var": settings.JOB_TOKEN_FILE.name,
               "token": str(work / "jobs" / "job-a" / "token"), "job_dir": str(work / "jobs" / "job-a"),
               "log": str(a.log_path), "log_dir": str(a.log_path.parent), "ckpt": str(ckpt_a),
               "jobs": str(work / "jobs")}
        agent._launch(row(2, "job-b", [PYTHON, str(base / "attacker.py"), json.dumps(cfg)], base,
                          **{settings.JOB_TOKEN.name: "secret-B", settings.CHECKPOINT_DIR.name: str(ckpt_b)}))
        b = agent.procs[2]
        assert wait_for(lambda: b.handle.poll() is not None)
        text = b.log_path.read_text()
        assert b.handle.poll() == 0, text
        out = json.loads(text.strip().splitlines()[-1])

        # two uids of their own, neither root nor nobody
        uid_a, uid_b = max(proc_uids(a.handle.pid)), os.stat(work / "jobs" / "job-b").st_uid
        assert proc_uids(a.handle.pid) == {uid_a} and uid_a != uid_b
        assert {uid_a, uid_b}.isdisjoint({0, pwd.getpwnam("nobody").pw_uid})
        assert 200000 <= min(uid_a, uid_b) and max(uid_a, uid_b) <= 299999
        assert os.stat(work / "jobs" / "job-a").st_uid == uid_a and ckpt_a.stat().st_uid == uid_a

        # the attack really aimed at A's process (else every "denied" below proves nothing) ...
        assert out["victim_pids"] == [a.handle.pid], out
        # ... and every way in was shut
        attacks = ("environ", "mem", "cwd", "signal", "sigkill", "token", "job_dir", "log", "log_dir", "ckpt",
                   "jobs")
        assert {k: out.get(k) for k in attacks} == {k: "denied" for k in attacks}, out
        assert a.handle.poll() is None  # alive: B's SIGKILL did not reach it
        # B reads its own credential, which is in no process's environment
        assert out["own_token"] == "secret-B" and not out["own_token_in_env"]
        assert b"secret-A" not in Path(f"/proc/{a.handle.pid}/environ").read_bytes()
    finally:
        agent.shutdown()


def test_the_job_directory_holds_the_credential_and_goes_with_the_jobs_last_process(tmp_path):
    """Without run-as (any user): the job's directory, its credential file,
    the environment naming them; removed only when the job has no process
    here and the server wants none of it here."""
    agent = Agent("http://127.0.0.1:9", "t", "n0", 1, virtual=True, workdir=tmp_path / "agent",
                  limiter=Limiter(None))
    gate = tmp_path / "go"
    script = ("import os, sys, time, json\n"
              "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\n"
              "print(json.dumps(dict(os.environ)), flush=True)\n")
    r = row(1, "jd", [sys.executable, "-c", script, str(gate)], tmp_path, **{settings.JOB_TOKEN.name: "secret-J"})
    answers: list[list[dict[str, Any]]] = []
    agent._post = lambda path, body: {"workers": answers.pop(0) if answers else []}  # type: ignore[method-assign]
    agent._launch(r)
    job_dir = tmp_path / "agent" / "jobs" / "jd"
    token = job_dir / "token"
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700 and stat.S_IMODE(token.stat().st_mode) == 0o600
    assert token.read_text() == "secret-J"
    answers.append([])  # the server wants nothing here, but the process runs: kept
    agent.tick()
    assert job_dir.is_dir()
    gate.touch()
    p = agent.procs[1]
    assert wait_for(lambda: p.handle.poll() is not None) and p.handle.poll() == 0
    env = json.loads(p.log_path.read_text().strip().splitlines()[-1])
    assert settings.JOB_TOKEN.name not in env and "secret-J" not in json.dumps(env)
    assert env[settings.JOB_TOKEN_FILE.name] == str(token) and env[settings.JOB_DIR.name] == str(job_dir)
    answers.append([{**r, "state": "running"}])  # its exit not taken yet: the row is still wanted
    agent.tick()
    assert job_dir.is_dir()
    agent.tick()  # exit reported, nothing wanted here
    assert not job_dir.exists()
    assert stat.S_IMODE(p.log_path.stat().st_mode) == 0o600


def test_logs_written_before_are_made_private_when_the_agent_starts(tmp_path):
    old = tmp_path / "agent" / "logs" / "j"
    old.mkdir(parents=True, mode=0o755)
    (old / "w0.log").write_text("x")
    (old / "w0.log").chmod(0o644)
    os.chmod(old.parent, 0o755)
    os.chmod(old, 0o755)
    Agent("http://127.0.0.1:9", "t", "n0", 1, virtual=True, workdir=tmp_path / "agent", limiter=Limiter(None))
    assert [stat.S_IMODE(p.stat().st_mode) for p in (old.parent, old, old / "w0.log")] == [0o700, 0o700, 0o600]
