"""A live job's own measured noise scale (the runtime's goodput scaling,
reported by its master and put in its view's tags by the control plane's
snapshot) drives the goodput policy, as the simulator's measured curves do:
of two otherwise equal jobs contending for GPUs, the one whose gradient
noise scale is large (its larger batches lose little statistical
efficiency) gets more GPUs; a job without an estimate is rated by
throughput alone."""

from __future__ import annotations

import pytest

from tidal.core.job import JobSpec, JobState
from tidal.core.profile import load_profiles
from tidal.core.topology import parse_cluster
from tidal.scheduler.api import JobView, Snapshot
from tidal.scheduler.goodput import REPORT_TAG, best_reported, efficiency, reported_noise
from tidal.scheduler.registry import get_policy


def _view(jid: str, phi: float | None) -> JobView:
    spec = JobSpec(jid, 0.0, "resnet50", 256, 1e6, requested_gpus=2, elastic=True, min_gpus=1)
    tags = {} if phi is None else {REPORT_TAG: {"noise_scale": phi, "base_batch": 256, "max_batch": 4096,
                                                "batch": 256, "scaling": "goodput"}}
    return JobView(spec, JobState.PENDING, admitted=True, tags=tags)


def test_reported_numbers_are_read_only_when_usable():
    assert reported_noise({REPORT_TAG: {"noise_scale": 900.0, "base_batch": 64}}) == (900.0, 64, 512)
    for bad in ({}, {REPORT_TAG: {"noise_scale": None, "base_batch": 64}},
                {REPORT_TAG: {"noise_scale": float("nan"), "base_batch": 64}},
                {REPORT_TAG: {"noise_scale": 10.0, "base_batch": 0}}, {REPORT_TAG: "x"}):
        assert reported_noise(bad) is None


def test_the_best_batch_maximises_goodput_on_the_grid():
    thr = {64: 10.0, 128: 6.0}  # iterations/s: the larger batch is faster per sample (12 vs 10 batches' worth)
    b, g = best_reported(lambda b: thr.get(b, 0.0), 1e9, 64, 128, points=2)
    assert (b, g) == (128, pytest.approx(6.0 * 2 * efficiency(1e9, 64, 128)))
    b, g = best_reported(lambda b: thr.get(b, 0.0), 1.0, 64, 128, points=2)  # tiny noise scale: efficiency halves
    assert b == 64 and g == pytest.approx(10.0)


def test_the_job_with_the_larger_noise_scale_gets_more_gpus():
    """With the fitness exponent p = 1 (the sum of speedups) the noisy job's
    larger gain per GPU wins the contended GPUs; with Pollux's default p = -1
    (fairness first) the two are split evenly."""
    snap = Snapshot(now=600.0, cluster=parse_cluster("n1g8"), profiles=load_profiles(),
                    jobs=(_view("noisy", 20000.0), _view("quiet", 5.0)))
    plan = get_policy("pollux", p=1.0).schedule(snap)
    assert plan.allocation["noisy"] > plan.allocation.get("quiet", 0), plan.allocation
    fair = get_policy("pollux").schedule(snap)
    assert fair.allocation == {"noisy": 4, "quiet": 4}
    assert not plan.batch  # a live job chooses its own batch for the GPUs it gets


def test_without_an_estimate_the_jobs_are_rated_alike():
    snap = Snapshot(now=600.0, cluster=parse_cluster("n1g8"), profiles=load_profiles(),
                    jobs=(_view("a", None), _view("b", None)))
    plan = get_policy("pollux", p=1.0).schedule(snap)
    assert plan.allocation["a"] == plan.allocation["b"], plan.allocation


def test_the_snapshot_gives_a_policy_the_jobs_reported_numbers(tmp_path):
    """The master's status report (``progress["goodput"]``) reaches the
    policy as the view's ``REPORT_TAG``; the job's own tags are kept."""
    import time
    from dataclasses import asdict

    from tidal.control.db import Job, Store
    from tidal.control.snapshot import build_snapshot
    from tidal.control.spec import JobSubmission
    from tidal.core.overhead import OverheadModel

    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    sub = JobSubmission(name="j", script="t.py", iterations=100, global_batch_size=64)
    rep = {"noise_scale": 812.5, "base_batch": 64, "max_batch": 512, "batch": 128, "scaling": "goodput"}
    with store.session() as s:
        s.add(Job(id="j", user="u", name="j", state="pending", submit_time=time.time(), tags={"mine": 1},
                  spec={"submission": sub.model_dump(), "jobspec": asdict(sub.to_jobspec("j", time.time(), "u"))},
                  progress={"step": 3, "goodput": rep}))
    with store.session(write=False) as s:
        snap, _, _ = build_snapshot(s, time.time(), OverheadModel())
    (view,) = snap.jobs
    assert view.tags["mine"] == 1 and view.tags[REPORT_TAG] == rep
    assert reported_noise(view.tags) == (812.5, 64, 512)
