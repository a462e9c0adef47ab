"""GPU-type constraints (a job's ``gpu_types`` / ``exclude_gpu_types``) in
every policy: on a mixed cluster no constrained job ever holds a GPU of a
type it does not allow, every job that can finish finishes, and a job whose
types the cluster lacks is dropped at admission with a reason."""

from __future__ import annotations

import pytest

from tidal.core.job import JobSpec, JobState
from tidal.core.topology import parse_cluster
from tidal.scheduler.api import Plan, Snapshot
from tidal.scheduler.registry import get_policy, policy_names
from tidal.sim.engine import simulate

CLUSTER = "2xT4:4,1xA100:8"  # GPUs 0-7 are T4, 8-15 A100
MODEL = "resnet50"


def _jobs() -> list[JobSpec]:
    def job(jid: str, t: float, n: int, **kw) -> JobSpec:
        return JobSpec(jid, t, MODEL, 64, kw.pop("iters", 1500), requested_gpus=n, **kw)

    return [
        job("big-any", 0.0, 8),
        job("a100-4", 0.0, 4, gpu_types=("A100",)),
        job("t4-elastic", 0.0, 4, gpu_types=("T4",), elastic=True, min_gpus=2, max_gpus=8),
        job("not-t4", 5.0, 2, exclude_gpu_types=("T4",)),
        job("any-4", 10.0, 4),
        job("a100-or-t4", 15.0, 2, gpu_types=("A100", "T4")),
        job("a100-8", 20.0, 8, gpu_types=("A100",), iters=500),
        job("v100", 0.0, 1, gpu_types=("V100",)),  # no such type in the cluster
        job("a100-12", 0.0, 12, gpu_types=("A100",)),  # more than the cluster's A100s
    ]


@pytest.mark.parametrize("policy", policy_names())
def test_no_policy_places_a_job_on_a_type_it_does_not_allow(policy: str) -> None:
    cluster = parse_cluster(CLUSTER)
    jobs = _jobs()
    specs = {j.job_id: j for j in jobs}
    pol = get_policy(policy)
    schedule = pol.schedule
    seen: list[str] = []

    def checked(snap: Snapshot) -> Plan:
        plan = schedule(snap)
        for jid, gpus in plan.placement.items():
            if plan.allocation.get(jid, 0) > 0:
                types = {cluster.gpu_type_of(g) for g in gpus}
                assert all(specs[jid].allows_type(t) for t in types), (snap.now, jid, gpus, types)
                seen.append(jid)
        return plan

    pol.schedule = checked  # type: ignore[method-assign]
    res = simulate(jobs, cluster, pol, slot=60.0)
    by_id = {j.spec.job_id: j for j in res.jobs}
    assert by_id["v100"].state is JobState.DROPPED
    assert "of type V100, the cluster has 0" in by_id["v100"].drop_reason
    assert by_id["a100-12"].state is JobState.DROPPED
    assert "needs 12 GPUs of type A100, the cluster has 8" in by_id["a100-12"].drop_reason
    unfinished = [j for j, s in by_id.items() if j not in ("v100", "a100-12") and s.state is not JobState.COMPLETED]
    assert not unfinished, [(j, by_id[j].state.value) for j in unfinished]
    assert {"a100-4", "t4-elastic", "not-t4", "a100-8"} <= set(seen)


@pytest.mark.parametrize("policy", policy_names())
def test_a_job_whose_type_is_only_on_a_node_that_is_down_waits_for_it(policy: str) -> None:
    """A live cluster's A100 node is down (``Snapshot.away``): a job asking
    for A100s is neither dropped nor placed on the T4s that are up; it waits
    with a reason. Without that node it is dropped, as before."""
    from tidal.core.profile import load_profiles
    from tidal.core.topology import Node
    from tidal.scheduler.api import JobView

    cluster = parse_cluster("2xT4:4")
    job = JobSpec("a100-2", 0.0, MODEL, 64, 1500, requested_gpus=2, gpu_types=("A100",))
    other = JobSpec("any-2", 0.0, MODEL, 64, 1500, requested_gpus=2)
    views = (JobView(job, JobState.SUBMITTED), JobView(other, JobState.SUBMITTED))
    for away in ((Node(8, "A100"),), ()):
        snap = Snapshot(now=0.0, cluster=cluster, jobs=views, profiles=load_profiles(), away=away)
        plan = get_policy(policy).schedule(snap)
        if away:
            assert "a100-2" not in plan.drop, plan.drop
            assert not plan.allocation.get("a100-2"), plan
            if "a100-2" in plan.waiting:
                assert "of type A100" in plan.waiting["a100-2"]
        else:
            assert "of type A100, the cluster has 0" in plan.drop.get("a100-2", ""), plan
