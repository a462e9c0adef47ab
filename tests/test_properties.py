"""Property tests over random workloads, for every registered policy:
no GPU is ever held by two jobs, every job ends accounted for, and the same
input gives the same result."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal.core.job import JobSpec, JobState
from tidal.core.overhead import OverheadModel
from tidal.core.profile import load_profiles
from tidal.core.topology import parse_cluster
from tidal.scheduler.api import Plan, Policy, Snapshot
from tidal.scheduler.registry import get_policy, policy_names
from tidal.sim.engine import simulate
from tidal.sim.metrics import summarize

PROFILES = load_profiles()
MODELS = [m for m in PROFILES.models if m != "resnet50_cifar10"]


class Recorder(Policy):
    """Wraps a policy and checks every plan independently of the engine."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self.plans = 0

    def schedule(self, snap: Snapshot) -> Plan:
        plan = self.inner.schedule(snap)
        self.plans += 1
        owner: dict[int, str] = {}
        for jid, n in plan.allocation.items():
            gpus = plan.placement.get(jid, ())
            assert len(gpus) == n, f"{jid}: {n} GPUs allocated, {len(gpus)} placed"
            for g in gpus:
                assert 0 <= g < snap.cluster.num_gpus
                assert g not in owner, f"GPU {g} placed for {owner[g]} and {jid} at t={snap.now}"
                owner[g] = jid
        assert sum(plan.allocation.values()) <= snap.cluster.num_gpus
        return plan

    def allocation(self, snap, plan):  # pragma: no cover - schedule() is overridden
        raise NotImplementedError


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 25))
    jobs = []
    for i in range(n):
        model = draw(st.sampled_from(MODELS))
        batch = draw(st.sampled_from(PROFILES.batch_sizes(model)))
        t = draw(st.integers(0, 20_000))
        gpus = draw(st.sampled_from([1, 1, 2, 4, 8, 16, 48]))
        iters = draw(st.integers(1, 50_000))
        ddl = draw(st.one_of(st.none(), st.integers(60, 100_000)))
        elastic = draw(st.booleans())
        jobs.append(
            JobSpec(f"j{i}", submit_time=t, model=model, batch_size=batch, iterations=iters,
                    requested_gpus=gpus, deadline=None if ddl is None else t + ddl, elastic=elastic)
        )
    return jobs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    jobs=workloads(),
    cluster=st.sampled_from(["n1g4", "n2g8", "n4g8s2", "n4g4"]),
    policy=st.sampled_from(policy_names()),
    slot=st.sampled_from([0.0, 60.0]),
    mode=st.sampled_from(["stop-free", "stop-resume"]),
)
def test_invariants(jobs, cluster, policy, slot, mode):
    topo = parse_cluster(cluster)
    rec = Recorder(get_policy(policy))
    r = simulate(jobs, topo, rec, overheads=OverheadModel(mode=mode), slot=slot)
    for j in r.jobs:
        if j.state is JobState.DROPPED:
            assert j.drop_reason
        else:
            # no horizon: everything that was admitted must finish
            assert j.state is JobState.COMPLETED, (j.spec, j.state)
            assert j.end_time >= j.spec.submit_time
            assert not j.gpus
        if j.spec.lo > topo.num_gpus:
            assert j.state is JobState.DROPPED
    s = summarize(r)
    assert s["finished"] + s["dropped"] == len(jobs)
    assert 0.0 <= s["utilization"] <= 1.0 + 1e-9
    assert 0.0 <= s["cluster_efficiency"] <= s["utilization"] + 1e-9 or policy == "edf"
    # same input, same result
    again = simulate(jobs, topo, get_policy(policy), overheads=OverheadModel(mode=mode), slot=slot)
    assert [(j.spec.job_id, j.end_time, j.rescales) for j in again.jobs] == [
        (j.spec.job_id, j.end_time, j.rescales) for j in r.jobs
    ]
