"""A cluster whose agent runs every job under a uid of its own (``--run-as
LO-HI``): two tenants' jobs run to completion side by side. Run as root by
test_runas_cluster.py (in a mount namespace where other uids can run this
Python); prints one JSON report. Not collected by pytest."""

from __future__ import annotations

import json
import os
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
            if settings.JOB_TOKEN.name in env:
                out.setdefault("credential-in-environ", set()).add(uid)
    return out


def main() -> int:
    base, uids = Path(sys.argv[1]), sys.argv[2]
    spec = {"script": demo_job.__file__, "gpus": 2, "iterations": 30,
            "args": ["--samples", "1024", "--epochs", "2", "--sample-time", "0.01"]}
    c = LocalCluster(base / "home", nodes=1, gpus_per_node=4, policy="edf", tick_s=0.5)
    c.env[settings.RUN_AS.name] = uids
    seen: dict[str, set[int]] = {}
    with c:
        admin = c.api()
        tenants = {n: c.api(admin.add_user(n)) for n in ("alice", "bob")}
        ids = {n: t.submit(dict(spec, name=n))["id"] for n, t in tenants.items()}
        deadline = time.time() + 240
        while time.time() < deadline:
            for k, v in job_uids(base / "home").items():
                seen.setdefault(k, set()).update(v)
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
            "uids": {k: sorted(v) for k, v in seen.items()},
            "log_modes": sorted({oct(p.stat().st_mode & 0o777) for p in logs}),
            "log_dir_modes": sorted({oct(p.parent.stat().st_mode & 0o777) for p in logs}),
            "logs": len(logs),
        }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
