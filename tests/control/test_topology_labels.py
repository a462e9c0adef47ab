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


def test_unequal_or_missing_switches_schedule_as_one_switch(tmp_path):
    store, _ = _cluster(tmp_path, [{"switch": "a"}, {"switch": "a"}, {"switch": "b"}])
    with store.session() as s:
        snap, gmap, _ = build_snapshot(s, 0.0, OverheadModel())
    assert snap.cluster.num_switches == 1 and list(gmap.to_gid) == [0, 1, 2, 3, 4, 5]


def test_bad_labels_are_refused_with_the_reason(tmp_path):
    store, client = _cluster(tmp_path, [])
    r = client.post("/internal/agents/register", headers=H,
                    json={"name": "x", "num_gpus": 2, "labels": {"": "a"}})
    assert r.status_code == 422 and "keys take 1-63 characters" in r.text
