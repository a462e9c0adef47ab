"""``tidal agent --run-as LO-HI`` end to end: a real server and agent (as
root) run two tenants' jobs, each under a uid of its own from the range
(never root, never the same), with the job's credential in no process's
environment, and both jobs complete (their masters keep their state in the
job's private directory) while a process with another uid of the range
attacks alice's job's store as test_store_attacks.py does. The job logs on the host are 0600 in 0700
directories."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from othersuid import can_switch_uid, namespace_prefix

pytestmark = [pytest.mark.skipif(can_switch_uid() is not None, reason=str(can_switch_uid())),
              pytest.mark.timeout(300), pytest.mark.slow]  # a whole cluster for 40 s: CI's second step

LO, HI = 231000, 231999


def test_jobs_of_two_tenants_run_as_uids_of_their_own_and_complete(open_tmp: Path) -> None:
    scenario = Path(__file__).with_name("runas_scenario.py")
    # none of this test run's TIDAL_* settings: the scenario's cluster is its own
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    p = subprocess.run([*namespace_prefix(), sys.executable, str(scenario), str(open_tmp), f"{LO}-{HI}", str(HI)],
                       capture_output=True, text=True, timeout=280, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    if r["states"] != {"alice": "completed", "bob": "completed"}:  # the whole story, untruncated
        tails = "\n".join(f"--- {k}:\n{v}" for k, v in (r.get("log_tails") or {}).items())
        pytest.fail(f"states {r['states']}, reasons {r['reasons']}\n{tails}\n{p.stderr[-3000:]}", pytrace=False)
    by_job = {n: set(r["uids"].get(r["ids"][n], [])) for n in ("alice", "bob")}
    assert all(len(u) == 1 for u in by_job.values()), r  # every process of a job: one uid
    ua, ub = by_job["alice"].pop(), by_job["bob"].pop()
    assert ua != ub and all(LO <= u <= HI for u in (ua, ub)), r
    assert {ua, ub} == {LO + 1, LO + 2}, r  # the jobs' numbers (1, 2) on a new server: the same uid on every host
    assert "credential-in-environ" not in r["uids"], r
    # a uid of the range (another job's) attacked alice's store: no request (no credential) reached it,
    # nothing ran, nothing was read
    a = r["attack"]
    assert isinstance(a, dict) and a["uid"] == HI and a["writes"] > 5, r
    assert a["seen"] == [] and a["leaked"] == [] and a["read"] > 0 and not r["pwned"], r
    # the masters' HTTP APIs and stores, gloo: on the node's address (loopback here), none on a wildcard
    assert r["listening"] and {a.rsplit(":", 1)[0] for a in r["listening"]} == {"127.0.0.1"}, r
    assert r["logs"] >= 4 and r["log_modes"] == ["0o600"] and r["log_dir_modes"] == ["0o700"], r
