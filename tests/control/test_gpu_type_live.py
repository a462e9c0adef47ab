"""GPU-type constraints on a live cluster: agents of 4 and 2 virtual GPUs of
different types; a job that asks for the 2-GPU agent's type runs only there,
and beside an unconstrained 4-GPU job all 6 GPUs are in use at once."""

from __future__ import annotations

import time

import pytest

import tidal.control.demo_job as demo_job
from tidal.control.local import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _job(name: str, gpus: int, record, **kw) -> dict:
    return {"name": name, "script": demo_job.__file__, "gpus": gpus, "iterations": 400,
            "args": ["--samples", str(400 * 64), "--epochs", "1", "--sample-time", "0.005",
                     "--record", str(record / name)], **kw}


def _wait(pred, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_job_asking_for_a_type_runs_only_on_it_and_all_six_gpus_are_used(tmp_path):
    with LocalCluster(tmp_path / "home", layout=[(4, "A100"), (2, "T4")], policy="fifo", tick_s=0.5,
                      in_process=True) as c:  # node-0: 4 A100, node-1: 2 T4 (start() waits for both)
        api = c.api()
        gpu_node = {g["gid"]: n["name"] for n in api.cluster()["nodes"] for g in n["gpus"]}
        # one round sees all three jobs: a type-blind best fit puts "a-any" on the 2-GPU node
        # (an exact fit) and "t4" beside "b-any" on the A100 node
        coord = c.embedded.coordinator
        coord.leading = lambda: False
        ids = [api.submit(_job("a-any", 2, tmp_path))["id"],
               api.submit(_job("t4", 2, tmp_path, gpu_types=["T4"]))["id"],
               api.submit(_job("b-any", 2, tmp_path))["id"]]
        coord.leading = lambda: True
        coord.wake()
        t4 = ids[1]
        shown = api.job(t4)
        assert shown["gpu_types"] == ["T4"] and shown["exclude_gpu_types"] == []

        def all_placed():
            jobs = [api.job(j) for j in ids]
            return jobs if all(len(j["gpus"]) == 2 for j in jobs) else None

        jobs = _wait(all_placed, 120, "the three jobs to hold their GPUs")
        assert {gpu_node[g] for g in jobs[1]["gpus"]} == {"node-1"}  # the T4 node
        assert len({g for j in jobs for g in j["gpus"]}) == 6  # every GPU of the cluster at once
        # a type no node has is refused at submit, naming the types there are
        with pytest.raises(Exception, match="GPUs of type V100, the cluster has 0"):
            api.submit(_job("v100", 1, tmp_path, gpu_types=["V100"]))
        done = ("completed", "failed", "cancelled", "dropped")
        _wait(lambda: all(api.job(j)["state"] in done for j in ids), 180, "the jobs to finish")
        assert [api.job(j)["state"] for j in ids] == ["completed"] * 3
        held = [e for e in api.job(t4)["events"] if e.get("gpu") is not None]
        assert all(gpu_node[e["gpu"]] == "node-1" for e in held)
