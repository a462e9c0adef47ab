"""Node labels place nodes in the scheduler's topology: agents register
``switch=NAME`` and the live snapshot groups nodes under their switches, so
the policies' topology-aware placement sees the real tree."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tidal.control.db import Store
from tidal.control.server import create_app
from tidal.control.snapshot import build_snapshot
from tidal.core.overhead import OverheadModel

H = {"Authorization": "Bearer tok"}


def _cluster(tmp_path, labels):
    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    client = TestClient(create_app(store, admin_token="tok", home=tmp_path, start_loop=False))
    for i, lab in enumerate(labels):
        r = client.post("/internal/agents/register", headers=H,
                        json={"name": f"n{i}", "num_gpus": 2, "virtual": True, "labels": lab})
        assert r.status_code == 200, r.text
    return store, client


def _typed(tmp_path, nodes):
    """A store with agents (name, GPUs, GPU type) registered through the API."""
    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    client = TestClient(create_app(store, admin_token="tok", home=tmp_path, start_loop=False))
    for name, gpus, gtype in nodes:
        r = client.post("/internal/agents/register", headers=H, json={
            "name": name, "num_gpus": gpus, "virtual": True, "labels": {"gpu-type": gtype}})
        assert r.status_code == 200, r.text
    return store


def test_switch_labels_group_nodes_under_their_switch(tmp_path):
    store, client = _cluster(tmp_path, [{"switch": "a"}, {"switch": "b"}, {"switch": "a"}, {"switch": "b"}])
    with store.session() as s:
        snap, gmap, _ = build_snapshot(s, 0.0, OverheadModel())
    c = snap.cluster
    assert (c.num_switches, c.nodes_per_switch, c.gpus_per_node) == (2, 2, 2)
    # policy GPUs 0-3 are under switch a (nodes n0, n2), 4-7 under switch b (n1, n3)
    assert list(gmap.to_gid) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert all(c.switch_of(i) == (0 if i < 4 else 1) for i in range(8))
    nodes = {n["name"]: n["labels"] for n in client.get("/v1/cluster", headers=H).json()["nodes"]}
    assert nodes["n1"] == {"switch": "b"}


def test_unequal_switches_are_kept_as_they_are(tmp_path):
    store, _ = _cluster(tmp_path, [{"switch": "a"}, {"switch": "a"}, {"switch": "b"}])
    with store.session() as s:
        snap, gmap, _ = build_snapshot(s, 0.0, OverheadModel())
    c = snap.cluster
    assert c.switch_nodes == {0: (0, 1), 1: (2,)} and list(gmap.to_gid) == [0, 1, 2, 3, 4, 5]


def test_nodes_of_different_sizes_keep_every_gpu(tmp_path):
    """Agents of 4 and 2 GPUs: the policy sees 6 GPUs (not 2 per node), and
    a 2-GPU job fits beside a 4-GPU one."""
    store = _typed(tmp_path, (("big", 4, "A100"), ("small", 2, "T4")))
    with store.session() as s:
        snap, gmap, _ = build_snapshot(s, 0.0, OverheadModel())
    c = snap.cluster
    assert c.num_gpus == 6 and [n.gpus for n in c.nodes] == [4, 2] and len(gmap.to_gid) == 6
    assert [n.gpu_type for n in c.nodes] == ["A100", "T4"]
    from tidal.scheduler.placement import place_consolidated

    placed = place_consolidated(snap, {"four": 4, "two": 2})
    assert sorted(placed["four"]) == [0, 1, 2, 3] and sorted(placed["two"]) == [4, 5]


def test_bad_labels_are_refused_with_the_reason(tmp_path):
    store, client = _cluster(tmp_path, [])
    r = client.post("/internal/agents/register", headers=H,
                    json={"name": "x", "num_gpus": 2, "labels": {"": "a"}})
    assert r.status_code == 422 and "keys take 1-63 characters" in r.text


def test_a_node_that_is_down_is_away_and_its_type_keeps_a_job_waiting(tmp_path):
    """The A100 node is down: the policy gets the T4 node only, the A100 node
    as ``away``, and a job asking for A100s is not dropped (it waits)."""
    from sqlalchemy import update

    from tidal.control.db import Node
    from tidal.core.job import JobSpec, JobState
    from tidal.scheduler.api import JobView, Plan
    from tidal.scheduler.constraints import enforce_types

    store = _typed(tmp_path, (("a100", 4, "A100"), ("t4", 2, "T4")))
    with store.session() as s:
        s.execute(update(Node).where(Node.name == "a100").values(state="down"))
        s.commit()
        snap, _, _ = build_snapshot(s, 0.0, OverheadModel())
    assert [n.gpu_type for n in snap.cluster.nodes] == ["T4"]
    assert [(n.gpus, n.gpu_type) for n in snap.away] == [(4, "A100")]
    spec = JobSpec("j", 0.0, "resnet50", 64, 100, requested_gpus=2, gpu_types=("A100",))
    snap = snap.__class__(now=0.0, cluster=snap.cluster, jobs=(JobView(spec, JobState.SUBMITTED),),
                          profiles=snap.profiles, away=snap.away)
    plan = enforce_types(snap, Plan(admit={"j"}, allocation={"j": 2}, placement={"j": (0, 1)}))
    assert "j" not in plan.drop and "j" not in plan.placement
    assert plan.waiting["j"].startswith("waits for 2 free GPUs of type A100: the cluster's nodes")
