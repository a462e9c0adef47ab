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


def _plans(profiles, *views):
    from tidal.scheduler.api import Snapshot

    snap = Snapshot(now=0.0, cluster=parse_cluster("n1g4"), profiles=profiles, overheads=FREE, jobs=views)
    return get_policy("elasticflow", slot=60.0).schedule(snap), get_policy("tidal", slot=60.0).schedule(snap)


def test_deadline_jobs_get_the_spare_before_best_effort_floors(toy_profiles):
    # D (new, 1,000 it, deadline 700 s) gets a share of 2 GPUs. ElasticFlow's
    # Algorithm 2 gives the 2 spare GPUs to D (a tie with B's first GPU, the
    # deadline job first); Tidal's split does the same, and the floors only
    # divide what it leaves to best-effort jobs (here nothing). Before the
    # split, B's floor came first and D stayed at 2 GPUs.
    from tidal.scheduler.api import JobView

    d = job("D", 0, 1_000, deadline=700)
    b = job("B", 0, 5_000)
    ef, tidal = _plans(toy_profiles, JobView(d, JobState.SUBMITTED), JobView(b, JobState.PENDING, admitted=True))
    assert tidal.tags["D"]["ef_share"] == 2
    assert ef.allocation == tidal.allocation == {"D": 4}


def test_a_squeezed_deadline_job_gets_the_spare_first(toy_profiles):
    # D ("sat": 1.5 it/s on 2 GPUs, 2 on 4; 900 it, deadline 700 s) gets a
    # share of 2 that ends at 600 s, in the last half of its window:
    # squeezed. 2 -> 4 GPUs returns a quarter GPU's worth per GPU, B's first
    # GPUs a whole one: ElasticFlow gives B the spare, Tidal gives it to D
    # (weight 16): 2 it/s makes D's plan slack a later admission can use.
    from tidal.scheduler.api import JobView

    d = JobSpec("D", 0, "sat", 32, 900, requested_gpus=1, elastic=True, deadline=700)
    b = job("B", 0, 5_000)
    ef, tidal = _plans(toy_profiles, JobView(d, JobState.SUBMITTED), JobView(b, JobState.PENDING, admitted=True))
    assert ef.tags["D"]["ef_share"] == tidal.tags["D"]["ef_share"] == 2
    assert ef.allocation == {"D": 2, "B": 2}
    assert tidal.allocation == {"D": 4}
