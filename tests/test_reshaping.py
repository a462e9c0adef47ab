"""Reshaping (SideCar paper, SC'20, §III-C, Algorithms 1 and 2) and its two
baselines, k8s-default and termination, worked by hand with the toy profiles:
``sat`` = 1, 1.5, 2, 2 it/s on 1, 2, 4, 8 GPUs (sub-linear, like the paper's
TensorFlow jobs); ``lin`` = n it/s on n GPUs. Every reshaping is a
stop-and-restart that pauses the job 10 s (stop-resume overhead model).

The SC'20 paper motivates reshaping with a 4-GPU, two-job case study; its
exact figures were not available to us, so the first test is a toy
equivalent with the same structure (one job holds all 4 GPUs, a second
arrives, the first is reshaped down to share, then reshaped up when the
second ends).
"""

from __future__ import annotations

import math
import random
import zlib

import pytest

from tidal.core.job import JobSpec, JobState
from tidal.core.overhead import OverheadModel
from tidal.core.profile import load_profiles
from tidal.core.topology import parse_cluster
from tidal.scheduler.api import JobView, Snapshot
from tidal.scheduler.policies.k8s_default import fixed_count
from tidal.scheduler.policies.reshaping import (
    Predictor,
    _Tentative,
    accuracy_job,
    epochs_to_target,
    finish_in,
    fit_error_curve,
    options,
    observed_accuracy,
    predicted_remaining,
)
from tidal.scheduler.registry import get_policy
from tidal.sim.engine import simulate

RESTART = OverheadModel(mode="stop-resume", stop_resume_s=10.0)
NO_OVERHEAD = OverheadModel(mode="stop-free", pause_s=0.0, warmup_s=0.0, stop_resume_s=0.0)
OPTIONS = (1, 2, 4)


def job(jid, t, iters, model="sat", allowed=OPTIONS, **kw):
    return JobSpec(jid, submit_time=t, model=model, batch_size=32, iterations=iters, requested_gpus=allowed[-1],
                   elastic=True, allowed_gpus=allowed, **kw)


def run(policy, jobs, profiles, cluster="n1g4", overheads=RESTART, **opts):
    r = simulate(jobs, parse_cluster(cluster), get_policy(policy, **opts), profiles=profiles,
                 overheads=overheads, slot=0)
    assert all(j.state is JobState.COMPLETED for j in r.jobs)
    return {j.spec.job_id: j for j in r.jobs}


def test_two_job_case_study_reshape_down_then_up(toy_profiles):
    # J1 (400 it) starts alone at t=0 on 4 GPUs (200 s < 267 s on 2 < 400 s on 1).
    # J2 (150 it) arrives at 50; J1 has 300 it left (150 s). Predicted, from t=50:
    #   wait, J2 on 4 after J1: J2 ends 150 + 75 = 225            -> makespan 225
    #   wait, J2 on 2:          150 + 100 = 250                   -> 250
    #   reshape J1 4->2, J2 on 2: J1 10 + 300/1.5 = 210, J2 150/1.5 = 100 -> 210
    #   (J2 on 1 would leave J1 on 3, not an option; J2 on 4 would leave 0)
    # -> reshape down. J2 ends at 150. J1 then has 100 + 90*1.5 = 235 done, 165
    # left: keep 2 GPUs 110 s, or reshape up to 4: 10 + 82.5 = 92.5 s -> up,
    # J1 ends at 242.5.
    jobs = [job("J1", 0, 400), job("J2", 50, 150)]
    by = run("reshaping", jobs, toy_profiles)
    assert by["J2"].start_time == pytest.approx(50) and by["J2"].end_time == pytest.approx(150)
    assert by["J1"].end_time == pytest.approx(242.5)
    assert by["J1"].rescales == 2 and by["J1"].max_gpus == 4
    # the same pair where J2 waits for J1 (what a fixed-size scheduler does):
    # J1 ends at 200, J2 on 4 GPUs 200-275
    wait_makespan = 200 + 150 / 2
    assert max(j.end_time for j in by.values()) < wait_makespan


def test_reshaping_waits_when_sharing_does_not_pay(toy_profiles):
    # Linear scaling: J1 (800 it, 4 GPUs) has 600 it left at 50 (150 s). Reshaping
    # J1 to 2 would end it at 50 + 10 + 300 = 360; waiting ends J2 (200 it) at
    # 200 + 50 = 250 -> wait.
    jobs = [job("J1", 0, 800, "lin"), job("J2", 50, 200, "lin")]
    by = run("reshaping", jobs, toy_profiles)
    assert by["J1"].rescales == 0 and by["J1"].end_time == pytest.approx(200)
    assert by["J2"].start_time == pytest.approx(200) and by["J2"].end_time == pytest.approx(250)


def test_early_initialisation_changes_the_decision(toy_profiles):
    # J1 (130 it) runs on 4 GPUs, 30 it left at t=50 (15 s). J2 (60 it) arrives.
    #   wait: J2 on 2 or 4 GPUs after J1 -> 15 + 30 = 45
    #   reshape J1 4->2: J1 10 + 20 = 30; J2 on 2 GPUs 40 s with early
    #   initialisation (it starts while J1 checkpoints) -> 40 < 45: reshape;
    #   without it J2 first waits J1's 10 s stop -> 50 > 45: wait.
    jobs = [job("J1", 0, 130), job("J2", 50, 60)]
    early = run("reshaping", jobs, toy_profiles)
    assert early["J1"].end_time == pytest.approx(80)  # 60 + 30 / 1.5
    assert early["J2"].end_time == pytest.approx(90)  # 50 + 60 / 1.5; reshaping up at 80 would not pay
    serial = run("reshaping", jobs, toy_profiles, early_init=False)
    assert serial["J1"].rescales == 0 and serial["J1"].end_time == pytest.approx(65)
    assert serial["J2"].start_time == pytest.approx(65) and serial["J2"].end_time == pytest.approx(95)


def test_reshaping_down_takes_from_at_most_one_job_and_keeps_options(toy_profiles):
    # A (1000 it, 667 s left) and B (10,000 it, 6667 s left, the makespan) hold
    # 2 GPUs each with options {2, 4}: neither can give a GPU and stay allowed,
    # so C (100 it) must wait. With A's options {1, 2, 4}, C can start on 1 GPU
    # from A: makespan stays B's, and the sum of completion times is the
    # smallest: A 10 + 1000 = 1010, C 100 (vs waiting: A 667, C 667 + 100).
    snap_jobs = [
        JobView(job("A", 0, 1000, allowed=(2, 4)), JobState.RUNNING, (0, 1), admitted=True),
        JobView(job("B", 1, 10_000, allowed=(2, 4)), JobState.RUNNING, (2, 3), admitted=True),
        JobView(job("C", 2, 100), JobState.PENDING, admitted=True),
    ]
    snap = Snapshot(now=10.0, cluster=parse_cluster("n1g4"), jobs=tuple(snap_jobs), profiles=toy_profiles,
                    overheads=RESTART)
    plan = get_policy("reshaping").schedule(snap)
    assert plan.allocation == {"A": 2, "B": 2}
    # with options {1, 2, 4}, A can give one GPU: C starts on 1, from A only
    snap_jobs[0] = JobView(job("A", 0, 1000), JobState.RUNNING, (0, 1), admitted=True)
    snap = Snapshot(now=10.0, cluster=parse_cluster("n1g4"), jobs=tuple(snap_jobs), profiles=toy_profiles,
                    overheads=RESTART)
    plan = get_policy("reshaping").schedule(snap)
    assert plan.allocation == {"A": 1, "B": 2, "C": 1}
    assert set(plan.placement["C"]) <= {0, 1}


def test_inelastic_jobs_are_never_reshaped(toy_profiles):
    rigid = JobSpec("R", 0.0, "sat", 32, 400, requested_gpus=4)
    by = run("reshaping", [rigid, job("J2", 50, 150)], toy_profiles)
    assert by["R"].rescales == 0 and by["R"].end_time == pytest.approx(200)
    assert by["J2"].start_time == pytest.approx(200)


# -- target accuracy: online NNLS fit of the accuracy curve ------------------------

CURVE = (0.5, 2.0, 0.05)  # err(e) = 1/(0.5 e + 2) + 0.05; 85 % accuracy after 16 epochs


def test_ground_truth_epochs():
    assert epochs_to_target(0.85, *CURVE, max_epochs=200) == 16
    assert epochs_to_target(0.96, *CURVE, max_epochs=200) == 200  # below the asymptote: capped
    spec = accuracy_job("a", 0.0, "lin", 32, 0.85, CURVE, iters_per_epoch=100)
    assert spec.iterations == 1600


def test_policy_sees_only_observed_epochs():
    spec = accuracy_job("a", 0.0, "lin", 32, 0.85, CURVE, iters_per_epoch=100)
    v = JobView(spec, JobState.RUNNING, (0,), done=550)
    pts = observed_accuracy(v)
    assert [e for e, _ in pts] == [1, 2, 3, 4, 5]
    assert pts[0][1] == pytest.approx(1 - (1 / 2.5 + 0.05))
    # the prediction does not depend on the simulator's iteration count
    other = JobView(JobSpec(**{**spec.__dict__, "iterations": 99_999}), JobState.RUNNING, (0,), done=550)
    assert predicted_remaining(other) == predicted_remaining(v)


def test_nnls_fit_predicts_epochs_left():
    spec = accuracy_job("a", 0.0, "lin", 32, 0.85, CURVE, iters_per_epoch=100)
    # fewer than 3 observed epochs: assume max_epochs (200)
    assert predicted_remaining(JobView(spec, JobState.RUNNING, (0,), done=150)) == 200 * 100 - 150
    # 5 exact points recover the curve and the 16 epochs
    fit = fit_error_curve(observed_accuracy(JobView(spec, JobState.RUNNING, (0,), done=550)))
    assert fit == pytest.approx(CURVE, rel=1e-4)
    assert predicted_remaining(JobView(spec, JobState.RUNNING, (0,), done=550)) == pytest.approx(1600 - 550)
    # with +-0.5 % noise, 10 observed epochs still give 16 +- 1 epochs
    noisy = accuracy_job("b", 0.0, "lin", 32, 0.85, CURVE, iters_per_epoch=100, noise=0.005)
    left = predicted_remaining(JobView(noisy, JobState.RUNNING, (0,), done=1050))
    assert 1500 <= left + 1050 <= 1700


def test_accuracy_jobs_run_to_their_ground_truth(toy_profiles):
    a = accuracy_job("A", 0.0, "lin", 32, 0.85, CURVE, iters_per_epoch=100, allowed_gpus=(1, 2, 4),
                     requested_gpus=4, elastic=True)
    by = run("reshaping", [a], toy_profiles, overheads=NO_OVERHEAD)
    assert by["A"].end_time == pytest.approx(1600 / 4)


# -- baselines ------------------------------------------------------------------------


def test_k8s_default_count_is_a_deterministic_pick_among_options(toy_profiles):
    snap = Snapshot(now=0.0, cluster=parse_cluster("n1g4"), jobs=(), profiles=toy_profiles)
    picks = {fixed_count(snap, job(f"j{i}", 0, 10)) for i in range(40)}
    assert picks == set(OPTIONS)
    j = job("J7", 0, 10)
    assert fixed_count(snap, j) == OPTIONS[zlib.crc32(b"J7") % 3]
    # no options: the requested count
    assert fixed_count(snap, JobSpec("r", 0.0, "lin", 32, 10, requested_gpus=2, elastic=True)) == 2


def test_k8s_default_never_resizes_and_does_not_block(toy_profiles):
    big = JobSpec("big", 0.0, "lin", 32, 400, requested_gpus=3)
    wide = JobSpec("wide", 1.0, "lin", 32, 40, requested_gpus=4)
    small = JobSpec("small", 2.0, "lin", 32, 10, requested_gpus=1)
    by = run("k8s-default", [big, wide, small], toy_profiles)
    assert by["small"].start_time == pytest.approx(2)  # passes the pending 4-GPU job
    assert by["wide"].start_time == pytest.approx(400 / 3)
    assert all(j.rescales == 0 and j.preemptions == 0 for j in by.values())


def test_termination_grows_one_option_at_a_time_by_restart(toy_profiles):
    # J (lin, options 1, 2, 4, 3000 it) starts on 1 GPU; every 100 s (the
    # policy's interval) it grows one option if that shortens it net of the
    # 10 s restart: 1 GPU 0-100 (100 it); restart, 2 GPUs from 110 (2900 it
    # left); at 200: 2720 left, restart, 4 GPUs from 210 -> 210 + 680 = 890.
    j = job("J", 0, 3000, "lin")
    by = run("termination", [j], toy_profiles, interval=100.0)
    assert by["J"].rescales == 2 and by["J"].max_gpus == 4
    assert by["J"].end_time == pytest.approx(890)


def test_termination_never_reshapes_down(toy_profiles):
    # J1 grows to 4 GPUs; J2 arriving later waits for it instead of taking GPUs.
    jobs = [job("J1", 0, 3000, "lin"), job("J2", 300, 100, "lin")]
    by = run("termination", jobs, toy_profiles, interval=100.0)
    assert by["J2"].start_time == pytest.approx(by["J1"].end_time)
    assert by["J1"].preemptions == 0


def test_waiting_job_keeps_its_place(toy_profiles):
    # R (rigid, 2 GPUs) ends in 10 s; W (options {4}) waits for it, so the 2
    # idle GPUs are held for W: the later L (options {1, 2}) may not take them.
    jobs = (
        JobView(JobSpec("R", 0.0, "lin", 32, 1000, requested_gpus=2), JobState.RUNNING, (0, 1), done=980,
                admitted=True),
        JobView(job("W", 1, 400, "lin", allowed=(4,)), JobState.PENDING, admitted=True),
        JobView(job("L", 2, 400, "lin", allowed=(1, 2)), JobState.PENDING, admitted=True),
    )
    snap = Snapshot(now=10.0, cluster=parse_cluster("n1g4"), jobs=jobs, profiles=toy_profiles, overheads=RESTART)
    assert get_policy("reshaping").schedule(snap).allocation == {"R": 2}
    # once W has started nothing is reserved any more: L takes what is idle
    jobs = (jobs[0], jobs[2])
    snap = Snapshot(now=10.0, cluster=parse_cluster("n1g4"), jobs=jobs, profiles=toy_profiles, overheads=RESTART)
    assert get_policy("reshaping").schedule(snap).allocation == {"R": 2, "L": 2}


@pytest.mark.parametrize("policy", ["reshaping", "k8s-default", "termination"])
def test_random_workload_keeps_jobs_on_their_options(policy, toy_profiles):
    # The engine validates every plan (no GPU twice, only allowed counts); on
    # top: inelastic jobs never change size and nobody is preempted.
    import random

    rng = random.Random(5)
    jobs = []
    for i in range(30):
        t, iters, model = rng.uniform(0, 2000), rng.uniform(50, 2000), rng.choice(["lin", "sat"])
        if rng.random() < 0.75:
            jobs.append(job(f"j{i}", t, iters, model, allowed=rng.choice([(1, 2, 4), (2, 4), (1, 3), (4,)])))
        else:
            jobs.append(JobSpec(f"j{i}", t, model, 32, iters, requested_gpus=rng.choice([1, 2, 4])))
    r = simulate(jobs, parse_cluster("n2g4"), get_policy(policy), profiles=toy_profiles, overheads=RESTART, slot=0)
    assert all(j.state is JobState.COMPLETED for j in r.jobs)
    for j in r.jobs:
        assert j.preemptions == 0
        if not j.spec.elastic:
            assert j.rescales == 0 and j.max_gpus == j.spec.requested_gpus
        else:
            assert j.max_gpus in j.spec.allowed_gpus


class _SlowStart(OverheadModel):
    """A start overhead the predictor cannot know in closed form: twice as
    long, at half the rate."""

    def start(self, now, rate, resumed):
        return ((now, 0.0), (now + 2 * self.launch_s, rate / 2))


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("overheads", [RESTART, NO_OVERHEAD, OverheadModel(launch_s=7.5, stop_resume_s=33.3),
                                       OverheadModel(launch_s=INF), OverheadModel(launch_s=-5.0, stop_resume_s=NAN),
                                       _SlowStart(launch_s=3.0)])
@pytest.mark.parametrize("now", [12345.678, 0.0, NAN])
def test_start_times_follow_the_overhead_segments(toy_profiles, overheads, now):
    # the predictor's start time (computed without the segments for OverheadModel) equals
    # finish_in over the model's own segments, to the bit (NaN where it is NaN), fresh and resumed,
    # at every count, with work that is infinite or not a number too
    views = [JobView(job(f"j{i}", 0, iters), JobState.PENDING, done=done, executed=ex, admitted=True)
             for i, (iters, done, ex) in enumerate([(1000, 0.0, 0.0), (777, 123.4, 56.0), (10**9, 0.0, 0.0),
                                                    (500, 500.0, 3.0), (3, 0.0, 1e-9), (5, 0.0, 0.0), (6, 1.0, 2.0)])]
    snap = Snapshot(now=now, cluster=parse_cluster("n1g4"), jobs=tuple(views), profiles=toy_profiles,
                    overheads=overheads)
    pred = Predictor(snap)
    pred._work.update({"j5": INF, "j6": NAN})
    for v in views:
        for n in (0, 1, 2, 3, 4):
            for delay in (0.0, 0.1, 60.0):
                at = snap.now + delay
                segs = overheads.start(at, pred.rate(v, n), resumed=v.executed > 0)
                want, got = delay + finish_in(segs, at, pred.work(v)), pred.start(v, n, delay)
                assert got == want or (math.isnan(got) and math.isnan(want)), (v.job_id, n, delay, got, want)


def test_options_by_kind_equal_each_jobs_own(tmp_path):
    # random specs over models and batches whose profiled counts differ (and a count at which one
    # does not run): the options shared by kind are each job's own options()
    (tmp_path / "a.csv").write_text("global_batch_size,1,2,4,8\n32,1,2,3,4\n64,1,0,4,7\n")
    (tmp_path / "b.csv").write_text("global_batch_size,1,3,6\n32,1,2.5,4\n64,2,5,6\n")
    profiles = load_profiles(tmp_path)
    rng = random.Random(7)
    views = []
    for i in range(400):
        elastic = rng.random() < 0.7
        allowed = rng.choice([None, None, (1, 2), (2, 4, 8), (1, 3, 6)])
        views.append(JobView(JobSpec(
            f"j{i}", submit_time=0.0, model=rng.choice("ab"), batch_size=rng.choice([32, 64]), iterations=10,
            requested_gpus=rng.choice([1, 2, 3, 4, 8]), elastic=elastic, allowed_gpus=allowed if elastic else None,
            min_gpus=rng.choice([None, 1, 2]) if elastic and allowed is None else None,
            max_gpus=rng.choice([None, 3, 4]) if elastic and allowed is None else None),
            JobState.PENDING, admitted=True))
    snap = Snapshot(now=0.0, cluster=parse_cluster("n1g8"), jobs=tuple(views), profiles=profiles)
    st = _Tentative.of(snap, views)
    for v in views:
        assert st.opts(v) == options(snap, v), v.spec
    assert len({id(st.opts(v)) for v in views}) < len(views) / 2  # shared, not one list per job


def test_jobs_of_one_kind_share_their_options(toy_profiles):
    a, b = job("a", 0, 100), job("b", 5, 900)
    c = job("c", 0, 100, allowed=(1, 4))  # the same request as a: only the allowed counts differ
    views = [JobView(s, JobState.PENDING, admitted=True) for s in (a, b, c)]
    snap = Snapshot(now=0.0, cluster=parse_cluster("n1g4"), jobs=tuple(views), profiles=toy_profiles)
    st = _Tentative.of(snap, views)
    assert st.opts(views[0]) is st.opts(views[1]) and st.opts(views[0]) == [1, 2, 4]
    assert st.opts(views[2]) == [1, 4]
