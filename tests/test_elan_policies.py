"""E-FIFO / E-Backfill (Elan §VI-C) and hybrid scaling (Elan Algorithm 1),
worked by hand with the toy profiles: ``lin`` = n it/s on n GPUs; ``sat`` =
1, 1.5, 2, 2 it/s on 1, 2, 4, 8 GPUs (1.75 on 3). Marginal gains are in
units of the job's one-GPU rate. Slot 0, no rescale overhead unless stated.
"""

from __future__ import annotations

import pytest

from tidal.core.job import JobSpec, JobState
from tidal.core.overhead import OverheadModel
from tidal.core.profile import load_profiles
from tidal.core.topology import parse_cluster
from tidal.scheduler.api import JobView, Snapshot
from tidal.scheduler.policies.elan import Rates, elan_allocation, total_batch
from tidal.scheduler.registry import get_policy
from tidal.sim.engine import simulate

NO_OVERHEAD = OverheadModel(mode="stop-free", pause_s=0.0, warmup_s=0.0, stop_resume_s=0.0)


def job(jid, t, iters, model="lin", lo=1, hi=8, **kw):
    return JobSpec(jid, submit_time=t, model=model, batch_size=32, iterations=iters, requested_gpus=lo,
                   elastic=True, min_gpus=lo, max_gpus=hi, **kw)


def run(policy, jobs, profiles, cluster="n1g4", overheads=NO_OVERHEAD, **opts):
    r = simulate(jobs, parse_cluster(cluster), get_policy(policy, **opts), profiles=profiles,
                 overheads=overheads, slot=0)
    assert all(j.state is JobState.COMPLETED for j in r.jobs)
    return {j.spec.job_id: j for j in r.jobs}


def rates_for(profiles, cluster="n1g8", **kw):
    snap = Snapshot(now=0.0, cluster=parse_cluster(cluster), jobs=(), profiles=profiles, overheads=NO_OVERHEAD)
    return Rates(snap, **kw)


def view(spec):
    return JobView(spec, JobState.PENDING, admitted=True)


# -- allocation rule ---------------------------------------------------------------


def test_allocation_min_then_largest_marginal_gain(toy_profiles):
    rates = rates_for(toy_profiles)
    a, b = view(job("A", 0, 100, "sat")), view(job("B", 0, 100))
    # min 1 each, 6 left: lin gains 1 per GPU, sat at most 0.5 -> all to B.
    assert elan_allocation(rates, [a, b], 8) == {"A": 1, "B": 7}


def test_allocation_stops_at_max_res_and_at_no_gain(toy_profiles):
    rates = rates_for(toy_profiles)
    a, b = view(job("A", 0, 100, "sat")), view(job("B", 0, 100, hi=4))
    # B stops at max 4; A: 1->2 (+0.5), 2->3 (+0.25), 3->4 (+0.25), 4->5 (+0): stops at 4.
    assert elan_allocation(rates, [a, b], 8) == {"A": 4, "B": 4}
    # alone, sat stops where a GPU brings no gain: 4 of 8 GPUs stay idle
    assert elan_allocation(rates, [a], 8) == {"A": 4}


def test_inelastic_job_runs_at_its_count(toy_profiles):
    rates = rates_for(toy_profiles)
    rigid = view(JobSpec("R", 0.0, "lin", 32, 100, requested_gpus=2))
    assert elan_allocation(rates, [rigid, view(job("B", 0, 100, hi=8))], 8) == {"R": 2, "B": 6}


def test_trace_jobs_get_half_to_twice_their_request(toy_profiles):
    rates = rates_for(toy_profiles, cluster="n1g8")
    trace_job = view(JobSpec("T", 0.0, "lin", 32, 100, requested_gpus=3, elastic=True))
    assert rates.counts(trace_job) == [2, 3, 4, 5, 6]


# -- admission rule ------------------------------------------------------------------


def test_admission_squeezes_when_average_jct_does_not_rise(toy_profiles):
    # A (sat, 1..4) runs alone on 4 GPUs at 2 it/s; at t=100 it has 200 it left.
    # B (sat, 200 it) arrives; no GPU is idle.
    #   wait:  A ends in 100 s, B then runs 100 s on 4 GPUs -> 100 + 200 = 300
    #   admit: A 2 + B 2 GPUs (1.5 it/s): 133.3 + 133.3 = 266.7 <= 300 -> start B.
    jobs = [job("A", 0, 400, "sat", hi=4), job("B", 100, 200, "sat", hi=4)]
    by = run("e-fifo", jobs, toy_profiles)
    assert by["B"].start_time == pytest.approx(100)
    assert by["A"].end_time == pytest.approx(100 + 200 / 1.5)
    assert by["B"].end_time == pytest.approx(100 + 200 / 1.5)
    fifo = run("fifo", [JobSpec(j.job_id, j.submit_time, j.model, 32, j.iterations, requested_gpus=4)
                        for j in jobs], toy_profiles)
    assert fifo["B"].start_time == pytest.approx(200)


def test_admission_waits_when_squeezing_raises_average_jct(toy_profiles):
    # Linear jobs: sharing does not speed anything up.
    #   wait:  A (400 it left at t=100) ends in 100 s, B then 100 s -> 100 + 200 = 300
    #   admit: 2 + 2 GPUs -> 200 + 200 = 400 > 300 -> B waits for A.
    jobs = [job("A", 0, 800, lo=2, hi=4), job("B", 100, 400, lo=2, hi=4)]
    by = run("e-fifo", jobs, toy_profiles)
    assert by["A"].end_time == pytest.approx(200) and by["A"].rescales == 0
    assert by["B"].start_time == pytest.approx(200) and by["B"].end_time == pytest.approx(300)


def test_admission_starts_when_min_res_fits_idle_gpus(toy_profiles):
    # A (sat) alone stops at 4 of 8 GPUs (no gain past 4): C's min 2 fits the idle GPUs.
    jobs = [job("A", 0, 2000, "sat"), job("C", 10, 20, lo=2, hi=4)]
    by = run("e-fifo", jobs, toy_profiles, cluster="n1g8")
    assert by["C"].start_time == pytest.approx(10)
    assert by["C"].max_gpus == 4 and by["A"].max_gpus == 4  # C takes the idle 4 (lin gains)
    assert by["C"].end_time == pytest.approx(15)


def test_e_backfill_lets_a_short_job_pass_a_blocked_head(toy_profiles):
    # A (lin, 2..4) runs on 4 GPUs, 400 it. H (min 4) arrives at 1: min_res of
    # A + H = 6 > 4, so H is blocked; its shadow time is A's end (~100 s).
    # S (1 GPU, 10 it) arrives at 2.
    #   E-FIFO: S waits behind H: H runs 100-200, S 200-210.
    #   E-Backfill: S passes the admission rule (A 3 + S 1: 130.7 + 10 <
    #   98 + 108) and ends in 10 s < shadow -> runs 2-12; A grows back to 4 at
    #   12 (done 8 + 30 = 38, 362 left -> ends 102.5); H runs 102.5-202.5.
    jobs = [job("A", 0, 400, lo=2, hi=4), job("H", 1, 400, lo=4, hi=4), job("S", 2, 10, lo=1, hi=1)]
    fifo = run("e-fifo", jobs, toy_profiles)
    assert fifo["S"].start_time == pytest.approx(200) and fifo["S"].end_time == pytest.approx(210)
    assert fifo["H"].start_time == pytest.approx(100)
    bf = run("e-backfill", jobs, toy_profiles)
    assert bf["S"].start_time == pytest.approx(2) and bf["S"].end_time == pytest.approx(12)
    assert bf["A"].end_time == pytest.approx(102.5)
    assert bf["H"].start_time == pytest.approx(102.5) and bf["H"].end_time == pytest.approx(202.5)


def test_started_jobs_are_never_preempted(toy_profiles):
    jobs = [job("A", 0, 4000, "sat", hi=4)] + [job(f"B{i}", 10 + i, 300, "sat", hi=4) for i in range(6)]
    by = run("e-fifo", jobs, toy_profiles)
    assert all(j.preemptions == 0 for j in by.values())


# -- hybrid scaling ------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_profiles(tmp_path_factory):
    """``hyb`` at batch 32: 1, 1.5, 2, 2 it/s (strong scaling saturates at 4);
    at batch 64: 0.5, 1, 1.8, 3.2 it/s (twice the samples per iteration)."""
    d = tmp_path_factory.mktemp("hybrid")
    (d / "hyb.csv").write_text("global_batch_size,1,2,4,8\n32,1,1.5,2,2\n64,0.5,1,1.8,3.2\n")
    return load_profiles(d)


def test_get_total_batch_size_doubles_only_when_strong_scaling_saturates(hybrid_profiles):
    snap = Snapshot(now=0.0, cluster=parse_cluster("n1g8"), jobs=(), profiles=hybrid_profiles)
    j = view(JobSpec("H", 0.0, "hyb", 32, 100, elastic=True))
    # 4 GPUs: S32(4) = 2 >= 1.2 * S32(2) = 1.8 -> strong scaling still pays: 32.
    assert total_batch(snap, j, 4) == 32
    # 8 GPUs: S32(8) = 2 < 1.2 * S32(4) = 2.4 -> saturated; at 64 the job makes
    # 3.2 * 64/32 = 6.4 spec it/s > 2 -> 64 (128 is not profiled: stop).
    assert total_batch(snap, j, 8) == 64
    assert snap.progress_rate(j, 8, 64) == pytest.approx(6.4)


def test_hybrid_job_grows_past_saturation_with_a_larger_batch(hybrid_profiles):
    # Alone on 8 GPUs, 640 it. Without hybrid scaling E-FIFO stops at 4 GPUs
    # (no gain past 4): 640 / 2 = 320 s. With it (meta hybrid=1) the job takes
    # all 8 at batch 64: 640 / 6.4 = 100 s.
    plain = JobSpec("P", 0.0, "hyb", 32, 640, elastic=True, min_gpus=1, max_gpus=8)
    hybrid = JobSpec("H", 0.0, "hyb", 32, 640, elastic=True, min_gpus=1, max_gpus=8, meta=(("hybrid", "1"),))
    p = run("e-fifo", [plain], hybrid_profiles, cluster="n1g8")["P"]
    h = run("e-fifo", [hybrid], hybrid_profiles, cluster="n1g8")["H"]
    assert (p.max_gpus, p.batch, p.end_time) == (4, 32, pytest.approx(320))
    assert (h.max_gpus, h.batch, h.end_time) == (8, 64, pytest.approx(100))
    # the policy option turns it on for every elastic job
    o = run("e-fifo", [plain], hybrid_profiles, cluster="n1g8", hybrid=True)["P"]
    assert (o.max_gpus, o.batch) == (8, 64)


def test_hybrid_batch_returns_when_the_job_shrinks(hybrid_profiles):
    # H runs alone at 8 GPUs / batch 64; B (rigid, 4 GPUs) arrives and fits only
    # if H goes back to 4 GPUs, where strong scaling at batch 32 pays again.
    h = JobSpec("H", 0.0, "hyb", 32, 6400, elastic=True, min_gpus=4, max_gpus=8, meta=(("hybrid", "1"),))
    b = JobSpec("B", 10.0, "hyb", 32, 20, requested_gpus=4)
    r = simulate([h, b], parse_cluster("n1g8"), get_policy("e-fifo"), profiles=hybrid_profiles,
                 overheads=NO_OVERHEAD, slot=0)
    by = {j.spec.job_id: j for j in r.jobs}
    assert by["B"].start_time == pytest.approx(10)
    # H: 64 spec it by 10 s; at 4 GPUs and batch 32 (2 it/s) while B runs 10 s
    # (20 it at 2 it/s) -> 84 by 20; back to 8 GPUs / batch 64 -> 20 + 6316 / 6.4
    assert by["H"].end_time == pytest.approx(20 + (6400 - 84) / 6.4)
    assert by["H"].batch == 64


@pytest.mark.parametrize("policy", ["e-fifo", "e-backfill"])
def test_random_workload_respects_ranges_and_rigid_jobs(policy, hybrid_profiles, toy_profiles):
    # The engine validates every plan (no GPU twice, legal counts); on top:
    # max_res holds, inelastic jobs never change size, nobody is preempted.
    import random

    from tidal.core.profile import ThroughputProfile

    profiles = ThroughputProfile({**toy_profiles.curves, **hybrid_profiles.curves})
    rng = random.Random(3)
    jobs = []
    for i in range(40):
        model = rng.choice(["lin", "sat", "hyb"])
        if rng.random() < 0.7:
            lo = rng.choice([1, 2])
            jobs.append(JobSpec(f"j{i}", rng.uniform(0, 500), model, 32, rng.uniform(50, 3000), requested_gpus=lo,
                                elastic=True, min_gpus=lo, max_gpus=rng.choice([2, 4, 8]),
                                meta=(("hybrid", "1"),) if rng.random() < 0.5 else ()))
        else:
            jobs.append(JobSpec(f"j{i}", rng.uniform(0, 500), model, 32, rng.uniform(50, 3000),
                                requested_gpus=rng.choice([1, 2, 4])))
    r = simulate(jobs, parse_cluster("n2g4"), get_policy(policy), profiles=profiles,
                 overheads=OverheadModel(mode="stop-resume", stop_resume_s=20.0), slot=0)
    assert all(j.state is JobState.COMPLETED for j in r.jobs)
    for j in r.jobs:
        assert j.preemptions == 0
        if j.spec.elastic:
            assert j.max_gpus <= j.spec.max_gpus
        else:
            assert j.rescales == 0 and j.max_gpus == j.spec.requested_gpus
    assert sum(j.rescales for j in r.jobs) > 0


# -- the step order reproduces the rule's heap exactly -----------------------------


def _heap_rule(rates, jobs, total, lookahead):
    """The allocation rule as a plain heap, re-run from scratch (the reference)."""
    import heapq

    from tidal.scheduler.elan_order import next_step

    alloc, pos, heap = {}, {}, []
    free = total - sum(rates.counts(j)[0] for j in jobs)

    def push(j, cap):
        cs, rs = rates.table(j)
        g, k = next_step(cs, rs, pos[j.job_id], rates.one(j), cap, lookahead)
        if k:
            heapq.heappush(heap, (-g, j.spec.submit_time, j.job_id, k, j))

    for j in jobs:
        alloc[j.job_id], pos[j.job_id] = rates.counts(j)[0], 0
    for j in jobs:
        push(j, alloc[j.job_id] + free)
    while heap and free > 0:
        _, _, jid, k, j = heapq.heappop(heap)
        need = rates.table(j)[0][k] - alloc[jid]
        if need <= free:
            alloc[jid], pos[jid] = rates.table(j)[0][k], k
            free -= need
        push(j, alloc[jid] + free)
    return alloc


def _loop_fluid(rates, jobs, total, late, cost):
    """The fluid estimate as a plain loop over completions (the reference)."""
    import math

    rem = {j.job_id: j.remaining for j in jobs}
    present, t, acc, first = list(jobs), 0.0, 0.0, True
    lows = sum(rates.counts(j)[0] for j in present)
    while present:
        alloc = _heap_rule(rates, present, total, 8)
        speed = {j.job_id: rates.rate(j, alloc[j.job_id]) for j in present}
        if first:
            for j in present:
                if j.running and alloc[j.job_id] < j.size:
                    rem[j.job_id] += cost * speed[j.job_id]
            first = False
        dt = min(rem[x] / r if r > 0 else math.inf for x, r in speed.items())
        if dt == math.inf:
            return math.inf
        t += dt
        left = []
        for j in present:
            rem[j.job_id] -= speed[j.job_id] * dt
            if rem[j.job_id] <= 1e-9 * max(1.0, j.remaining):
                acc += t
                lows -= rates.counts(j)[0]
            else:
                left.append(j)
        present = left
        if late is not None and lows + rates.counts(late)[0] <= total:
            present.append(late)
            rem[late.job_id] = late.remaining
            lows += rates.counts(late)[0]
            late = None
    return acc if late is None else math.inf


def _random_jobs(rng, n: int, p_allowed: float) -> tuple[list[JobView], Snapshot]:
    """``n`` random admitted jobs on n8g8 (about half running; a share
    ``p_allowed`` with power-of-two ``allowed_gpus``) and their snapshot."""
    profiles = load_profiles()
    models = [m for m in profiles.models if m != "resnet50_cifar10"]
    views = []
    for i in range(n):
        m = rng.choice(models)
        p = rng.choice([1, 2, 4, 8])
        allowed = (1, 2, 4, 8, 16) if rng.random() < p_allowed else None
        spec = JobSpec(f"j{i}", submit_time=float(rng.randint(0, 5)), model=m, batch_size=rng.choice(profiles.batch_sizes(m)),
                       iterations=float(rng.randint(100, 50_000)), requested_gpus=p, elastic=rng.random() < 0.85,
                       allowed_gpus=allowed)
        running = rng.random() < 0.5
        views.append(JobView(spec, JobState.RUNNING if running else JobState.PENDING,
                             gpus=tuple(range(p)) if running else (), done=rng.uniform(0, 50), admitted=True))
    return views, Snapshot(now=0.0, cluster=parse_cluster("n8g8"), jobs=tuple(views), profiles=profiles)


@pytest.mark.parametrize("seed", range(6))
def test_step_order_matches_the_heap_rule_and_the_fluid_loop(seed):
    """Random job sets (power-of-two ``allowed_gpus`` make steps of several
    GPUs; a small lookahead makes the cap cut them): the step order gives the
    heap's allocation, and the fluid estimate the plain loop's sums, bit for bit."""
    import random

    from tidal.scheduler.elan_order import fluid_sum

    rng = random.Random(seed)
    views, snap = _random_jobs(rng, 40, 0.4)
    rates = Rates(snap, hybrid_all=seed % 2 == 1)
    for _ in range(25):
        sub = [v for v in views if rng.random() < 0.5]
        total = rng.choice([16, 32, 64, 100])
        if sum(rates.counts(v)[0] for v in sub) > total:
            continue
        look = rng.choice([8, 8, 3, 5])
        assert elan_allocation(rates, sub, total, look) == _heap_rule(rates, sub, total, look)
        if sub:
            order = rates.order(views)
            late = sub.pop() if rng.random() < 0.5 else None
            xs = [order.index[v.job_id] for v in sub]
            got = fluid_sum(order, xs, total, None if late is None else order.index[late.job_id], 50.0)
            assert got == _loop_fluid(rates, sub, total, late, 50.0)


@pytest.mark.parametrize("seed", range(6))
def test_the_paired_fluid_estimates_match_two_separate_ones(seed):
    """The admission test's two fluid runs evaluated side by side give the
    two separate estimates bit for bit (random sets, capped steps, running
    jobs paying the shrink cost, a late job that may or may not fit)."""
    import random

    from tidal.scheduler.elan_order import fluid_sum
    from tidal.scheduler.elan_pair import fluid_pair

    rng = random.Random(100 + seed)
    views, snap = _random_jobs(rng, 60, 0.3)
    rates = Rates(snap, hybrid_all=seed % 2 == 1)
    for _ in range(12):
        look = rng.choice([8, 8, 3, 5])
        order = rates.order(views, look)
        sub = [order.index[v.job_id] for v in views if rng.random() < 0.6]
        if len(sub) < 2:
            continue
        w = sub.pop()
        total = rng.choice([24, 32, 64, 100])
        cost = rng.choice([0.0, 50.0])
        assert fluid_pair(order, sub, w, total, cost) == (fluid_sum(order, sub + [w], total, None, cost),
                                                          fluid_sum(order, sub, total, w, cost))


def test_the_table_cache_is_keyed_by_the_spec_object_and_bounded(toy_profiles):
    from tidal.scheduler.elan_cache import ElanCache

    cache = ElanCache(limit=4)
    cache.bind(toy_profiles, 8, False)
    a = job("A", 0, 100)
    t = cache.table(a)
    assert cache.table(a) is t
    assert cache.table(job("A", 0, 100)) is t  # an equal spec (an executor that rebuilds specs)
    assert cache.table(job("A", 0, 200)) is not t  # another spec under the same id: new tables
    assert cache.table(job("A", 0, 200, meta=(("hybrid", "1"),))) is not cache.table(job("A", 0, 200))
    for i in range(10):
        cache.table(job(f"B{i}", 0, 100))
    assert len(cache) <= 4
    cache.bind(toy_profiles, 16, False)  # another cluster size: every table is dropped
    assert len(cache) == 0
    # one policy object across decisions and clusters gives the same plans as fresh ones
    jobs = [job("A", 0, 400, "sat", hi=4), job("B", 10, 200), job("C", 20, 300, "sat", lo=2, hi=8)]
    shared = get_policy("e-backfill")
    for cluster in ("n1g4", "n1g8", "n1g4"):
        snap = Snapshot(now=30.0, cluster=parse_cluster(cluster), jobs=tuple(view(s) for s in jobs),
                        profiles=toy_profiles, overheads=NO_OVERHEAD)
        assert shared.schedule(snap) == get_policy("e-backfill").schedule(snap)



def _busy(seed: int) -> Snapshot:
    """A busy n4g8 cluster: 60 admitted jobs, about half running on buddy
    placements, and a few just submitted (admission has tests to run)."""
    import random

    from tidal.scheduler.buddy import BuddyAllocator

    rng = random.Random(seed)
    profiles = load_profiles()
    models = [m for m in profiles.models if m != "resnet50_cifar10"]
    cluster = parse_cluster("n4g8")
    buddy = BuddyAllocator(cluster)
    views = []
    for i in range(64):
        m = rng.choice(models)
        p = rng.choice([1, 1, 2, 4])
        spec = JobSpec(f"j{i}", submit_time=float(i), model=m, batch_size=rng.choice(profiles.batch_sizes(m)),
                       iterations=float(rng.randint(1_000, 500_000)), requested_gpus=p, elastic=True)
        got = buddy.alloc(p) if i < 60 and rng.random() < 0.6 else None
        views.append(JobView(spec, JobState.RUNNING if got else JobState.PENDING, gpus=tuple(sorted(got or ())),
                             done=rng.uniform(0, 500), admitted=i < 60))
    return Snapshot(now=100.0, cluster=cluster, jobs=tuple(views), profiles=profiles)


@pytest.mark.parametrize("policy", ["e-fifo", "e-backfill"])
def test_a_policy_that_decided_before_plans_as_a_fresh_one(policy, monkeypatch):
    """What a policy object keeps across decisions (tables, shapes, the last
    step order) never changes a plan: random busy clusters decided again (the
    same snapshot, new tags, progress moved, a job gone) give the plans of a
    fresh policy."""
    import dataclasses
    import random

    import tidal.scheduler.policies.elan as elan

    calls = []
    real = elan.event_pair
    monkeypatch.setattr(elan, "event_pair", lambda *a: calls.append(1) or real(*a))
    shared = get_policy(policy)
    for seed in range(6):
        snap = _busy(seed)
        rng = random.Random(seed)
        moved = dataclasses.replace(snap, jobs=tuple(
            v._replace(done=rng.uniform(0.0, 0.9) * v.spec.iterations) for v in snap.jobs))
        tagged = dataclasses.replace(snap, jobs=tuple(v._replace(tags={"k": "v"}) for v in snap.jobs))
        fewer = dataclasses.replace(snap, jobs=snap.jobs[1:])
        for s in (snap, tagged, moved, snap, fewer, moved, moved):
            assert shared.schedule(s) == get_policy(policy).schedule(s)
    assert calls  # the snapshots do run admission tests


@pytest.mark.parametrize("seed", range(6))
def test_plenty_allocation_is_the_rule_s_allocation(seed):
    """Random job sets and cluster sizes (small and large, so both cases
    come up): where GPUs are plenty, the counts read off each job's last
    uncapped step equal the step order's allocation and the plain heap's."""
    import random

    from tidal.scheduler.policies.elan import plenty_allocation, rule_allocation

    rng = random.Random(200 + seed)
    views, snap = _random_jobs(rng, 40, 0.4)
    rates = Rates(snap, hybrid_all=seed % 2 == 1)
    hits = misses = 0
    for _ in range(40):
        sub = [v for v in views if rng.random() < rng.choice([0.1, 0.3, 0.6])]
        look = rng.choice([8, 8, 3, 5])
        total = rng.choice([16, 32, 64, 100, 200, 400])
        if rng.random() < 0.5:  # about as many GPUs as the last steps take: fewer than lookahead spare, or short
            total = sum(rates.tops(sub, look)) + rng.randint(-3, look)
        if sum(rates.counts(v)[0] for v in sub) > total:
            continue
        got = plenty_allocation(rates, sub, total, look)
        if got is None:
            misses += 1
            continue
        hits += 1
        assert got == rule_allocation(rates, sub, total, look) == _heap_rule(rates, sub, total, look)
        assert elan_allocation(rates, sub, total, look) == got
    assert hits and misses


class _Checked:
    """A policy's decisions checked where the simulator would skip them:
    after a plan the policy calls settled, every later round with only
    completions since must change nothing (each job keeps its GPUs, no
    batch). ``settled`` answers False, so that every round is decided."""

    def __init__(self, inner):
        self.inner, self.name, self.checked, self.last = inner, inner.name, 0, None

    def schedule(self, snap):
        plan = self.inner.schedule(snap)
        ids = {v.job_id for v in snap.jobs}
        if self.last is not None and ids <= self.last:
            self.checked += 1
            assert plan.allocation == dict(snap.sizes) and not plan.batch and not plan.drop
            assert plan.placement == dict(snap.held)
        else:
            self.last = None
        if self.inner.settled(snap, plan):
            self.last = ids
        return plan

    def settled(self, snap, plan):  # noqa: ARG002
        return False


@pytest.mark.parametrize("policy", ["e-fifo", "e-backfill"])
@pytest.mark.parametrize("seed", range(3))
def test_a_settled_plan_holds_until_a_job_arrives(policy, seed):
    """Random workloads on clusters where GPUs are sometimes plenty: after
    every plan the policy calls settled, the rounds with only completions
    since (those the simulator skips) decide nothing new; skipping them
    gives the same result as deciding every round."""
    import random

    rng = random.Random(300 + seed)
    profiles = load_profiles()
    models = [m for m in profiles.models if m != "resnet50_cifar10"]
    specs = []
    for i in range(60):
        m = rng.choice(models)
        specs.append(JobSpec(f"j{i}", submit_time=float(rng.randint(0, 4000)), model=m,
                             batch_size=rng.choice(profiles.batch_sizes(m)), iterations=float(rng.randint(500, 20_000)),
                             requested_gpus=rng.choice([1, 2, 4, 8]), elastic=rng.random() < 0.85,
                             meta=(("hybrid", "1"),) if rng.random() < 0.3 else ()))
    cluster = parse_cluster(rng.choice(["n4g8", "n8g8", "n16g8"]))
    checked = _Checked(get_policy(policy))
    every = simulate(specs, cluster, checked, profiles=profiles, slot=60.0)
    skipping = simulate(specs, cluster, get_policy(policy), profiles=profiles, slot=60.0)
    assert checked.checked
    assert every.rounds == skipping.rounds
    assert [(j.spec.job_id, j.end_time) for j in every.jobs] == [(j.spec.job_id, j.end_time) for j in skipping.jobs]
