"""The Ray engine: the node source's logic alone, then a real local Ray
cluster (a head without GPUs and two nodes with two each, all on loopback)
running an elastic job on the four GPUs; one Ray node is removed mid-run and
the job completes on the other, every sample exactly once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tidal.engines.ray import NodeRetired, NodeTable, RayAgent, node_gpus, node_name, plan

HERE = Path(__file__).resolve().parents[1]


def test_plan_starts_new_alive_nodes_and_stops_dead_or_gone_ones():
    nodes = [{"NodeID": "aaaa1111", "Alive": True, "Resources": {"GPU": 2.0}},
             {"NodeID": "bbbb2222", "Alive": False, "Resources": {"GPU": 2.0}},
             {"NodeID": "cccc3333", "Alive": True, "Resources": {"CPU": 1.0}}]
    start, stop = plan({"bbbb2222", "dddd4444", "cccc3333"}, nodes)
    assert set(start) == {"aaaa1111"} and stop == {"bbbb2222", "dddd4444", "cccc3333"}  # no GPU: no Tidal node
    assert node_gpus(start["aaaa1111"]) == 2 and node_gpus(nodes[2]) == 0
    assert plan(set(), []) == ({}, set())
    assert node_name("0123456789abcdef") == "ray-01234567"


def _node(node_id: str, alive: bool = True) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"GPU": 2.0}}


def test_a_node_marked_down_stays_down_until_ray_lists_a_new_node_id():
    """Ray's node table faked: a node whose agent went silent (its heartbeat
    stuck on a dead node's actors while Ray still lists it alive) is retired
    for good, never beats or starts again under that id; a node Ray lists
    dead stops beating at once; a node back under a new id is a new node."""
    ray_nodes = [_node("aaaa1111")]
    table = NodeTable(lambda: ray_nodes, retire_silent_s=8.0)
    table.refresh()
    start, stop = table.plan(set())
    assert set(start) == {"aaaa1111"} and stop == {}
    assert table.may_beat("aaaa1111", silent_s=1.0)
    assert not table.may_beat("aaaa1111", silent_s=8.5)  # the server has marked it down by now
    assert not table.may_beat("aaaa1111", silent_s=0.1)  # ... and it does not come back up
    table.refresh()  # Ray still lists it alive: it stays retired
    assert table.plan({"aaaa1111"}) == ({}, {"aaaa1111": table.retired["aaaa1111"]})
    assert table.plan(set()) == ({}, {})
    ray_nodes[:] = [_node("aaaa1111", alive=False), _node("bbbb2222")]  # Ray: dead, and back under a new id
    table.refresh()
    start, stop = table.plan(set())
    assert set(start) == {"bbbb2222"} and stop == {}
    assert table.may_beat("bbbb2222", silent_s=0.5)
    ray_nodes[:] = [_node("bbbb2222", alive=False)]
    table.refresh()
    assert not table.ray_alive("bbbb2222")
    assert not table.may_beat("bbbb2222", silent_s=0.1)  # Ray says dead: no beat, however recent the last
    assert table.plan({"bbbb2222"})[1].keys() == {"bbbb2222"}


def test_a_ray_agent_sends_no_heartbeat_once_its_node_is_retired(tmp_path, monkeypatch):
    """The agent's transport: heartbeats pass while the table allows them,
    the silence counts from the last one the server took, and a retired
    node's agent stops instead of beating (registration is not gated)."""
    from tidal.agent.agent import Agent

    sent: list[str] = []
    monkeypatch.setattr(Agent, "_post", lambda self, path, body: sent.append(path) or {})
    ray_nodes = [_node("cccc3333")]
    table = NodeTable(lambda: ray_nodes, retire_silent_s=8.0)
    table.refresh()
    agent = RayAgent("cccc3333", table, "http://127.0.0.1:9", "join", "ray-cccc3333", 2, virtual=True,
                     workdir=tmp_path / "agent", address="127.0.0.1")
    agent._post("/internal/agents/register", {})
    agent._post("/internal/agents/ray-cccc3333/heartbeat", {})
    assert sent == ["/internal/agents/register", "/internal/agents/ray-cccc3333/heartbeat"]
    agent.heard_at -= 9.0  # its tick was stuck for 9 s on the actors of a dead node
    with pytest.raises(NodeRetired):
        agent._post("/internal/agents/ray-cccc3333/heartbeat", {})
    assert len(sent) == 2 and agent._stop.is_set()
    assert "silent" in table.retired["cccc3333"]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_job_on_ray_nodes_survives_a_ray_node_death(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keeps every Ray component on loopback
    # the job's processes get the agents' environment: one machine, one disk, so checkpoints are shared
    monkeypatch.setenv("TIDAL_CHECKPOINT_SHARED", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ray = pytest.importorskip("ray", reason="the Ray engine needs ray (pip install 'tidal[ray]')")
    from ray.cluster_utils import Cluster

    import sys
    sys.path.insert(0, str(HERE / "control"))
    from test_e2e import check_exactly_once, job, replay_gpu_holders, wait  # noqa: E402

    from tidal.control.local import LocalCluster
    from tidal.engines.ray import RayEngine

    rc = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
    engine = server = None
    try:
        gpu_nodes = [rc.add_node(num_cpus=1, num_gpus=2) for _ in range(2)]
        rc.wait_for_nodes()
        ray.init(address=rc.address, include_dashboard=False)
        server = LocalCluster(tmp_path / "home", policy="edf", tick_s=1.0)
        server.start_server()
        join = (server.home / "agent.token").read_text().strip()
        engine = RayEngine(server.url, join, ray_address=rc.address, interval_s=0.3, poll_s=0.5,
                           workdir=tmp_path / "agents")
        engine.start()
        admin = server.api()
        wait(lambda: len([n for n in admin.cluster()["nodes"] if n["state"] == "up"]) == 2, 60,
             "the two Ray GPU nodes to register")
        user = server.api(admin.add_user("alice"))
        rec = tmp_path / "records"
        a = user.submit(job("a", rec, samples=2048, epochs=3, gpus="1-4", deadline=3600))["id"]
        wait(lambda: len(user.job(a)["gpus"]) == 4 and user.job(a)["step"] > 5, 180, "the job to train on 4 GPUs",
             user)
        # every GPU worker runs in an actor on its Ray node, with the device Ray gave that actor
        seen: dict[str, list[str]] = {}
        for node_id, (agent, _) in engine.agents.items():
            for p in agent.procs.values():
                if p.kind != "master" and p.handle.pid:
                    seen.setdefault(node_id, []).append(_environ(p.handle.pid).get("CUDA_VISIBLE_DEVICES", ""))
        (tmp_path / "cuda_visible_devices.txt").write_text(repr(seen))
        assert sum(len(v) for v in seen.values()) == 4, seen
        assert all(sorted(v) == ["0", "1"] for v in seen.values()), seen
        victim = gpu_nodes[0]
        victim_name = node_name(victim.node_id)
        doomed = [p.handle.pid for p in engine.agents[victim.node_id][0].procs.values() if p.handle.pid]
        rc.remove_node(victim)
        wait(lambda: any(n["name"] == victim_name and n["state"] != "up" for n in admin.cluster()["nodes"]), 60,
             "Tidal to mark the dead Ray node down")
        since = max(e["id"] for e in admin.events())
        wait(lambda: user.job(a)["state"] in ("completed", "failed", "cancelled"), 300, "the job to finish", user)
        assert user.job(a)["state"] == "completed", user.job(a)
        assert not any(Path(f"/proc/{pid}").exists() for pid in doomed), "a process outlived its Ray node"
        # the dead node stayed out: no heartbeat brought it back up, no process started on it since
        later = [e for e in admin.events() if e["id"] > since and e.get("node") == victim_name]
        assert not [e for e in later if e["kind"] in ("node.up", "node.rejoin", "proc.running")], later
        marks = [e["kind"] for e in admin.events() if e.get("node") == victim_name
                 and e["kind"] in ("node.unreachable", "node.down", "node.up", "node.rejoin")]
        assert marks and marks[0] in ("node.unreachable", "node.down"), marks
        assert "node.up" not in marks and "node.rejoin" not in marks, marks  # no down, up, down again
        replay_gpu_holders(admin.events())
        check_exactly_once(rec / "a", 2048, 3)
    finally:
        if engine is not None:
            engine.stop()
            time.sleep(1)
        if server is not None:
            server.stop_server()
        ray.shutdown()
        rc.shutdown()
