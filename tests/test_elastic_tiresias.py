"""Elastic-Tiresias (EDL §5.1, Algorithm 1), worked by hand with the toy
profiles: ``lin`` = n it/s on n GPUs; ``sat`` = 1, 1.5, 2, 2 it/s on 1, 2, 4,
8 GPUs (1.75 on 3, interpolated). Speedups are normalised by the one-GPU
throughput, so a ``sat`` job going from 4 to 3 GPUs loses 2 - 1.75 = 0.25.
"""

from __future__ import annotations

import pytest

from tidal.core.job import JobSpec, JobState
from tidal.core.overhead import OverheadModel
from tidal.core.topology import parse_cluster
from tidal.scheduler.api import JobView, Snapshot
from tidal.scheduler.registry import get_policy
from tidal.sim.engine import simulate

NO_OVERHEAD = OverheadModel(mode="stop-free", pause_s=0.0, warmup_s=0.0, stop_resume_s=0.0)


def spec(jid, n, model="lin", t=0.0, iters=10_000, elastic=True, **kw):
    return JobSpec(jid, submit_time=t, model=model, batch_size=32, iterations=iters,
                   requested_gpus=n, elastic=elastic, **kw)


def running(s, gpus, attained=0.0):
    return JobView(s, JobState.RUNNING, tuple(gpus), attained=attained, executed=attained / max(len(gpus), 1),
                   admitted=True)


def waiting(s, attained=0.0, since=0.0):
    return JobView(s, JobState.PENDING, (), attained=attained, executed=attained / max(s.requested_gpus, 1),
                   waiting_since=since, admitted=True)


def plan_for(profiles, cluster, jobs, now=100.0, **opts):
    snap = Snapshot(now=now, cluster=parse_cluster(cluster), jobs=tuple(jobs), profiles=profiles,
                    overheads=NO_OVERHEAD)
    plan = get_policy("elastic-tiresias", **opts).schedule(snap)
    # no GPU twice, placement matches allocation
    seen: set[int] = set()
    for jid, n in plan.allocation.items():
        gpus = plan.placement[jid]
        assert len(gpus) == n and not seen & set(gpus)
        seen |= set(gpus)
    return plan


# -- expansion -------------------------------------------------------------------


def test_lone_job_expands_to_the_whole_machine(toy_profiles):
    # Nothing waits: A (asks 1 GPU) gets every free GPU, 400 it at 4 it/s.
    r = simulate([spec("A", 1, iters=400)], parse_cluster("n1g4"), get_policy("elastic-tiresias"),
                 profiles=toy_profiles, overheads=NO_OVERHEAD, slot=0)
    plain = simulate([spec("A", 1, iters=400)], parse_cluster("n1g4"), get_policy("tiresias"),
                     profiles=toy_profiles, overheads=NO_OVERHEAD, slot=0)
    assert r.jobs[0].max_gpus == 4 and r.jobs[0].end_time == pytest.approx(100)
    assert plain.jobs[0].end_time == pytest.approx(400)


def test_expansion_picks_largest_relative_gain_and_skips_inelastic(toy_profiles):
    # 8 GPUs: A sat on 2, B lin on 1, C lin rigid on 2; 3 free.
    # Gains: B 1->2: (2-1)/1 = 1, 2->3: 0.5, 3->4: 0.33; A 2->3: (1.75-1.5)/1.5 = 0.17.
    # Every free GPU goes to B; A and the inelastic C keep their counts.
    jobs = [running(spec("A", 2, "sat"), [0, 1]), running(spec("B", 1), [2]),
            running(spec("C", 2, elastic=False), [3, 4])]
    plan = plan_for(toy_profiles, "n1g8", jobs)
    assert plan.allocation == {"A": 2, "B": 4, "C": 2}
    assert plan.placement["C"] == (3, 4) and plan.placement["A"] == (0, 1)


def test_expansion_respects_max_count(toy_profiles):
    jobs = [running(spec("A", 2, "sat"), [0, 1]), running(spec("B", 1, max_gpus=2), [2])]
    plan = plan_for(toy_profiles, "n1g8", jobs)
    # B stops at its max 2; A then takes 2->3 (0.17), 3->4 (0.14); 4->8 gains nothing.
    assert plan.allocation == {"A": 4, "B": 2}


def test_expansion_locality_rule(toy_profiles):
    # Two machines of 4. A (lin, 2 GPUs) shares machine 0 with rigid B; machine 1
    # holds D (lin, 1 GPU) and 3 free GPUs. A at 3 GPUs would need ceil(3/4) = 1
    # machine, so it may not take a GPU on machine 1; D grows there to 4.
    jobs = [running(spec("A", 2), [0, 1]), running(spec("B", 2, elastic=False), [2, 3]),
            running(spec("D", 1), [4])]
    plan = plan_for(toy_profiles, "n2g4", jobs)
    assert plan.allocation == {"A": 2, "B": 2, "D": 4}
    assert set(plan.placement["D"]) == {4, 5, 6, 7}


# -- compaction ------------------------------------------------------------------
# Quantum 10 GPU-s: A (attained 1000) and the waiting jobs (attained 20) are all
# in G_1; A was submitted first, so plain Tiresias keeps A on all 4 GPUs.

Q = dict(thresholds=(10.0,), promote_knob=1e9)


def compaction_jobs(a_kw=None, a_model="sat"):
    a = running(spec("A", 4, a_model, t=0, **(a_kw or {})), [0, 1, 2, 3], attained=1000)
    b = waiting(spec("B", 2, t=1), attained=20)
    c = waiting(spec("C", 1, t=2), attained=20)
    return [a, b, c]


def test_no_compaction_while_at_most_n_jobs_wait(toy_profiles):
    plan = plan_for(toy_profiles, "n1g4", compaction_jobs(), max_waiting=2, **Q)
    assert plan.allocation == {"A": 4}


def test_compaction_scales_in_g1_job_for_waiting_jobs(toy_profiles):
    # Two wait > N = 1. B needs 2: A 4->3 loses 0.25, 3->2 loses 0.25; B gains
    # its speedup 2 > 0.5, so A goes to 2 and B starts. Then one job waits = N.
    plan = plan_for(toy_profiles, "n1g4", compaction_jobs(), max_waiting=1, **Q)
    assert plan.allocation == {"A": 2, "B": 2}
    # N = 0: C also starts, A 2->1 loses 0.5 < C's speedup 1.
    plan = plan_for(toy_profiles, "n1g4", compaction_jobs(), max_waiting=0, **Q)
    assert plan.allocation == {"A": 1, "B": 2, "C": 1}


def test_compaction_keeps_min_and_skips_jobs_it_cannot_fit(toy_profiles):
    # A may not go below 3: only one GPU can be released, B (2) cannot start,
    # C (1) can.
    plan = plan_for(toy_profiles, "n1g4", compaction_jobs({"min_gpus": 3}), max_waiting=0, **Q)
    assert plan.allocation == {"A": 3, "C": 1}


def test_compaction_only_when_it_gains_efficiency(toy_profiles):
    # Linear A: moving GPUs from A to B (2 for 2) or C (1 for 1) loses as much
    # normalised throughput as it gains, so nothing is compacted.
    plan = plan_for(toy_profiles, "n1g4", compaction_jobs(a_model="lin"), max_waiting=0, **Q)
    assert plan.allocation == {"A": 4}


def test_inelastic_and_g0_jobs_are_never_compacted(toy_profiles):
    rigid = compaction_jobs()
    rigid[0] = running(spec("A", 4, "sat", t=0, elastic=False), [0, 1, 2, 3], attained=1000)
    assert plan_for(toy_profiles, "n1g4", rigid, max_waiting=0, **Q).allocation == {"A": 4}
    young = compaction_jobs()
    young[0] = running(young[0].spec, [0, 1, 2, 3], attained=5)  # A still in G_0
    assert plan_for(toy_profiles, "n1g4", young, max_waiting=0, **Q).allocation == {"A": 4}


def test_compaction_locality_rule(toy_profiles):
    # Two machines of 4, A and B (sat, G_1) fill them. W needs 4 GPUs on
    # ceil(4/4) = 1 machine: each machine can release only 3 (min 1), so W
    # cannot start although 6 GPUs could be released in all. W2 needs 2 and
    # gets them on one machine (A's, the cheaper tie by machine order).
    jobs = [running(spec("A", 4, "sat", t=0), [0, 1, 2, 3], attained=1000),
            running(spec("B", 4, "sat", t=1), [4, 5, 6, 7], attained=1000),
            waiting(spec("W", 4, t=2), attained=20), waiting(spec("W2", 2, t=3), attained=20)]
    plan = plan_for(toy_profiles, "n2g4", jobs, max_waiting=0, **Q)
    assert plan.allocation == {"A": 2, "B": 4, "W2": 2}
    assert set(plan.placement["W2"]) <= {0, 1, 2, 3}


def test_end_to_end_expanded_job_and_inelastic_newcomer(toy_profiles):
    # A (lin, asks 1, 400 it) is alone and expands to 4 GPUs: 100 it/s... 4 it/s.
    # B (rigid, 2 GPUs, 100 it) arrives at 50 while A is still in G_0 (200 GPU-s
    # < 500): one job waits (<= N), so no compaction and no expansion; B waits
    # for A (done at 100) and runs 100-150 at its own count.
    jobs = [spec("A", 1, t=0, iters=400), spec("B", 2, t=50, iters=100, elastic=False)]
    r = simulate(jobs, parse_cluster("n1g4"), get_policy("elastic-tiresias"), profiles=toy_profiles,
                 overheads=NO_OVERHEAD, slot=0)
    by = {j.spec.job_id: j for j in r.jobs}
    assert by["A"].end_time == pytest.approx(100) and by["A"].max_gpus == 4
    assert (by["B"].start_time, by["B"].end_time, by["B"].max_gpus) == (pytest.approx(100), pytest.approx(150), 2)
    assert by["B"].rescales == 0


def test_random_workload_respects_ranges_and_rigid_jobs(toy_profiles):
    # The engine validates every plan (no GPU twice, legal counts); on top:
    # max counts hold and inelastic jobs never change size.
    import random

    rng = random.Random(7)
    jobs = []
    for i in range(40):
        elastic = rng.random() < 0.7
        n = rng.choice([1, 2, 4])
        kw = {"min_gpus": 1, "max_gpus": rng.choice([2, 4, 6])} if elastic else {}
        jobs.append(spec(f"j{i}", n if not elastic else min(n, kw["max_gpus"]), rng.choice(["lin", "sat"]),
                         t=rng.uniform(0, 500), iters=rng.uniform(50, 3000), elastic=elastic, **kw))
    for overheads in (NO_OVERHEAD, OverheadModel(mode="stop-resume", stop_resume_s=20.0)):
        r = simulate(jobs, parse_cluster("n2g4"), get_policy("elastic-tiresias", thresholds=(50.0, 500.0),
                     max_waiting=2), profiles=toy_profiles, overheads=overheads, slot=0)
        assert all(j.state is JobState.COMPLETED for j in r.jobs)
        for j in r.jobs:
            if j.spec.elastic:
                assert j.max_gpus <= j.spec.max_gpus
            else:
                assert j.rescales == 0 and j.max_gpus == j.spec.requested_gpus
        assert sum(j.rescales for j in r.jobs) > 0
