"""Heterogeneity-aware policies: ``gavel`` (Gavel, OSDI'20) and
``tidal-hetero`` (type-and-count allocation in the spirit of Sia, SOSP'23),
with its type-blind variant ``tidal-hetero-agnostic``.

Profiles: the default (untyped) profile is the "A100"; per type, model
``lin`` runs n it/s on n A100s, a quarter of that on T4s and half on
RTX2080Tis; model ``cnn`` barely gains from an A100 (0.8 on a T4, 0.9 on an
RTX) — so ``lin`` has the comparative advantage on A100s.
"""

from __future__ import annotations

import numpy as np
import pytest

from tidal.core.job import JobSpec, JobState
from tidal.core.overhead import OverheadModel
from tidal.core.profile import load_profiles
from tidal.core.topology import parse_cluster
from tidal.scheduler.api import JobView, Snapshot
from tidal.scheduler.policies.gavel import gavel_fractions, gavel_round
from tidal.scheduler.registry import get_policy
from tidal.sim.engine import simulate
from tidal.sim.metrics import summarize

POLICIES = ["gavel", "tidal-hetero", "tidal-hetero-agnostic"]
TYPE_AWARE = ["gavel", "tidal-hetero"]
NO_OVERHEAD = OverheadModel(mode="stop-free", pause_s=0.0, warmup_s=0.0, stop_resume_s=0.0)
_SCALE = {"A100": (1.0, 1.0), "T4": (0.25, 0.8), "RTX2080Ti": (0.5, 0.9)}  # type -> (lin, cnn) factor


@pytest.fixture(scope="module")
def typed(tmp_path_factory):
    d = tmp_path_factory.mktemp("typed")
    counts = (1, 2, 4, 8, 16)
    for sub, (f_lin, f_cnn) in [("", (1.0, 1.0)), *_SCALE.items()]:
        path = d / sub if sub else d
        path.mkdir(exist_ok=True)
        head = "global_batch_size," + ",".join(map(str, counts)) + "\n"
        (path / "lin.csv").write_text(head + "32," + ",".join(f"{n * f_lin:g}" for n in counts) + "\n")
        cnn = [min(n, 4) * 0.5 * f_cnn for n in counts]  # saturates at 4 GPUs
        (path / "cnn.csv").write_text(head + "32," + ",".join(f"{v:g}" for v in cnn) + "\n")
    return load_profiles(d)


def spec(jid, n=1, model="lin", t=0.0, iters=1000.0, **kw):
    return JobSpec(jid, submit_time=t, model=model, batch_size=32, iterations=iters, requested_gpus=n, **kw)


def pending(s):
    return JobView(s, JobState.PENDING, admitted=True)


def snapshot(cluster, jobs, profiles, now=0.0):
    return Snapshot(now=now, cluster=parse_cluster(cluster), jobs=tuple(jobs), profiles=profiles,
                    overheads=NO_OVERHEAD)


def types_of(snap, gpus):
    return {snap.cluster.gpu_type_of(g) for g in gpus}


def random_snapshot(profiles, seed, cluster="2xT4:4,2xA100:8,2xRTX2080Ti:8", jobs=30):
    """Some jobs running on one type each, the rest waiting."""
    rng = np.random.default_rng(seed)
    c = parse_cluster(cluster)
    free = list(range(c.num_gpus))
    views = []
    for i in range(jobs):
        s = spec(f"j{i}", int(rng.choice([1, 2, 4])), str(rng.choice(["lin", "cnn"])), t=float(i),
                 elastic=bool(rng.random() < 0.7))
        node = int(rng.integers(c.num_nodes))
        mine = [g for g in c.gpus_of_node(node) if g in free][: s.requested_gpus]
        if rng.random() < 0.5 and len(mine) == s.requested_gpus:
            for g in mine:
                free.remove(g)
            views.append(JobView(s, JobState.RUNNING, tuple(mine), done=10.0, attained=float(rng.uniform(0, 2e4)),
                                 executed=100.0, admitted=True))
        else:
            views.append(pending(s))
    return Snapshot(now=1000.0, cluster=c, jobs=tuple(views), profiles=profiles)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("seed", range(4))
def test_allocations_fit_each_types_gpus_and_jobs_sit_on_one_type(typed, name, seed):
    snap = random_snapshot(typed, seed)
    plan = get_policy(name).schedule(snap)
    used: dict[int, str] = {}
    for jid, n in plan.allocation.items():
        gpus = plan.placement[jid]
        assert len(gpus) == n
        assert not used.keys() & set(gpus), f"{jid} placed on GPUs of another job"
        used.update(dict.fromkeys(gpus, jid))
        kinds = types_of(snap, gpus)
        assert len(kinds) == 1, f"{name}: {jid} placed on {kinds} though one type fits it"
    for t in snap.cluster.gpu_types:
        placed = sum(1 for g in used if snap.cluster.gpu_type_of(g) == t)
        cap = sum(n.gpus for n in snap.cluster.nodes if n.gpu_type == t)
        assert placed <= cap


@pytest.mark.parametrize("name", TYPE_AWARE)
@pytest.mark.parametrize("elastic", [False, True])
def test_a_lone_job_runs_where_it_is_fastest(typed, name, elastic):
    snap = snapshot("1xT4:4,1xRTX2080Ti:4,1xA100:4", [pending(spec("a", 2, elastic=elastic))], typed)
    plan = get_policy(name).schedule(snap)
    assert types_of(snap, plan.placement["a"]) == {"A100"}


def test_the_job_that_gains_most_gets_the_fast_gpus(typed):
    # one A100 node and one T4 node of 4: lin gains 4x on A100, cnn 1.25x; whichever
    # came first, lin gets the A100s
    for first, second in [("lin", "cnn"), ("cnn", "lin")]:
        jobs = [pending(spec(first, 4, model=first, t=0.0)), pending(spec(second, 4, model=second, t=1.0))]
        snap = snapshot("1xT4:4,1xA100:4", jobs, typed)
        plan = get_policy("tidal-hetero").schedule(snap)
        assert types_of(snap, plan.placement["lin"]) == {"A100"}
        assert types_of(snap, plan.placement["cnn"]) == {"T4"}


@pytest.mark.parametrize("name", POLICIES)
def test_gpu_type_constraints_are_honoured(typed, name):
    jobs = [pending(spec("only-t4", 2, gpu_types=("T4",))), pending(spec("no-a100", 2, exclude_gpu_types=("A100",))),
            pending(spec("free", 2, t=1.0))]
    snap = snapshot("1xT4:4,1xRTX2080Ti:4,1xA100:4", jobs, typed)
    plan = get_policy(name).schedule(snap)
    assert types_of(snap, plan.placement["only-t4"]) == {"T4"}
    assert "A100" not in types_of(snap, plan.placement["no-a100"])


def test_the_agnostic_variant_ignores_gpu_types(typed):
    # the same jobs on the same nodes, GPU types relabelled: the type-blind
    # variant decides the same GPUs; the aware one follows the A100s
    jobs = [pending(spec(f"j{i}", 2, model=m, t=float(i))) for i, m in enumerate(["lin", "cnn", "lin"])]
    plans = {}
    for cluster in ("1xT4:4,1xA100:4,1xRTX2080Ti:4", "1xA100:4,1xT4:4,1xRTX2080Ti:4"):
        snap = snapshot(cluster, jobs, typed)
        plans[cluster] = (get_policy("tidal-hetero-agnostic").schedule(snap), get_policy("tidal-hetero").schedule(snap))
    (blind1, aware1), (blind2, aware2) = plans.values()
    assert blind1.placement == blind2.placement and blind1.allocation == blind2.allocation
    assert aware1.placement != aware2.placement


@pytest.mark.parametrize("name", POLICIES)
def test_decisions_are_deterministic(typed, name):
    snap = random_snapshot(typed, 7)
    a, b = get_policy(name).schedule(snap), get_policy(name).schedule(snap)
    assert (a.allocation, a.placement, a.tags, a.wake_at) == (b.allocation, b.placement, b.tags, b.wake_at)


def test_gavel_max_min_fairness_by_hand():
    # two 1-GPU jobs, a slow and a fast GPU; A runs 1 and 4 it/s there, B 1 and 1.2.
    # X^equal gives each a quarter of each type: 1.25 and 0.55 it/s. Max-min fairness
    # equalises the normalised throughputs: each gets half of each type, 2.0 x equal.
    X = gavel_fractions(np.array([[1.0, 4.0], [1.0, 1.2]]), np.array([1, 1]), np.array([1, 1]))
    norm = (X * [[1.0, 4.0], [1.0, 1.2]]).sum(axis=1) / np.array([1.25, 0.55])
    assert norm == pytest.approx([2.0, 2.0], rel=1e-4)
    assert X.sum(axis=0) == pytest.approx([1.0, 1.0], rel=1e-6)


def test_gavel_fractions_respect_capacity_and_constraints():
    rng = np.random.default_rng(3)
    tput = rng.uniform(0.5, 4.0, (40, 3)) * (rng.random((40, 3)) < 0.8)
    scale = rng.choice([1, 2, 4, 8], 40)
    cap = np.array([8, 16, 4])
    X = gavel_fractions(tput, scale, cap)
    assert (X.sum(axis=1) <= 1 + 1e-6).all()
    assert ((X * scale[:, None]).sum(axis=0) <= cap + 1e-6).all()
    assert (X[tput == 0] == 0).all() and (X[:, 2][scale > 4] == 0).all()


def test_gavel_round_serves_the_pair_furthest_behind_its_share():
    # both jobs should get half of the one GPU type; A has run 3 of 4 rounds, B 1
    X = np.array([[0.5], [0.5]])
    got = gavel_round(X, np.array([[3.0], [1.0]]), np.array([4.0, 4.0]), np.array([1, 1]), np.array([1]))
    assert got == [-1, 0]


def test_gavel_leases_hold_until_the_round_ends(typed):
    # 360 s rounds: a job arriving at t=100 on an idle GPU waits for t=360
    jobs = [spec("a", 1, iters=2000.0), spec("b", 1, t=100.0, iters=100.0)]
    r = simulate(jobs, parse_cluster("1xA100:4"), get_policy("gavel"), profiles=typed, overheads=NO_OVERHEAD, slot=60.0)
    by = {j.spec.job_id: j for j in r.jobs}
    assert by["a"].start_time == 0.0
    assert by["b"].start_time == 360.0


def _trace(n, seed):
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    for i in range(n):
        t += float(rng.exponential(200.0))
        model = str(rng.choice(["lin", "cnn"]))
        out.append(spec(f"j{i}", int(rng.choice([1, 2, 4])), model, t=t, iters=float(rng.uniform(500, 20_000)),
                        elastic=True))
    return out


def test_type_awareness_shortens_the_average_jct(typed):
    jobs = _trace(30, 1)
    cluster = parse_cluster("2xT4:4,1xA100:8,1xRTX2080Ti:8")
    jct = {}
    for name in ("tidal-hetero", "tidal-hetero-agnostic"):
        r = simulate(jobs, cluster, get_policy(name), profiles=typed, slot=60.0)
        s = summarize(r)
        assert s["finished"] == len(jobs)
        jct[name] = s["avg_jct"]
    assert jct["tidal-hetero"] < 0.8 * jct["tidal-hetero-agnostic"], jct


@pytest.mark.parametrize("name", POLICIES)
def test_a_job_larger_than_any_type_runs_across_types(typed, name):
    # 12 GPUs, every type has 8: only a mixed placement holds it, and it finishes
    cluster = parse_cluster("2xT4:4,1xA100:8,1xRTX2080Ti:8")
    jobs = [spec("big", 12, iters=500.0), spec("small", 1, t=10.0, iters=100.0)]
    r = simulate(jobs, cluster, get_policy(name), profiles=typed, overheads=NO_OVERHEAD, slot=60.0)
    assert {j.spec.job_id: j.state for j in r.jobs} == {"big": JobState.COMPLETED, "small": JobState.COMPLETED}
