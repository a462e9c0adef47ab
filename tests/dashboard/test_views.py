"""The dashboard's JSON views and stream without a browser: the tokens the
public API takes, a tenant's view of the scheduler's decisions, what the job
page says about a rescale, and the stream's first event over real HTTP."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from tidal.control.dashboard.jobpage import change_reason, segments
from tidal.control.local import free_port
from tidal.control.promstats import DecisionLog

from dash_helpers import hdr  # noqa: E402
from tidal.control.snapshot import build_snapshot
from tidal.scheduler.api import Plan


@pytest.fixture
def env(tenants):
    return tenants


def test_data_needs_a_tenant_or_admin_token(env):
    client, app, a, _ = env
    assert client.get("/dashboard/").status_code == 200  # the page itself holds no data
    assert client.get("/dashboard/static/../server.py").status_code == 404
    for path in ("/dashboard/api/me", "/dashboard/api/overview", f"/dashboard/api/jobs/{a}", "/dashboard/api/stream"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers=hdr("wrong")).status_code == 401, path
        agent = app.state.credentials.agent_token()
        assert client.get(path, headers=hdr(agent)).status_code == 403, path
    csp = client.get("/dashboard/").headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp


def test_a_tenant_sees_its_own_jobs_and_only_their_ids_in_decisions(env):
    client, app, a, b = env
    ov = client.get("/dashboard/api/overview", headers=hdr("bob-tok")).json()
    assert [j["id"] for j in ov["jobs"]] == [b]
    gpus = [g for n in ov["nodes"] for g in n["gpus"]]
    assert {g["job"] for g in gpus} == {b, "busy"}  # alice's GPUs: busy, not whose
    assert client.get(f"/dashboard/api/jobs/{a}", headers=hdr("bob-tok")).status_code == 404
    assert client.get(f"/dashboard/api/jobs/{a}", headers=hdr("admin-tok")).json()["actions"] == \
        {"scale": True, "cancel": True}
    log = DecisionLog(size=3)
    app.state.decisions, app.state.decisions_recorded = log, True
    with app.state.store.session(write=False) as s:  # the snapshot a round plans from
        sn, _, _ = build_snapshot(s, time.time(), app.state.coordinator.overheads)
    for k in range(5):
        log.record("edf", sn, Plan(admit={a, b}, drop={}, allocation={a: 2, b: 1}), 0.001 * (k + 1))
    sched = client.get("/dashboard/api/overview", headers=hdr("bob-tok")).json()["scheduler"]
    assert sched["recorded"] and len(sched["decisions"]) == 3  # bounded, newest first
    assert sched["decisions"][0]["latency_s"] == pytest.approx(0.005)
    d = sched["decisions"][0]
    assert d["admit"] == [b] and set(d["allocation"]) == {b} and d["other_jobs"] == 1
    assert a not in json.dumps(sched)
    full = client.get("/dashboard/api/overview", headers=hdr("admin-tok")).json()["scheduler"]["decisions"][0]
    assert set(full["allocation"]) == {a, b}


def test_a_rescale_says_its_reason():
    events = [{"time": 10.0, "kind": "job.pinned", "gpus": 1, "by": "alice"},
              {"time": 11.0, "kind": "job.scale_in", "size_from": 2, "size_to": 1},
              {"time": 30.0, "kind": "job.worker_lost", "worker": "w3", "exit_code": -9}]
    pinned = {"kind": "scale_in", "from_size": 2, "to_size": 1, "switched_at": 12.0}
    assert change_reason(pinned, events, 0.0, "edf") == "pinned at 1 GPUs by alice"
    planned = {"kind": "scale_out", "from_size": 1, "to_size": 3, "switched_at": 20.0}
    assert change_reason(planned, events, 12.0, "edf") == "the edf plan: 1 → 3 GPUs"
    lost = {"kind": "recover", "from_size": 3, "to_size": 2, "switched_at": 29.0}
    assert change_reason(lost, events, 20.0, "edf") == "w3 lost (job.worker_lost, exit code -9)"
    # 10 steps of 64 samples in 10 s, then 30 steps in 10 s
    assert segments([{"switched_at": 10.0, "switch_step": 10}], 0.0, 20.0, 40, 64) == [[0.0, 10.0, 64.0],
                                                                                      [10.0, 20.0, 192.0]]


def test_the_stream_sends_the_job_page_as_json(env, tmp_path):
    _, app, a, _ = env
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        deadline = time.time() + 10
        while not server.started and time.time() < deadline:
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", f"/dashboard/api/stream?job={a}", headers=hdr("alice-tok"))
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
        line = r.readline().decode()
        assert line.startswith("data: ")
        snap = json.loads(line[len("data: "):])
        assert snap["job"]["id"] == a and snap["job"]["actions"]["cancel"] is True
        assert [j["id"] for j in snap["jobs"]] == [a] and snap["me"]["name"] == "alice"
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/dashboard/api/stream?job=../../etc", headers=hdr("alice-tok"))
        assert conn.getresponse().status == 422
        conn.close()
    finally:
        server.should_exit = True
        t.join(timeout=10)


def test_the_coordinator_records_its_decisions(env):
    """Each scheduling round's plan and latency reach the scheduler view."""
    client, app, a, b = env
    assert app.state.decisions_recorded
    app.state.coordinator.round()
    d = client.get("/dashboard/api/overview", headers=hdr("admin-tok")).json()["scheduler"]["decisions"]
    assert d and d[0]["policy"] == "edf" and d[0]["latency_s"] > 0 and d[0]["jobs"] == 2
