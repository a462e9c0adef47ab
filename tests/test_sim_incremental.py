"""The simulator's state kept between rounds (issue 15) gives what rebuilding
it would: numpy progress rows match the per-job sums bit for bit, the
snapshot's indexes match the ones derived from its jobs, placement's
copy-on-write free map behaves as a plain dict of free lists, and a snapshot
never changes after the policy got it."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from tidal.core.job import JobSpec, JobState
from tidal.core.topology import parse_cluster
from tidal.core.profile import load_profiles
from tidal.scheduler.api import FrozenDict, JobView, Plan, Policy, Snapshot
from tidal.scheduler.placement import FreeMap
from tidal.scheduler.policies.tiresias import Tiresias, everyone_fits, tiresias_allocation
from tidal.scheduler.registry import get_policy
from tidal.sim.engine import Simulator
from tidal.sim.metrics import job_rows, summarize
from tidal.sim.progress import Progress, SimJob
from tidal.sim.runset import RunSet
from tidal.sim.views import LazyJobs

PROFILES = load_profiles()


def _job(i: int, rng: random.Random) -> SimJob:
    spec = JobSpec(f"j{i}", 0.0, "m", 32, 1e9)
    job = SimJob(spec=spec, state=JobState.RUNNING, gpus=tuple(range(rng.randint(1, 4))), last_t=0.0)
    job.single_rate = rng.uniform(0.1, 3.0)
    rate = rng.uniform(0.1, 40.0)
    if rng.random() < 0.3:  # in a rescale: paused, then running
        job.segments = [(0.0, 0.0, len(job.gpus)), (rng.uniform(1, 90), rate, 0)]
        job.state = JobState.RESIZING
    else:
        job.segments = [(0.0, rate, rng.choice([0, 0, 1]))]
    return job


def test_rows_match_per_job_sums_bit_for_bit() -> None:
    a = [_job(i, random.Random(i)) for i in range(40)]  # advanced one by one
    b = [_job(i, random.Random(i)) for i in range(40)]  # advanced as rows
    rng = random.Random(3)
    ref, fast = Progress(0.0), Progress(0.0)
    rows = RunSet(8)  # grows
    for job in b:
        rows.add(job, FrozenDict())
    t = 0.0
    for _ in range(50):
        t += rng.choice([60.0, 0.1 + rng.random() * 100, 0.0])
        for job in a:
            ref.advance(job, t)
        rows.advance(t, fast, {j.spec.job_id: FrozenDict() for j in b})
    rows.flush_all()
    assert fast.useful == ref.useful
    for x, y in zip(a, b):
        assert (x.done, x.attained, x.executed, x.gpu_seconds, x.overhead_gpu_s, x.last_t, x.state) == (
            y.done, y.attained, y.executed, y.gpu_seconds, y.overhead_gpu_s, y.last_t, y.state)


class _DictFreeMap:
    """The free map as a plain dict (the behaviour FreeMap must keep)."""

    def __init__(self, cluster, used: set[int]) -> None:
        per = cluster.gpus_per_node
        self.by_node: dict[int, list[int]] = defaultdict(list)
        for node in range(cluster.num_nodes):
            free = [g for g in range(node * per, (node + 1) * per) if g not in used]
            if free:
                self.by_node[node] = free

    def take(self, node: int, k: int) -> list[int]:
        gpus = self.by_node[node]
        out, self.by_node[node] = gpus[:k], gpus[k:]
        if not self.by_node[node]:
            del self.by_node[node]
        return out

    def give(self, gpus: list[int], per: int) -> None:
        for g in gpus:
            self.by_node[g // per].append(g)
        for node in {g // per for g in gpus}:
            self.by_node[node].sort()


def test_free_map_behaves_as_a_dict_of_free_lists() -> None:
    cluster = parse_cluster("n8g4s2")
    rng = random.Random(5)
    used = set(rng.sample(range(cluster.num_gpus), 14))
    fmap, ref = FreeMap(cluster, used), _DictFreeMap(cluster, used)
    for _ in range(300):
        if rng.random() < 0.5 and ref.by_node:
            node = rng.choice(sorted(ref.by_node))
            k = rng.randint(0, len(ref.by_node[node]))
            assert fmap.take(node, k) == ref.take(node, k)
        else:
            free = {g for v in ref.by_node.values() for g in v}
            back = rng.sample(sorted(set(range(cluster.num_gpus)) - free), min(3, cluster.num_gpus - len(free)))
            fmap.give(list(back))
            ref.give(list(back), cluster.gpus_per_node)
        assert list(fmap.by_node.items()) == list(ref.by_node.items())


def _spied_run(look_now: bool) -> list:
    """Tiresias on a cluster contended at times (preemptions), everyone fitting
    at others; per round, the snapshot and, if ``look_now``, what its jobs and
    indexes were while the policy ran."""
    seen: list = []

    class Spy(Policy):
        def __init__(self) -> None:
            self.inner = get_policy("tiresias")

        def schedule(self, snap: Snapshot) -> Plan:
            now = (tuple(snap.jobs), snap.idle, snap.holders_running) if look_now else None
            seen.append((snap, dict(snap.held), dict(snap.sizes), snap.free, now))
            return self.inner.schedule(snap)

        def allocation(self, snap: Snapshot, plan: Plan) -> None:  # pragma: no cover
            raise AssertionError

    rng = random.Random(1)
    specs = [JobSpec(f"j{i}", rng.uniform(0, 12_000), "resnet50", 128, rng.uniform(1e3, 3e4),
                     requested_gpus=rng.choice([1, 2, 4, 8])) for i in range(60)]
    Simulator(parse_cluster("n4g8"), Spy(), specs, slot=60.0).run()
    return seen


def test_snapshot_indexes_match_its_jobs_and_never_change() -> None:
    """The engine's indexes and its lazily built jobs equal what a plain
    snapshot of the same jobs derives; a snapshot read only after the run
    (every later round having changed the engine's state) equals the same
    round's snapshot read while the policy ran."""
    early, late = _spied_run(True), _spied_run(False)
    assert len(late) == len(early) > 20
    # rounds where everyone fits read only a few views: their jobs were never built
    assert sum(isinstance(s[0].jobs, LazyJobs) and s[0].jobs._built is None for s in late) >= 5
    rng = random.Random(5)
    preempted = 0
    for (snap, held, sizes, free, _), (_, _, _, _, now) in zip(late, early):
        assert tuple(snap.jobs) == now[0]
        assert (snap.idle, snap.holders_running) == now[1:]
        fresh = Snapshot(snap.now, snap.cluster, now[0], snap.profiles)
        assert held == dict(snap.held) == dict(fresh.held)
        assert sizes == dict(fresh.sizes)
        assert free == snap.free == fresh.free and snap.by_free == fresh.by_free
        assert snap.submitted == fresh.submitted and snap.idle == fresh.idle and snap.ids == fresh.ids
        assert snap.holders_running is fresh.holders_running is True
        assert len(snap.jobs) == len(fresh.jobs) and dict(snap.view_of) == dict(fresh.view_of)
        for k in (1, 2, 3, len(fresh.ids)):
            pick = set(rng.sample(fresh.ids, min(k, len(fresh.ids)))) | {"not-a-job"}
            assert snap.in_order(pick) == fresh.in_order(pick) == [j for j in fresh.jobs if j.job_id in pick]
        preempted += any(j.executed > 0 and not j.gpus for j in fresh.jobs)
    assert preempted  # some rounds had preempted jobs waiting (idle order restored)
    with pytest.raises(TypeError):
        late[-1][0].held["x"] = (0,)  # type: ignore[index]


class _CountingTiresias(Tiresias):
    """Tiresias that counts its calls; ``settle=False`` makes the engine call it every round."""

    def __init__(self, settle: bool) -> None:
        super().__init__()
        self.settle = settle
        self.calls = 0

    def schedule(self, snap: Snapshot) -> Plan:
        self.calls += 1
        return super().schedule(snap)

    def settled(self, snap: Snapshot, plan: Plan) -> bool:
        return self.settle and super().settled(snap, plan)


@pytest.mark.parametrize("cluster", ["n2g8", "n16g8"])
def test_skipping_settled_rounds_changes_nothing(cluster: str) -> None:
    rng = random.Random(11)
    specs = [JobSpec(f"j{i}", rng.uniform(0, 20_000), "resnet50", 128, rng.uniform(1e3, 6e4),
                     requested_gpus=rng.choice([1, 1, 2, 4, 8])) for i in range(150)]
    runs = {}
    for settle in (False, True):
        policy = _CountingTiresias(settle)
        result = Simulator(parse_cluster(cluster), policy, specs, slot=60.0).run()
        runs[settle] = (policy.calls, summary_without_wall(result), job_rows(result), result.timeline)
    assert runs[True][1:] == runs[False][1:]
    assert runs[False][0] == runs[False][1]["rounds"]
    assert runs[True][0] < runs[False][0]  # some rounds were skipped


def summary_without_wall(result) -> dict:  # type: ignore[no-untyped-def]
    s = summarize(result)
    s.pop("wall_seconds")
    return s


def _tiresias_snapshot(seed: int, cluster: str) -> Snapshot:
    """Admitted jobs, some running (their GPUs from a shuffled pool), some
    waiting after having run (promotion candidates), a few just submitted."""
    rng = random.Random(seed)
    c = parse_cluster(cluster)
    pool = list(range(c.num_gpus))
    rng.shuffle(pool)
    views = []
    for i in range(40):
        n = rng.choice([1, 2, 4, 8])
        spec = JobSpec(f"j{i}", rng.uniform(0, 5000), "resnet50", 128, 1e5, requested_gpus=n)
        executed = rng.choice([0.0, rng.uniform(1, 4000)])
        if i >= 36:
            views.append(JobView(spec, JobState.SUBMITTED))
        elif rng.random() < 0.5 and len(pool) >= n:
            gpus = tuple(sorted(pool.pop() for _ in range(n)))
            views.append(JobView(spec, JobState.RUNNING, gpus, attained=executed * n, executed=executed,
                                 admitted=True))
        else:
            tags = {"tiresias_base": rng.uniform(0, 800)} if rng.random() < 0.3 else {}
            views.append(JobView(spec, JobState.PENDING, (), attained=executed * n, executed=executed,
                                 waiting_since=rng.uniform(5000, 9000), admitted=True, tags=tags))
    return Snapshot(10_000.0, c, tuple(views), PROFILES)


@pytest.mark.parametrize("cluster", ["n4g8", "n32g8"])
def test_tiresias_when_everyone_fits_plans_as_the_full_pass(cluster: str) -> None:
    taken = 0
    for seed in range(40):
        snap = _tiresias_snapshot(seed, cluster)
        for knob in (0.5, 8.0):
            policy = Tiresias(promote_knob=knob)
            ref = Plan()
            policy.admission(snap, ref)
            tiresias_allocation(snap, ref, policy.thresholds, knob)
            policy.placement(snap, ref)
            fast = policy.schedule(snap)
            assert fast == ref
            plan = Plan()
            policy.admission(snap, plan)
            taken += everyone_fits(snap, plan, policy.thresholds, knob)
    # the large cluster takes the shortcut, the small one the full pass
    assert taken > 0 if cluster == "n32g8" else taken < 80


@pytest.mark.parametrize("name", ["tiresias", "fifo", "gandiva", "themis"])
def test_start_only_rounds_apply_as_the_general_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds whose plan only starts jobs without GPUs take a fast path
    (PlanExecutor._starting, _start_only) and give what the general path
    (changing, diff_plan, validate_plan, _move) gives, job by job."""
    from tidal.sim.apply import PlanExecutor

    rng = random.Random(21)
    specs = [JobSpec(f"j{i}", rng.uniform(0, 20_000), "resnet50", 128, rng.uniform(1e3, 6e4),
                     requested_gpus=rng.choice([1, 1, 2, 4, 8])) for i in range(150)]

    def run() -> tuple:
        result = Simulator(parse_cluster("n4g8"), get_policy(name), specs, slot=60.0).run()
        return summary_without_wall(result), job_rows(result), result.timeline, result.useful_norm_s

    fast = run()
    monkeypatch.setattr(PlanExecutor, "_starting", lambda self, snap, plan: None)
    assert run() == fast
