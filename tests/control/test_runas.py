"""Job processes as an unprivileged user: an agent running as root with
``--run-as nobody`` starts a job's process as that user (no supplementary
groups, umask 077); the process cannot read the agent's private files but
can read where its master is and write its own checkpoint directory, which
only it (and root) can enter. With ``--run-as LO-HI`` each job gets a uid
(and group) of its own, its private directory as ``$HOME`` and its
credential in a 0600 file there, never in its environment. (Jobs attacking
each other: test_job_isolation.py.)"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import sys
import time
from pathlib import Path

import pytest

from tidal import settings
from tidal.agent import Agent
from tidal.agent.runas import RunAs, parse_range

#: uids for the tests' jobs (no user or group of a usual host has one)
RANGE = "200000-299999"

SCRIPT = """
import os, sys, json
out = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups()}
try:
    open(sys.argv[1]).read(); out["private"] = "read"
except PermissionError:
    out["private"] = "denied"
out["master_file"] = open(os.environ["TIDAL_MASTER_FILE"]).read()
ck = os.environ["TIDAL_CHECKPOINT_DIR"]
open(os.path.join(ck, "step-1.pt"), "w").write("x")
out["ckpt_mode"] = oct(os.stat(os.path.join(ck, "step-1.pt")).st_mode & 0o777)
print(json.dumps(out), flush=True)
"""


# a Python the unprivileged user may run (this machine's pyenv lives under /root, 0700)
PYTHON = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable)
               if os.access(p, os.X_OK) and not p.startswith("/root/")), sys.executable)


@pytest.mark.skipif(os.geteuid() != 0, reason="starting processes as another user needs root")
def test_an_agent_as_root_starts_job_processes_as_the_run_as_user(tmp_path):
    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"tidal-runas-{os.getpid()}"
    base.mkdir(mode=0o755)  # traversable by the user (pytest's own tmp dirs are 0700)
    try:
        nobody = pwd.getpwnam("nobody")
        work = base / "agent"
        agent = Agent("http://127.0.0.1:9", "t", "n0", 1, virtual=True, workdir=work, launcher=RunAs("nobody"))
        work.chmod(0o755)
        (base / "job.py").write_text(SCRIPT)
        (base / "job.py").chmod(0o644)
        secret = work / "procs.json"  # the agent's own table: 0600, root's
        secret.write_text("{}")
        secret.chmod(0o600)
        agent._write_master_urls({"j": "http://10.0.0.9:5000"})
        ckpt = base / "checkpoints" / "j"
        agent._launch({"id": 1, "job": "j", "name": "w0", "kind": "worker", "cwd": str(base),
                       "argv": [PYTHON, str(base / "job.py"), str(secret)],
                       "env": {settings.CHECKPOINT_DIR.name: str(ckpt)}})
        p = agent.procs[1]
        deadline = time.time() + 60
        while p.handle.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        log = p.log_path.read_text()
        assert p.handle.poll() == 0, log
        import json

        out = json.loads(log.strip().splitlines()[-1])
        assert (out["uid"], out["gid"]) == (nobody.pw_uid, nobody.pw_gid)
        assert set(out["groups"]) <= {nobody.pw_gid}  # no supplementary group of the agent
        assert out["private"] == "denied"
        assert out["master_file"] == "http://10.0.0.9:5000"
        assert out["ckpt_mode"] == "0o600"  # umask 077
        st = ckpt.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (nobody.pw_uid, 0o700)
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_run_as_is_refused_for_root_or_an_unknown_user():
    with pytest.raises(ValueError, match="no such user"):
        RunAs("no-such-user-tidal")
    if os.geteuid() == 0:
        with pytest.raises(ValueError, match="unprivileged"):
            RunAs("root")


RANGED = """
import json, os, stat, sys
job_dir, token_var, dir_var, ckpt_var = sys.argv[1:5]
out = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "home": os.environ.get("HOME"),
       "user": os.environ.get("USER"), "job_dir": os.environ.get(dir_var),
       "token_in_env": any(k.endswith("JOB_TOKEN") for k in os.environ),
       "secret_in_proc_environ": b"secret-r" in open("/proc/self/environ", "rb").read()}
st = os.stat(out["job_dir"])
out["dir"] = [st.st_uid, oct(st.st_mode & 0o777)]
path = os.environ[token_var]
out["token_path"] = path
out["token"] = open(path).read()
out["token_mode"] = [os.stat(path).st_uid, oct(os.stat(path).st_mode & 0o777)]
open(os.path.join(os.environ["HOME"], "state.json"), "w").write("{}")  # what a job master keeps there
open(os.path.join(os.environ[ckpt_var], "step-1.pt"), "w").write("x")
print(json.dumps(out), flush=True)
"""


def wait_exit(p, timeout=20.0):
    deadline = time.time() + timeout
    while p.handle.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    return p.handle.poll()


@pytest.mark.skipif(os.geteuid() != 0, reason="starting processes as another user needs root")
def test_a_uid_range_runs_a_job_as_its_own_uid_with_a_private_home_and_its_credential_in_a_file(open_tmp):
    base = open_tmp
    work = base / "agent"
    ra = RunAs(RANGE)
    agent = Agent("http://127.0.0.1:9", "t", "n0", 1, virtual=True, workdir=work, launcher=ra)
    work.chmod(0o755)
    (base / "job.py").write_text(RANGED)
    (base / "job.py").chmod(0o644)
    ckpt = base / "ckpt" / "jr"
    agent._launch({"id": 1, "job": "jr", "name": "w0", "kind": "worker", "cwd": str(base),
                   "argv": [PYTHON, str(base / "job.py"), str(work / "jobs" / "jr"), settings.JOB_TOKEN_FILE.name,
                            settings.JOB_DIR.name, settings.CHECKPOINT_DIR.name],
                   "env": {settings.JOB_TOKEN.name: "secret-r", settings.CHECKPOINT_DIR.name: str(ckpt)}})
    p = agent.procs[1]
    code = wait_exit(p)
    text = p.log_path.read_text()
    assert code == 0, text
    out = json.loads(text.strip().splitlines()[-1])
    uid = out["uid"]
    lo, hi = parse_range(RANGE)
    assert lo <= uid <= hi and uid == ra.slot("jr")  # its stable slot (nothing else holds it here)
    assert uid != pwd.getpwnam("nobody").pw_uid and out["gid"] == uid and set(out["groups"]) <= {uid}
    job_dir = str(work / "jobs" / "jr")
    assert out["home"] == out["job_dir"] == job_dir and out["user"] == f"tidal-{uid}"
    assert out["dir"] == [uid, "0o700"]
    assert out["token"] == "secret-r" and out["token_mode"] == [uid, "0o600"]
    assert out["token_path"] == job_dir + "/token"
    assert not out["token_in_env"] and not out["secret_in_proc_environ"]
    st = os.stat(work / "jobs" / "jr" / "state.json")
    assert (st.st_uid, st.st_mode & 0o777) == (uid, 0o600)  # umask 077
    st = ckpt.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (uid, 0o700)
    # its log: the agent's, 0600, in 0700 directories
    for path, mode in ((p.log_path, 0o600), (p.log_path.parent, 0o700), (p.log_path.parent.parent, 0o700)):
        st = path.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, mode), path
    # the table of processes stays the agent's; the master URL files are readable by every job user
    agent._write_master_urls({"jr": "http://10.0.0.9:5000"})
    assert stat.S_IMODE((work / "masters").stat().st_mode) == 0o755
    assert stat.S_IMODE((work / "masters" / "jr.url").stat().st_mode) == 0o644
    assert stat.S_IMODE((work / "procs.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((work / "jobs").stat().st_mode) == 0o711  # passable, not listable


@pytest.mark.skipif(os.geteuid() != 0, reason="starting processes as another user needs root")
def test_a_jobs_uid_is_stable_and_probes_past_a_slot_held_by_another_job(tmp_path):
    ra = RunAs(RANGE)
    a = ra.slot("job-a")
    assert ra.identity("job-a", {}, set).uid == a == RunAs(RANGE).slot("job-a")  # the same on every host
    # another job holds the slot here (its processes or its directory): the next free uid
    got = ra.identity("job-a", {a: "job-b"}, lambda: {a + 1 if a < 299999 else 200000})
    assert got.uid not in (a, a + 1) and got.gid == got.uid
    # the uid a job holds here already is its own, wherever its slot is
    assert ra.identity("job-a", {a: "job-b", 250000: "job-a"}, set).uid == 250000
    one = RunAs("200000-200000")
    with pytest.raises(OSError, match="every uid"):
        one.identity("x", {200000: "y"}, set)


@pytest.mark.parametrize("spec, phrase", [
    ("0-10", "uids must lie in"), ("5-999", "uids must lie in"), ("300000-200000", "empty"),
    ("200000-abc", "expected a user name or a uid range"), ("200000", "expected"),
    ("200000-4294967295", "uids must lie in"),
])
def test_a_bad_uid_range_is_refused_in_one_line(spec, phrase):
    with pytest.raises(ValueError, match=phrase) as e:
        RunAs(spec)
    assert "\n" not in str(e.value)


def test_a_range_holding_a_users_uid_is_refused():
    uid = pwd.getpwnam("nobody").pw_uid
    with pytest.raises(ValueError, match="of user 'nobody'"):
        parse_range(f"{uid - 5}-{uid + 5}")


def test_the_cli_prints_a_bad_run_as_in_one_line_without_a_traceback(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from tidal.cli.main import app

    monkeypatch.setenv(settings.HOME.name, str(tmp_path))
    res = CliRunner().invoke(app, ["agent", "--virtual-gpus", "1", "--run-as", "300000-200000"])
    assert res.exit_code == 2 and "the range is empty" in res.output and "Traceback" not in res.output


def _passes(uid: int, path: Path) -> bool:
    """Whether ``uid`` (no groups) can enter ``path``."""
    import subprocess

    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sh", "-c",
                           f'cd "{path}"'], capture_output=True).returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="starting processes as other users needs root")
def test_under_umask_077_the_agent_lets_job_users_pass_its_own_directories_and_names_any_other(
        open_tmp, tmp_path, monkeypatch):
    from tidal.agent.runas import Unreachable

    uid = int(RANGE.split("-")[0]) + 7
    home = open_tmp / "home"
    monkeypatch.setenv(settings.HOME.name, str(home))
    old = os.umask(0o077)  # a hardened host's, or a process that set it (a server in this process)
    try:
        home.mkdir()
        Agent("http://127.0.0.1:9", "t", "n0", 1, virtual=True, workdir=home / "agents" / "n0", launcher=RunAs(RANGE))
        # pytest's own directories (0700, root's, neither the agent's work directory nor the home): named
        closed = tmp_path.parent.parent  # /tmp/pytest-of-root
        assert not closed.stat().st_mode & stat.S_IXOTH
        work = tmp_path / "agent"
        with pytest.raises(Unreachable) as e:
            Agent("http://127.0.0.1:9", "t", "n1", 1, virtual=True, workdir=work, launcher=RunAs(RANGE))
        shut = [d for d in reversed((tmp_path, *tmp_path.parents)) if not d.stat().st_mode & stat.S_IXOTH]
        assert closed in shut and tmp_path in shut  # each 0700, from the top
        assert f"{', '.join(f'{d} (mode {d.stat().st_mode & 0o777:o})' for d in shut)} let no other user pass; allow them " \
               f"(chmod o+x {' '.join(map(str, shut))})" in str(e.value), e.value
    finally:
        os.umask(old)
    chain = [home, home / "agents", home / "agents" / "n0"]
    assert [oct(d.stat().st_mode & 0o777) for d in chain] == ["0o701"] * 3  # others pass, never list
    jobs = home / "agents" / "n0" / "jobs"
    jobs.mkdir(exist_ok=True)
    assert _passes(uid, jobs)
    assert not _passes(uid, home / "agents" / "n0" / "logs")  # its own private ones stay closed
    assert oct(work.stat().st_mode & 0o777) == "0o700"  # nothing changed before the error


@pytest.mark.skipif(os.geteuid() != 0, reason="starting processes as other users needs root")
def test_the_cli_refuses_a_run_as_agent_whose_jobs_could_not_reach_their_directories(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from tidal.cli.main import app

    monkeypatch.setenv(settings.HOME.name, str(tmp_path / "home"))  # under pytest's 0700 directories
    res = CliRunner().invoke(app, ["agent", "--virtual-gpus", "1", "--run-as", RANGE, "--server",
                                   "http://127.0.0.1:9", "--token", "t"])
    assert res.exit_code == 2 and "job users cannot reach" in res.output and "Traceback" not in res.output, \
        res.output
    assert len(res.output.strip().splitlines()) <= 2  # one line (rich may wrap it)


@pytest.mark.skipif(os.geteuid() != 0, reason="starting processes as other users needs root")
def test_under_umask_077_a_checkpoint_directory_the_agent_makes_is_reachable_by_its_job(open_tmp):
    nobody = pwd.getpwnam("nobody")
    ck = open_tmp / "checkpoints" / "team" / "job-a"
    old = os.umask(0o077)
    try:
        RunAs("nobody").private_dir(ck)
    finally:
        os.umask(old)
    assert (ck.stat().st_uid, stat.S_IMODE(ck.stat().st_mode)) == (nobody.pw_uid, 0o700)
    assert _passes(nobody.pw_uid, ck)  # through the two directories made for it (0701: pass, not list)
    assert [stat.S_IMODE(d.stat().st_mode) for d in (ck.parent, ck.parent.parent)] == [0o701, 0o701]
