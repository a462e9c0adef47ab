"""The leader's host goes silent (powered off, link cut: no FIN, no reset)
and a follower leads within the lease bound. Network namespaces stand in for
hosts (tests/multihost/netns.py): PostgreSQL and an agent with 2 virtual GPUs
on host 0, server replica A on host 1, replica B on host 2, the test's API
client in host 0. A leads; A's link is cut on the switch. Within
``TIDAL_LEADER_LEASE_S`` (+ a tick) PostgreSQL drops A's session, whose
keepalives and user timeout the server set, B takes the advisory lock and a
job submitted after the cut is scheduled. A, still running but cut off, says
it no longer leads (seen from inside its host) before B leads; after the
link heals it stays a follower. Then every process of A's host is killed.

Without the bound, PostgreSQL kept A's session, and its lock, until the
kernel's keepalive default (2 h): nothing was scheduled meanwhile."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from tidal.control.client import Api

REPO = Path(__file__).resolve().parents[2]
DEMO_JOB = REPO / "src" / "tidal" / "control" / "demo_job.py"
PORT, PG_PORT = 28471, 5432
LEASE_S, TICK_S = 10.0, 0.5


def _pg_bin(name: str) -> str | None:
    return shutil.which(name) or next((str(d / name) for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"),
                                                                     reverse=True) if (d / name).exists()), None)


class NetnsPostgres:
    """A throw-away PostgreSQL server listening on ``host``'s address only,
    trusting every address of the namespaces' subnet (nothing else reaches it)."""

    def __init__(self, host: Any) -> None:
        self.host, self.dir = host, Path(tempfile.mkdtemp(prefix="tidal-silent-pg-"))
        shutil.chown(self.dir, "postgres", "postgres")
        self.data = self.dir / "data"
        as_pg = ["runuser", "-u", "postgres", "--"]
        subprocess.run([*as_pg, _pg_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres"],
                       check=True, capture_output=True, timeout=120)
        subnet = host.addr.rsplit(".", 1)[0]
        with open(self.data / "pg_hba.conf", "a") as f:
            f.write(f"host all all {subnet}.0/24 trust\n")
        out = host.run([*as_pg, _pg_bin("pg_ctl"), "-D", str(self.data), "-w", "-l", str(self.dir / "log"), "-o",
                        f"-p {PG_PORT} -k {self.dir} -c listen_addresses={host.addr}", "start"],
                       timeout=60, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {out.stderr}")
        self.url = f"postgresql+psycopg://postgres@{host.addr}:{PG_PORT}/postgres"

    def stop(self) -> None:
        self.host.run(["runuser", "-u", "postgres", "--", _pg_bin("pg_ctl"), "-D", str(self.data), "-m",
                       "immediate", "stop"], timeout=60, capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def _env(home: Path, **extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    e.update(OMP_NUM_THREADS="1", TIDAL_HOME=str(home), PYTHONUNBUFFERED="1", **extra)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    return e


def _tidal(host: Any, args: list[str], home: Path, **extra: str) -> subprocess.Popen[bytes]:
    home.mkdir(parents=True, exist_ok=True)
    with open(home.with_suffix(".log"), "ab") as log:
        return host.popen([sys.executable, "-m", "tidal", *args], env=_env(home, **extra), stdout=log,
                          stderr=subprocess.STDOUT)


def _leads(host: Any, url: str) -> bool | None:
    """Whether the replica at ``url`` says it leads, asked from inside ``host``; None: no answer."""
    with host.entered():
        try:
            return bool(Api(url, "").http.call("GET", "/healthz", None, patience_s=0.5)[1]["leading"])
        except Exception:  # noqa: BLE001 - cut off or down
            return None


def _until(pred: Callable[[], Any], timeout: float, what: str, step: float = 0.1) -> float:
    """Seconds until ``pred()`` is true (fails after ``timeout``)."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)
    return time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_follower_leads_within_the_lease_when_the_leaders_host_goes_silent(hosts: Any, tmp_path: Path) -> None:
    if _pg_bin("initdb") is None or _pg_bin("pg_ctl") is None:
        pytest.skip("PostgreSQL server binaries not installed (apt-get install postgresql)")
    hs = hosts(3)
    db, a, b = hs[0], hs[1], hs[2]
    pg = NetnsPostgres(db)
    try:
        _scenario(hs, pg.url, tmp_path)
    finally:
        hs.kill_host(1)
        hs.kill_host(2)
        pg.stop()


def _scenario(hs: Any, db_url: str, work: Path) -> None:
    db, a, b = hs[0], hs[1], hs[2]
    url_a, url_b = f"http://{a.addr}:{PORT}", f"http://{b.addr}:{PORT}"
    admin, secret = secrets.token_urlsafe(16), work / "server.secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    common = {"TIDAL_ADMIN_TOKEN": admin, "TIDAL_SECRET_FILE": str(secret), "TIDAL_LEADER_LEASE_S": str(LEASE_S),
              "TIDAL_PUBLIC_URL": f"{url_a},{url_b}"}
    server = ["server", "--host", "0.0.0.0", "--port", str(PORT), "--db", db_url, "--policy", "fifo",
              "--tick", str(TICK_S)]
    _tidal(a, server, work / "server-a", **common)
    _until(lambda: _leads(db, url_a), 90, "replica A to lead")
    _tidal(b, server, work / "server-b", **common)
    _until(lambda: _leads(db, url_b) is False, 90, "replica B to follow")
    join = subprocess.run([sys.executable, "-m", "tidal", "agent-token"], env=_env(work / "server-a", **common),
                          capture_output=True, text=True, timeout=60).stdout.strip()
    _tidal(db, ["agent", "--server", f"{url_b},{url_a}", "--name", "n0", "--virtual-gpus", "2",
                "--interval", "0.3"], work / "agent", TIDAL_TOKEN=join)
    with db.entered():
        api = Api(url_b, admin)
        _until(lambda: any(n["state"] == "up" for n in api.cluster()["nodes"]), 60, "the agent")

    hs.cut(1)  # A's host goes silent: its link is down on the switch, nothing is sent to anyone
    t_cut = time.monotonic()
    stepped_down = _until(lambda: _leads(a, f"http://127.0.0.1:{PORT}") is False, LEASE_S, "A to step down")
    _until(lambda: _leads(db, url_b), LEASE_S + 4 * TICK_S + 2, "B to lead")
    failover_s = time.monotonic() - t_cut
    with db.entered():
        user = Api(url_b, api.add_user("alice"))
        job = user.submit({"name": "after-the-cut", "script": str(DEMO_JOB), "gpus": 1, "iterations": 20,
                           "args": ["--samples", "1280", "--epochs", "1", "--sample-time", "0.001"]})["id"]
        scheduled = _until(lambda: len(user.job(job)["gpus"]) == 1, 60, "the job submitted after the cut to start")
    print(json.dumps({"scenario": "leader host silent", "lease_s": LEASE_S, "tick_s": TICK_S,
                      "leader_stepped_down_s": round(stepped_down, 2), "failover_s": round(failover_s, 2),
                      "scheduled_after_lead_s": round(scheduled, 2)}))
    assert stepped_down < failover_s <= LEASE_S + 2 * TICK_S + 1, (stepped_down, failover_s)

    hs.heal(1)  # the link comes back: A's session is gone, so is its lock; it stays a follower
    time.sleep(3 * TICK_S + 2)
    assert _leads(db, url_a) is False and _leads(db, url_b) is True
