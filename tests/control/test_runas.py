"""Job processes as an unprivileged user: an agent running as root with
``--run-as nobody`` starts a job's process as that user (no supplementary
groups, umask 077); the process cannot read the agent's private files but
can read where its master is and write its own checkpoint directory, which
only it (and root) can enter."""

from __future__ import annotations

import os
import pwd
import sys
import time
from pathlib import Path

import pytest

from tidal import settings
from tidal.agent import Agent
from tidal.agent.runas import RunAs

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
