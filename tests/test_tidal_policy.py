"""Tidal's own policy: ElasticFlow's guarantees, Tiresias-like responsiveness
for best-effort jobs."""

from __future__ import annotations

import random

import pytest

from tidal.core.job import JobSpec, JobState
from tidal.core.overhead import OverheadModel
from tidal.core.topology import parse_cluster
from tidal.scheduler.registry import get_policy
from tidal.sim.engine import simulate

FREE = OverheadModel(mode="stop-free", pause_s=0.0, warmup_s=0.0, stop_resume_s=0.0)


def job(jid, t, iters, **kw):
    return JobSpec(jid, submit_time=t, model="lin", batch_size=32, iterations=iters, requested_gpus=1,
                   elastic=True, **kw)


def run(policy, jobs, profiles, cluster="n1g4", ov=FREE):
    r = simulate(jobs, parse_cluster(cluster), get_policy(policy, slot=10.0), profiles=profiles, overheads=ov, slot=10.0)
    return {j.spec.job_id: j for j in r.jobs}


def test_short_best_effort_job_overtakes_a_long_one(toy_profiles):
    # A (long) has used far more than 10,000 GPU-s when short B arrives.
    # Tidal: floors give B and A one GPU each (B first: queue 0); of the two
    # left, the next buddy step goes to B (weight 1 vs A's 1/4 in queue 2):
    # B 1 -> 2; B's next step (2 -> 4) needs two, so A takes the last one.
    # B: 300 it at 2 it/s = 150 s from t=3000.
    jobs = [job("A", 0, 40_000), job("B", 3000, 300)]
    by = run("tidal", jobs, toy_profiles)
    assert by["B"].start_time == pytest.approx(3000)
    assert by["B"].end_time == pytest.approx(3150)
    assert by["B"].max_gpus == 2
    # ElasticFlow's Algorithm 2 alone ranks by marginal return, a tie here:
    # A keeps all four GPUs and B waits for it
    ef = run("elasticflow", jobs, toy_profiles)
    assert ef["B"].start_time >= ef["A"].end_time
    # no GPU idles: the last job ends when all the work is done on 4 GPUs
    assert by["A"].end_time == pytest.approx((40_000 + 300) / 4)


def test_deadline_guarantees_survive_best_effort_pressure(toy_profiles):
    rng = random.Random(7)
    for trial in range(15):
        jobs = []
        for i in range(12):
            t = rng.uniform(0, 400)
            iters = rng.uniform(50, 1500)
            ddl = t + iters / rng.choice([1, 2, 4]) * rng.uniform(1.1, 3) if rng.random() < 0.6 else None
            jobs.append(job(f"j{i}", round(t), round(iters), deadline=None if ddl is None else round(ddl)))
        by = run("tidal", jobs, toy_profiles, cluster="n1g8")
        for j in by.values():
            if j.spec.deadline is not None and j.admitted and j.state is JobState.COMPLETED:
                assert j.end_time <= j.spec.deadline + 1e-6, (trial, j.spec)
            assert j.state in (JobState.COMPLETED, JobState.DROPPED)
