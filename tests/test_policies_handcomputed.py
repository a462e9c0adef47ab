"""Hand-computed schedules: every number below can be checked on paper.

Model ``lin`` (see conftest) runs n iterations/s on n GPUs, so a job of I
iterations on n GPUs takes I/n seconds. Slot 0: scheduling at every event.
"""

from __future__ import annotations

import math

import pytest

from tidal.core.job import JobSpec, JobState
from tidal.core.overhead import OverheadModel
from tidal.core.topology import parse_cluster
from tidal.scheduler.registry import get_policy
from tidal.sim.engine import simulate
from tidal.sim.metrics import summarize

NO_OVERHEAD = OverheadModel(mode="stop-free", pause_s=0.0, warmup_s=0.0, stop_resume_s=0.0)


def job(jid, t, n, iters, model="lin", **kw):
    return JobSpec(jid, submit_time=t, model=model, batch_size=32, iterations=iters, requested_gpus=n, **kw)


def run(policy, jobs, profiles, cluster="n1g4", overheads=NO_OVERHEAD, **kw):
    r = simulate(jobs, parse_cluster(cluster), get_policy(policy, **kw), profiles=profiles, overheads=overheads, slot=0)
    return r, {j.spec.job_id: j for j in r.jobs}


def test_fifo_every_jct_by_hand(toy_profiles):
    jobs = [job("A", 0, 4, 400), job("B", 10, 2, 100), job("C", 20, 2, 200), job("D", 30, 4, 40)]
    r, by = run("fifo", jobs, toy_profiles)
    # A runs 0-100 on 4 GPUs; B 100-150 and C 100-200 on 2 each; D 200-210.
    assert {k: (v.start_time, v.end_time) for k, v in by.items()} == {
        "A": (0, 100), "B": (100, 150), "C": (100, 200), "D": (200, 210)
    }
    s = summarize(r)
    jcts = [100, 140, 180, 180]
    assert s["avg_jct"] == pytest.approx(sum(jcts) / 4)
    assert s["median_jct"] == pytest.approx(160)
    assert s["makespan"] == pytest.approx(210)
    assert s["avg_pending"] == pytest.approx((0 + 90 + 80 + 170) / 4)
    # busy GPU-s: A 400, B 100, C 200, D 40 over 4 GPUs x 210 s
    assert s["utilization"] == pytest.approx(740 / (4 * 210))
    # linear scaling: cluster efficiency equals utilisation
    assert s["cluster_efficiency"] == pytest.approx(740 / (4 * 210))


def test_fifo_head_of_line_blocks(toy_profiles):
    jobs = [job("A", 0, 3, 300), job("B", 1, 4, 40), job("C", 2, 1, 10)]
    _, by = run("fifo", jobs, toy_profiles)
    assert by["C"].start_time == pytest.approx(by["B"].end_time)  # C waits behind B
    assert by["B"].start_time == pytest.approx(100)


def test_easy_backfill_short_job_jumps_without_delaying_head(toy_profiles):
    # A holds 2 GPUs until 100. Head B needs all 4 -> reserved at t=100.
    # C (2 GPUs, 50 s) ends at 52 <= 100: it jumps. E (2 GPUs, 200 s) would
    # end at 203 > 100 and the head leaves no extra GPUs: E must wait.
    jobs = [job("A", 0, 2, 200), job("B", 1, 4, 400), job("C", 2, 2, 100), job("E", 3, 2, 400)]
    _, fifo = run("fifo", jobs, toy_profiles)
    _, bf = run("backfill", jobs, toy_profiles)
    assert bf["C"].start_time == 2 and bf["C"].end_time == pytest.approx(52)
    assert bf["B"].start_time == pytest.approx(fifo["B"].start_time) == pytest.approx(100)
    assert bf["E"].start_time == pytest.approx(200)
    assert fifo["C"].start_time == pytest.approx(200)


def test_easy_backfill_uses_extra_gpus(toy_profiles):
    # A holds 3 of 4 GPUs until 100; head B needs 2 -> shadow 100, extra 2.
    # C (1 GPU, 500 s) does not end before 100 but fits in the extra GPUs.
    jobs = [job("A", 0, 3, 300), job("B", 1, 2, 100), job("C", 2, 1, 500)]
    _, bf = run("backfill", jobs, toy_profiles)
    assert bf["C"].start_time == 2
    assert bf["B"].start_time == pytest.approx(100)


def test_tiresias_preempts_job_that_used_its_quantum(toy_profiles):
    # thresholds 100 GPU-s: A (4 GPUs) crosses it at t=25 and drops to queue 1;
    # B arrives at 10 and waits; at 25 B (queue 0) preempts A.
    jobs = [job("A", 0, 4, 400), job("B", 10, 4, 40)]
    _, by = run("tiresias", jobs, toy_profiles, thresholds=(100.0,), promote_knob=1e9)
    assert by["B"].start_time == pytest.approx(25)
    assert by["B"].end_time == pytest.approx(35)
    assert by["A"].preemptions == 1
    # A did 100 iterations by 25, resumes at 35: 300 left on 4 GPUs -> 110
    assert by["A"].end_time == pytest.approx(110)


def test_tiresias_starvation_promotion(toy_profiles):
    # Quantum 100 GPU-s. A (4 GPUs) drops to queue 1 at t=25; five short
    # queue-0 jobs S0..S4 (4 GPUs, 20 s each) arrive at 10..14 and run 25-125.
    jobs = [job("A", 0, 4, 400)] + [job(f"S{i}", 10 + i, 4, 80) for i in range(5)]
    _, starving = run("tiresias", jobs, toy_profiles, thresholds=(100.0,), promote_knob=1e9)
    assert starving["A"].end_time == pytest.approx(125 + 75)
    assert starving["S2"].end_time == pytest.approx(85)
    assert starving["A"].preemptions == 1
    # knob 2: A (ran 25 s) is promoted after waiting 50 s, at t=75; it preempts
    # S2 (started 65), runs one more quantum to t=100, then S2 finishes 100-110,
    # S3 110-130, S4 130-150, A 150-200.
    _, promoted = run("tiresias", jobs, toy_profiles, thresholds=(100.0,), promote_knob=2.0)
    assert promoted["A"].tags["promotions"] == 1
    assert promoted["S2"].preemptions == 1
    assert promoted["S2"].end_time == pytest.approx(110)
    assert promoted["S4"].end_time == pytest.approx(150)
    assert promoted["A"].end_time == pytest.approx(200)
    # knob inf (the ElasticFlow artifact's DLAS): never promoted, the same
    # schedule as a knob too large to matter (A is preempted once, not
    # bounced between the queues at every event)
    _, never = run("tiresias", jobs, toy_profiles, thresholds=(100.0,), promote_knob=math.inf)
    assert "promotions" not in never["A"].tags
    assert {k: (v.start_time, v.end_time, v.preemptions) for k, v in never.items()} == {
        k: (v.start_time, v.end_time, v.preemptions) for k, v in starving.items()}


def test_edf_gives_saturating_job_only_useful_gpus(toy_profiles):
    # 'sat' gains nothing past 4 GPUs: EDF gives it 4, and the other 4 to 'lin'.
    jobs = [job("S", 0, 1, 200, model="sat", elastic=True, deadline=1000),
            job("L", 0, 1, 400, elastic=True, deadline=2000)]
    _, by = run("edf", jobs, toy_profiles, cluster="n1g8")
    assert by["S"].max_gpus == 4
    assert by["S"].end_time == pytest.approx(100)  # 200 it at 2 it/s
    # L: 4 GPUs for 100 s (400 it... exactly done at 100)
    assert by["L"].end_time == pytest.approx(100)


def test_edf_misses_deadline_by_domino(toy_profiles):
    # Two jobs that each need the whole cluster: EDF runs the earlier deadline
    # first; the later one misses even though a different order could not help.
    jobs = [job("A", 0, 1, 400, elastic=True, deadline=100),
            job("B", 0, 1, 400, elastic=True, deadline=150)]
    r, by = run("edf", jobs, toy_profiles)
    assert by["A"].end_time == pytest.approx(100)
    assert by["B"].end_time == pytest.approx(200)
    assert summarize(r)["deadline_ratio"] == pytest.approx(0.5)


def test_four_gpu_two_job_case_study(toy_profiles):
    # SideCar paper's motivating case in spirit: 4 GPUs, job 1 asks for 4,
    # job 2 arrives later asking for 2. A rigid FIFO cluster makes job 2 wait;
    # the elastic EDF baseline shares the GPUs by deadline.
    jobs = [job("J1", 0, 4, 800, elastic=True, deadline=400), job("J2", 50, 2, 100, elastic=True, deadline=200)]
    r_fifo, fifo = run("fifo", jobs, toy_profiles)
    r_edf, edf = run("edf", jobs, toy_profiles)
    assert fifo["J2"].start_time == pytest.approx(200)  # waits for J1 (800 it / 4)
    assert fifo["J2"].end_time == pytest.approx(250)
    # EDF: J2 has the earlier deadline -> at t=50 it takes all 4 GPUs (25 s),
    # J1 is preempted (200 it done) and resumes at 75 with 600 it left -> 225.
    assert edf["J2"].end_time == pytest.approx(75)
    assert edf["J1"].end_time == pytest.approx(225)
    assert summarize(r_edf)["deadline_ratio"] == 1.0
    assert summarize(r_fifo)["deadline_ratio"] == 0.5


def test_stop_resume_overhead_charged_on_resize(toy_profiles):
    ov = OverheadModel(mode="stop-resume", stop_resume_s=10.0)
    jobs = [job("J1", 0, 4, 800, elastic=True, deadline=400), job("J2", 50, 2, 100, elastic=True, deadline=200)]
    r, by = run("edf", jobs, toy_profiles, overheads=ov)
    # J2 starts fresh (no launch cost) at 50 -> 75. J1 is preempted at 50 and
    # resumes at 75 paying 10 s: 600 it on 4 GPUs -> 75 + 10 + 150 = 235.
    assert by["J2"].end_time == pytest.approx(75)
    assert by["J1"].end_time == pytest.approx(235)
    assert by["J1"].overhead_gpu_s == pytest.approx(40)
    assert summarize(r)["overhead_gpu_s"] == pytest.approx(40)


def test_stop_free_scale_out_keeps_training_during_warmup(toy_profiles):
    ov = OverheadModel(mode="stop-free", warmup_s=10.0, pause_s=1.0)
    # EDF serves rigid C (earlier deadline) on 4 of 8 GPUs; A gets the other 4.
    jobs = [job("C", 0, 4, 40, elastic=False, deadline=50), job("A", 0, 1, 1000, elastic=True, deadline=10_000)]
    r, by = run("edf", jobs, toy_profiles, cluster="n1g8", overheads=ov)
    a = by["A"]
    # 0-10: A on 4 GPUs (C holds the other 4) -> 40 it. At 10 C ends, A grows
    # to 8: warm-up 10 s at 4 it/s (40 it), pause 1 s, then 8 it/s.
    # done at 10 + 10 + 1 + (1000 - 80) / 8 = 136.
    assert a.rescales == 1
    assert a.end_time == pytest.approx(136)
    assert a.overhead_gpu_s == pytest.approx(4 * 10 + 8 * 1)


def test_drop_job_larger_than_cluster(toy_profiles):
    r, by = run("fifo", [job("big", 0, 16, 10), job("ok", 0, 1, 10)], toy_profiles)
    assert by["big"].state is JobState.DROPPED and "16" in by["big"].drop_reason
    assert by["ok"].state is JobState.COMPLETED
    assert summarize(r)["dropped"] == 1


def test_batch_change_counts_progress_in_spec_iterations(toy_profiles):
    """A policy that doubles a job's global batch (Elan's hybrid scaling) makes
    it progress twice the spec's iterations per step at the same step rate."""
    from tidal.scheduler.api import Plan, Policy

    class DoubleBatchAt50(Policy):
        name = "double"

        def allocation(self, snap, plan: Plan) -> None:
            for j in snap.jobs:
                if j.admitted or j.job_id in plan.admit:
                    plan.allocation[j.job_id] = 2
                    if snap.now >= 50:
                        plan.batch[j.job_id] = 64
            plan.wake_at = 50 if snap.now < 50 else None

    # 'lin' profile has batch 32 only: batch 64 runs at half the iterations/s
    # of batch 32 (nearest-batch rule) -> the same samples/s -> same progress.
    r = simulate([job("A", 0, 2, 200)], parse_cluster("n1g4"), DoubleBatchAt50(), profiles=toy_profiles,
                 overheads=NO_OVERHEAD, slot=0)
    a = r.jobs[0]
    assert a.batch == 64 and a.rescales == 0
    assert a.end_time == pytest.approx(100)
