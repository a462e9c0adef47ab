"""End to end on localhost: server + 2 agents x 4 virtual GPUs, three real
elastic training jobs (gloo, CPU). The policy (EDF) reshapes them: the long
job A is reshaped down when B and C arrive with earlier deadlines and scaled
out again when they finish. The server is restarted mid-run. Checked: every
job completes, every sample is used exactly once per epoch, and the audit
trail never shows a GPU held by two jobs."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest

import tidal.control.demo_job as demo_job
from tidal.runtime.data import epoch_permutation
from tidal.control.local import LocalCluster

pytestmark = pytest.mark.timeout(420)


def job(name, record: Path, samples, epochs, gpus, deadline, sample_time=0.01):
    steps = samples * epochs // 64
    return {"name": name, "script": demo_job.__file__, "gpus": gpus, "iterations": steps, "deadline": deadline,
            "args": ["--samples", str(samples), "--epochs", str(epochs), "--sample-time", str(sample_time),
                     "--record", str(record / name)]}


def wait(pred, timeout, what, api=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        if api is not None:  # a failed job will not get there: stop now
            bad = [j for j in api.jobs() if j["state"] == "failed"]
            assert not bad, f"job failed while waiting for {what}: {bad}"
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def check_exactly_once(d: Path, samples: int, epochs: int) -> None:
    """Every sample position of every epoch is in exactly one committed step
    (the steps' global slices, which every member records: a worker lost
    mid-step cannot record its own share of a step the others committed),
    every worker trained only on the samples of the steps it recorded, and no
    sample went to two workers in one step, except in the last line of a
    worker that stopped early (a step it finished that its peers dropped and
    redid without it)."""
    slices = {tuple(int(x) for x in line.split()) for f in d.glob("*.ranges") for line in f.read_text().splitlines()}
    covered = collections.Counter(pos for _ep, _step, lo, hi in slices for pos in range(lo, hi))
    assert set(covered.values()) == {1}, "two committed steps overlap"
    assert len(covered) == samples * epochs, f"{samples * epochs - len(covered)} samples never used"
    perms = {ep: epoch_permutation(samples, 1, ep).tolist() for ep in range(epochs)}
    step_samples = {(ep, st): {perms[ep][pos - ep * samples] for pos in range(lo, hi)} for ep, st, lo, hi in slices}
    lines = {f.stem: [[int(x) for x in line.split()] for line in f.read_text().splitlines()] for f in d.glob("*.txt")}
    final = max((ln[1] for ls in lines.values() for ln in ls), default=0)
    per_step: dict[tuple[int, int], collections.Counter] = collections.defaultdict(collections.Counter)
    for ls in lines.values():
        for k, (ep, st, *idx) in enumerate(ls):
            assert set(idx) <= step_samples.get((ep, st), set()), f"step {st} of epoch {ep}: samples of no such step"
            if k == len(ls) - 1 and st < final:
                continue  # the last step of a worker that stopped early (see above)
            per_step[(ep, st)].update(idx)
    assert all(set(c.values()) == {1} for c in per_step.values()), "a sample went to two workers in one step"


def procs(user, jid, **match):
    """The job's processes whose fields equal ``match``."""
    return [p for p in user.job(jid)["processes"] if all(p[k] == v for k, v in match.items())]


def job_on_4_gpus(c, rec, samples, epochs):
    """Admin and user clients of cluster ``c``, and job "a" training on all 4 of its GPUs."""
    admin = c.api()
    user = c.api(admin.add_user("alice"))
    a = user.submit(job("a", rec, samples=samples, epochs=epochs, gpus="1-4", deadline=3600))["id"]
    wait(lambda: len(user.job(a)["gpus"]) == 4 and user.job(a)["world_size"] == 4 and user.job(a)["step"] > 3,
         120, "A to train on 4 GPUs", user)
    return admin, user, a


def replay_gpu_holders(events) -> None:
    holder: dict[int, str] = {}
    for e in events:
        if e["kind"] == "gpu.assign":
            assert e["gpu"] not in holder, f"GPU {e['gpu']} given to {e['job']} while held by {holder[e['gpu']]}"
            holder[e["gpu"]] = e["job"]
        elif e["kind"] == "gpu.release":
            assert holder.pop(e["gpu"]) == e["job"]


@pytest.mark.slow
def test_live_cluster_reshapes_real_jobs_and_survives_server_restart(tmp_path):
    rec = tmp_path / "records"
    with LocalCluster(tmp_path / "home", nodes=2, gpus_per_node=4, policy="edf", tick_s=1.0) as c:
        admin = c.api()
        user = c.api(admin.add_user("alice"))
        a = user.submit(job("a", rec, samples=4096, epochs=6, gpus="1-8", deadline=3600))["id"]
        wait(lambda: len(user.job(a)["gpus"]) == 8 and user.job(a)["step"] > 5, 120, "A to train on 8 GPUs", user)
        b = user.submit(job("b", rec, samples=1024, epochs=1, gpus="1-2", deadline=600))["id"]
        cc = user.submit(job("c", rec, samples=1024, epochs=1, gpus="1-4", deadline=900))["id"]
        # reshaping down: A gives GPUs to B and C without stopping
        wait(lambda: user.job(b)["state"] == "running" and user.job(cc)["state"] == "running", 120, "B and C to start", user)
        assert len(user.job(a)["gpus"]) < 8
        c.restart_server()
        user = c.api(user.token)
        done = ("completed", "failed", "cancelled", "dropped")
        wait(lambda: all(user.job(j)["state"] in done for j in (b, cc)), 200, "B and C to finish", user)
        # the schedule continues after the restart: A scales out again
        wait(lambda: any(e["kind"] == "job.scale_out" for e in user.job(a)["events"]) or user.job(a)["state"] in done,
             120, "A to scale out", user)
        wait(lambda: user.job(a)["state"] in done, 240, "A to finish", user)
        jobs = {j["id"]: j for j in user.jobs()}
        assert all(jobs[j]["state"] == "completed" for j in (a, b, cc)), jobs
        kinds = [e["kind"] for e in user.job(a)["events"]]
        assert "job.scale_in" in kinds and "job.scale_out" in kinds
        replay_gpu_holders(admin.events())
    check_exactly_once(rec / "a", 4096, 6)
    check_exactly_once(rec / "b", 1024, 1)
    check_exactly_once(rec / "c", 1024, 1)
