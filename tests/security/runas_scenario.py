"""A cluster whose agent runs every job under a uid of its own (``--run-as
LO-HI``): two tenants' jobs run to completion, while a process with a uid
of the range (what another job gets) attacks alice's job's rendezvous store
(a forged "moved" master, planted pickles, reading its values). Run as root by
test_runas_cluster.py (in a mount namespace where other uids can run this
Python); prints one JSON report. Not collected by pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import tidal.control.demo_job as demo_job
from tidal import settings
from tidal.control.local import LocalCluster

DONE = ("completed", "failed", "cancelled", "dropped")


def job_uids(home: Path) -> dict[str, set[int]]:
    """The uids of every live process of a job (by its private directory), and
    whether any holds the job's credential in its environment."""
    out: dict[str, set[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_text(errors="replace").split("\0") if "=" in kv)
            uid = int(next(ln.split()[1] for ln in (d / "status").read_text().splitlines() if ln.startswith("Uid:")))
        except (OSError, StopIteration, ValueError):
            continue
        jd = env.get(settings.JOB_DIR.name)
        if jd and str(home) in jd:
            out.setdefault(Path(jd).name, set()).add(uid)
            out.setdefault("pids", set()).add(int(d.name))
            if settings.JOB_TOKEN.name in env:
                out.setdefault("credential-in-environ", set()).add(uid)
    return out


def listening(pids: set[int]) -> set[str]:
    """The local addresses of every listening TCP socket of ``pids``."""
    from test_store_attacks import _listening

    return {a for a, _ in _listening(pids)}


def attack(home: Path, job: str, uid: int, marker: Path) -> subprocess.Popen[str] | None:
    """Start the store attacker of test_store_attacks.py as ``uid`` (another
    tenant's job's uid) against ``job``'s store, once its master is up."""
    from test_store_attacks import ATTACKER
    from tidal.runtime.client import MasterClient

    token_files = list(home.glob(f"agents/*/jobs/{job}/token"))
    url = None
    for f in home.glob(f"agents/*/masters/{job}.url"):
        url = f.read_text().strip()
    if not token_files or not url:
        return None
    store = MasterClient(url, token=token_files[0].read_text().strip()).get("/store")
    script = marker.parent / "attacker.py"
    script.write_text(ATTACKER)
    script.chmod(0o644)
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, str(script),
            str(store["store_port"]), job, str(marker), "8"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")


def main() -> int:
    base, uids, attacker_uid = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])  # a uid another job would get
    spec = {"script": demo_job.__file__, "gpus": 2, "iterations": 30,
            "args": ["--samples", "2048", "--epochs", "2", "--sample-time", "0.01"]}
    c = LocalCluster(base / "home", nodes=1, gpus_per_node=4, policy="edf", tick_s=0.5)
    c.env[settings.RUN_AS.name] = uids
    seen: dict[str, set[int]] = {}
    sockets: set[str] = set()  # every address a job process listened on
    with c:
        admin = c.api()
        tenants = {n: c.api(admin.add_user(n)) for n in ("alice", "bob")}
        # alice's job runs longer: the attack on it has time to be made even on a loaded machine
        ids = {n: t.submit(dict(spec, name=n, iterations=60 if n == "alice" else 20))["id"]
               for n, t in tenants.items()}
        deadline, attacker = time.time() + 240, None
        marker = base / "w" / "pwned"
        marker.parent.mkdir(mode=0o777)
        marker.parent.chmod(0o777)
        while time.time() < deadline:
            for k, v in job_uids(base / "home").items():
                seen.setdefault(k, set()).update(v)
            sockets.update(listening(seen.get("pids", set())))
            if attacker is None and tenants["alice"].job(ids["alice"])["step"] > 0:
                attacker = attack(base / "home", ids["alice"], attacker_uid, marker)
            states = {n: tenants[n].job(j)["state"] for n, j in ids.items()}
            if all(s in DONE for s in states.values()):
                break
            time.sleep(0.5)
        jobs = {n: tenants[n].job(j) for n, j in ids.items()}
        logs = sorted((base / "home").glob("agents/*/logs/**/*.log"))
        report = {
            "states": {n: j["state"] for n, j in jobs.items()},
            "reasons": {n: j.get("reason") for n, j in jobs.items()},
            "steps": {n: j.get("step") for n, j in jobs.items()},
            "ids": ids,
            "uids": {k: sorted(v) for k, v in seen.items() if k != "pids"},
            "listening": sorted(sockets),
            "log_modes": sorted({oct(p.stat().st_mode & 0o777) for p in logs}),
            "log_dir_modes": sorted({oct(p.parent.stat().st_mode & 0o777) for p in logs}),
            "logs": len(logs),
            "pwned": marker.exists(),
        }
        if any(st != "completed" for st in report["states"].values()):  # why: the end of every log
            report["log_tails"] = {str(p.relative_to(base)): p.read_text(errors="replace")[-1500:]
                                  for p in [*logs, *(base / "home").glob("*.log")]}
        if attacker is not None:
            a_out, a_err = attacker.communicate(timeout=60)
            report["attack"] = json.loads(a_out.strip().splitlines()[-1]) if attacker.returncode == 0 else a_err[-2000:]
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
