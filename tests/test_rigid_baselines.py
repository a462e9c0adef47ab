"""Gandiva, Themis and Chronus on hand-computed schedules (ElasticFlow §6.1's
rigid baselines).

Model ``lin`` (see conftest) runs n iterations/s on n GPUs; a job spread over
more nodes than it needs runs at 0.9x. Slot 0: scheduling at every event.
"""

from __future__ import annotations

import pytest

from tidal.core.job import JobSpec, JobState
from tidal.core.overhead import OverheadModel
from tidal.core.profile import load_profiles
from tidal.core.topology import parse_cluster
from tidal.scheduler.api import JobView, Snapshot
from tidal.scheduler.policies.chronus import SloJob, lease_plan, slot_bounds
from tidal.scheduler.policies.gandiva import gandiva_placement
from tidal.scheduler.policies.themis import finish_time_fairness
from tidal.scheduler.registry import get_policy
from tidal.sim.engine import simulate
from tidal.sim.metrics import summarize
from tidal.sim.traces import poisson_jobs

NO_OVERHEAD = OverheadModel(mode="stop-free", pause_s=0.0, warmup_s=0.0, stop_resume_s=0.0)
MIGRATE_5S = OverheadModel(mode="stop-free", pause_s=0.0, warmup_s=0.0, stop_resume_s=0.0, migrate_s=5.0)


def job(jid, t, n, iters, model="lin", **kw):
    return JobSpec(jid, submit_time=t, model=model, batch_size=32, iterations=iters, requested_gpus=n, **kw)


def run(policy, jobs, profiles, cluster="n1g4", overheads=NO_OVERHEAD, **kw):
    r = simulate(jobs, parse_cluster(cluster), get_policy(policy, **kw), profiles=profiles, overheads=overheads, slot=0)
    return r, {j.spec.job_id: j for j in r.jobs}


# -- Gandiva -----------------------------------------------------------------------


def _running(spec, gpus):
    from tidal.core.job import JobState as S

    return JobView(spec, S.RUNNING, tuple(gpus), admitted=True)


def test_gandiva_affinity_packing(toy_profiles):
    # n2g4: A (2 GPUs) holds node 0, B (1 GPU) holds node 1. A new 1-GPU job
    # joins B's node (affinity 1), a new 2-GPU job joins A's node (affinity 2);
    # best-fit placement would have put the 1-GPU job on node 0 (fewer free).
    snap = Snapshot(
        now=10.0,
        cluster=parse_cluster("n2g4"),
        jobs=(_running(job("A", 0, 2, 100), [0, 1]), _running(job("B", 1, 1, 100), [4])),
        profiles=toy_profiles,
    )
    place = gandiva_placement(snap, {"A": 2, "B": 1, "C": 1, "D": 2})
    assert place["A"] == (0, 1) and place["B"] == (4,)
    assert {g // 4 for g in place["C"]} == {1}
    assert {g // 4 for g in place["D"]} == {0}


def test_gandiva_migrates_to_defragment_for_a_big_job(toy_profiles):
    # n2g4. A(2) -> node 0; B(1) -> empty node 1; C(1) -> node 1 (affinity 1);
    # D(2) -> node 0 (affinity 2). E(4) arrives at 50: no room until A ends at
    # 100, when node 0 and node 1 each have 2 free GPUs. Moving D (2 GPUs, one
    # job) to node 1 empties node 0 for E: E runs consolidated 100-200 at 4 it/s.
    # D pays the 5 s migration: 1000 it at 2 it/s from 3 -> 503 + 5 = 508.
    jobs = [job("A", 0, 2, 200), job("B", 1, 1, 1000), job("C", 2, 1, 1000), job("D", 3, 2, 1000),
            job("E", 50, 4, 400)]
    _, g = run("gandiva", jobs, toy_profiles, cluster="n2g4", overheads=MIGRATE_5S)
    assert g["E"].start_time == pytest.approx(100) and g["E"].end_time == pytest.approx(200)
    assert g["D"].migrations == 1 and g["D"].end_time == pytest.approx(508)
    assert g["B"].migrations == g["C"].migrations == 0
    # FIFO (no migration) must spread E over both nodes: 400 / (4 x 0.9) s.
    _, f = run("fifo", jobs, toy_profiles, cluster="n2g4", overheads=MIGRATE_5S)
    assert f["E"].end_time == pytest.approx(100 + 400 / 3.6)
    assert f["D"].migrations == 0
    # with migration switched off, Gandiva spreads E too
    _, nm = run("gandiva", jobs, toy_profiles, cluster="n2g4", overheads=MIGRATE_5S, migrate=False)
    assert nm["E"].end_time == pytest.approx(100 + 400 / 3.6)


def test_gandiva_vacates_a_node_for_a_multi_node_job(toy_profiles):
    # n3g4: X(1) -> node 0 (all empty, lowest id); P(3) -> node 1 (an empty node
    # is preferred over mixing sizes); Q(3) -> node 2. B(8) waits until P ends
    # at 49 + 1 = 50; then node 0 has 3 free, node 1 4, node 2 1. B needs two
    # whole nodes: node 1 is empty; vacate node 0 by moving X (one GPU) to
    # node 2. B then runs at 8 it/s on two nodes, not at 0.9x spread over three.
    jobs = [job("X", 0, 1, 10_000), job("P", 1, 3, 147), job("Q", 2, 3, 30_000), job("B", 10, 8, 800)]
    _, by = run("gandiva", jobs, toy_profiles, cluster="n3g4", overheads=MIGRATE_5S)
    assert by["P"].end_time == pytest.approx(50)
    assert by["B"].start_time == pytest.approx(50)
    assert by["X"].migrations == 1 and by["Q"].migrations == 0
    assert by["B"].end_time == pytest.approx(150)


def test_gandiva_is_fifo_with_skip_not_head_of_line(toy_profiles):
    # A holds 3 of 4 GPUs; B (4) cannot start, C (1) behind it can (FIFO blocks it).
    jobs = [job("A", 0, 3, 300), job("B", 1, 4, 40), job("C", 2, 1, 10)]
    _, g = run("gandiva", jobs, toy_profiles)
    assert g["C"].start_time == 2 and g["B"].start_time == pytest.approx(100)


# -- Themis ------------------------------------------------------------------------


def test_finish_time_fairness_by_hand(toy_profiles):
    # B: 400 it on 4 GPUs alone takes 100 s; submitted at 10, at t=100 it would
    # finish at 90 + 100 s after submission -> rho = 190 / 100.
    snap = Snapshot(now=100.0, cluster=parse_cluster("n1g4"), jobs=(), profiles=toy_profiles)
    b = JobView(job("B", 10, 4, 400), JobState.PENDING, admitted=True)
    assert finish_time_fairness(snap, b, 4) == pytest.approx(1.9)
    a = JobView(job("A", 0, 4, 4000), JobState.RUNNING, (0, 1, 2, 3), done=400, admitted=True)
    assert finish_time_fairness(snap, a, 4) == pytest.approx((100 + 900) / 1000)


def test_themis_gives_gpus_to_worst_finish_time_fairness(toy_profiles):
    # Leases of 100 s on 4 GPUs; A (1000 s alone) runs from 0; B (100 s alone)
    # and C (200 s alone) arrive at 10. At 100: rho_A = (100+900)/1000 = 1.0,
    # rho_B = (90+100)/100 = 1.9, rho_C = (90+200)/200 = 1.45 -> B preempts A.
    # At 200: rho_A = 1.1, rho_C = (190+200)/200 = 1.95 -> C runs 200-400.
    # At 400 A resumes with 3600 it left: 900 s -> 1300.
    jobs = [job("A", 0, 4, 4000), job("B", 10, 4, 400), job("C", 10, 4, 800)]
    _, by = run("themis", jobs, toy_profiles, lease=100, fairness_knob=0.0)
    assert (by["B"].start_time, by["B"].end_time) == (pytest.approx(100), pytest.approx(200))
    assert (by["C"].start_time, by["C"].end_time) == (pytest.approx(200), pytest.approx(400))
    assert by["A"].preemptions == 1 and by["A"].end_time == pytest.approx(1300)
    # FIFO (submission order) serves A to the end first: B would wait until 1000.
    _, fifo = run("fifo", jobs, toy_profiles)
    assert fifo["B"].start_time == pytest.approx(1000)


def test_themis_fairness_knob_limits_who_may_preempt(toy_profiles):
    # 4 GPUs, leases of 100 s. R1, R2 (2 GPUs, 1000 s alone) run from 0;
    # W1, W2 (2 GPUs, 100 s alone) arrive at 1 and 2. At 100: rho_R = 1.0,
    # rho_W1 = 199/100, rho_W2 = 198/100.
    jobs = [job("R1", 0, 2, 2000), job("R2", 0, 2, 2000), job("W1", 1, 2, 200), job("W2", 2, 2, 200)]
    # f = 0: all jobs are offered GPUs by rho -> W1 and W2 take both leases.
    _, f0 = run("themis", jobs, toy_profiles, lease=100, fairness_knob=0.0)
    assert f0["W1"].start_time == pytest.approx(100) and f0["W2"].start_time == pytest.approx(100)
    assert f0["R1"].preemptions == f0["R2"].preemptions == 1
    # f = 0.9: only ceil(0.1 x 4) = 1 job (W1) is offered first; then running
    # R1 renews its lease before W2 — W2 waits for the next lease end (200).
    _, f9 = run("themis", jobs, toy_profiles, lease=100, fairness_knob=0.9)
    assert f9["W1"].start_time == pytest.approx(100)
    assert f9["W2"].start_time == pytest.approx(200)
    assert f9["R1"].preemptions == 0


def test_themis_keeps_leases_between_boundaries(toy_profiles):
    # Nobody is preempted before the lease ends: W waits until 600 under the
    # default 600 s lease although its rho is the worst from the moment it arrives.
    jobs = [job("R", 0, 4, 40_000), job("W", 1, 4, 400)]
    _, by = run("themis", jobs, toy_profiles, fairness_knob=0.0)
    assert by["W"].start_time == pytest.approx(600)


# -- Chronus -----------------------------------------------------------------------


def test_chronus_milp_maximises_deadlines_met():
    # One 100 s slot then another, 4 GPUs. A needs all 4 GPUs for 100 s by 100;
    # B and C need 2 each for 100 s by 100. Serving A (earliest submitted,
    # equal slack) meets one deadline; the MILP runs B and C and meets two.
    jobs = [SloJob("A", 4, 100.0, 100.0, False), SloJob("B", 2, 100.0, 100.0, False),
            SloJob("C", 2, 100.0, 100.0, False)]
    bounds = [0.0, 100.0, 200.0]
    run_now, met = lease_plan(jobs, bounds, 4, 4)
    assert run_now == {"B", "C"} and met == {"B", "C"}
    # the LP relaxation used for crowded clusters picks the same jobs here
    # (running a fraction a of A meets a + 2(1 - a) deadlines: best at a = 0)
    assert lease_plan(jobs, bounds, 4, 4, max_binary_jobs=0)[0] == {"B", "C"}
    # all three cannot be guaranteed together
    assert lease_plan(jobs, bounds, 4, 4, require_all=True) is None
    # A's deadline moved to 200: A runs in the second slot, all three are met
    jobs[0] = SloJob("A", 4, 100.0, 200.0, False)
    run_now, met = lease_plan(jobs, bounds, 4, 4, require_all=True)
    assert run_now == {"B", "C"} and met == {"A", "B", "C"}


def test_chronus_slot_bounds_grow_geometrically():
    assert slot_bounds(30.0, 60.0, 60.0, 10_000.0, 6) == [30.0, 60.0, 120.0, 180.0, 300.0, 420.0, 10_000.0]
    assert slot_bounds(0.0, 60.0, 60.0, 90.0, 6) == [0.0, 60.0, 120.0]


def test_chronus_admission_rejects_infeasible_slo_job(toy_profiles):
    # 4 GPUs, leases of 60 s. A (4 GPUs, 100 s, deadline 150) is accepted.
    # B (4 GPUs, 100 s, deadline 150) at 10 cannot finish before 200: rejected.
    # C (2 GPUs, 50 s, deadline 300) at 20 is feasible after A: accepted.
    jobs = [job("A", 0, 4, 400, deadline=150), job("B", 10, 4, 400, deadline=150),
            job("C", 20, 2, 100, deadline=300)]
    r, by = run("chronus", jobs, toy_profiles, lease=60)
    assert by["A"].tags["chronus"] == "slo" and by["C"].tags["chronus"] == "slo"
    assert by["B"].tags["chronus"] == "unaccepted"
    assert by["A"].end_time == pytest.approx(100)
    assert (by["C"].start_time, by["C"].end_time) == (pytest.approx(100), pytest.approx(150))
    # B runs as best-effort, after the accepted C
    assert by["B"].start_time == pytest.approx(150) and by["B"].end_time == pytest.approx(250)
    assert summarize(r)["deadline_ratio"] == pytest.approx(2 / 3)
    # rejected="drop": B is dropped with a reason, the others are unchanged
    r2, dr = run("chronus", jobs, toy_profiles, lease=60, rejected="drop")
    assert dr["B"].state is JobState.DROPPED and "Chronus admission" in dr["B"].drop_reason
    assert dr["C"].end_time == pytest.approx(150)


def test_chronus_meets_all_admitted_deadlines_with_the_milp(toy_profiles):
    # 4 GPUs, lease 100, all at t=0. P (4 GPUs, 100 s, deadline 1000) is
    # accepted alone; Q and R (2 GPUs, 100 s, deadline 150) need the MILP (6
    # GPUs asked): Q+R first, then P, is feasible. S (4 GPUs, 100 s, deadline
    # 150) would need 400 more GPU-s before 150 on top of Q and R's 400:
    # rejected. At t=0 the lease MILP must run Q+R (both 4-GPU choices fill the
    # cluster, only this one meets three deadlines); P runs 100-200, S 200-300.
    jobs = [job("P", 0, 4, 400, deadline=1000), job("Q", 0, 2, 200, deadline=150),
            job("R", 0, 2, 200, deadline=150), job("S", 0, 4, 400, deadline=150)]
    r, by = run("chronus", jobs, toy_profiles, lease=100)
    assert [by[k].tags["chronus"] for k in "PQRS"] == ["slo", "slo", "slo", "unaccepted"]
    assert by["Q"].end_time == pytest.approx(100) and by["R"].end_time == pytest.approx(100)
    assert by["P"].end_time == pytest.approx(200)
    assert by["S"].end_time == pytest.approx(300)
    assert summarize(r)["deadline_ratio"] == pytest.approx(3 / 4)


def test_chronus_best_effort_jobs_fill_leftover_gpus(toy_profiles):
    jobs = [job("SLO", 0, 2, 200, deadline=500), job("BE", 0, 2, 400)]
    _, by = run("chronus", jobs, toy_profiles)
    assert by["BE"].tags["chronus"] == "best-effort"
    assert by["BE"].start_time == 0 and by["SLO"].start_time == 0


# -- all three: rigid, valid plans ---------------------------------------------------


@pytest.mark.parametrize("policy", ["gandiva", "themis", "chronus"])
def test_rigid_and_valid_on_a_loaded_cluster(policy):
    # 60 jobs at 30/hour on 16 GPUs queue up; the simulator validates every
    # plan (no GPU held twice, rigid counts, placements match allocations).
    trace = poisson_jobs(60, rate_per_hour=30.0, seed=3, deadline_factor=1.5, max_gpus=8)
    r = simulate(trace.jobs, parse_cluster("n2g8"), get_policy(policy), profiles=load_profiles(),
                 slot=60.0, validate=True)
    done = [j for j in r.jobs if j.state is JobState.COMPLETED]
    assert len(done) + summarize(r)["dropped"] == 60
    for j in done:
        assert j.rescales == 0 and j.max_gpus == j.spec.requested_gpus
    waits = [j.start_time - j.spec.submit_time for j in done]
    assert max(waits) > 600  # the cluster really was contended
