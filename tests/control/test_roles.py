"""Roles, shaped as the attacks that found the holes: a tenant's job reads
its environment (it used to hold the admin token), a tenant or a job's
credential calls what it must not, a node's credential acts for another
node. The FastAPI app runs in-process on a temporary store."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from tidal import settings
from tidal.control.credentials import Credentials
from tidal.control.db import Process, Store
from tidal.control.server import create_app


def H(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def env(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    creds = Credentials()
    app = create_app(store, admin_token="admin-tok", credentials=creds, home=tmp_path, start_loop=False)
    c = TestClient(app)
    alice, bob = store.add_user("alice", token="alice-tok"), store.add_user("bob", token="bob-tok")
    r = c.post("/internal/agents/register", headers=H(creds.agent_token()), json={"name": "n0", "num_gpus": 4})
    assert r.status_code == 200
    node_token = r.json()["token"]
    jobs = {}
    for who, tok in (("alice", alice), ("bob", bob)):
        r = c.post("/v1/jobs", headers=H(tok), json={"name": who, "script": "train.py", "gpus": "2",
                                                    "iterations": 10})
        assert r.status_code == 201, r.text
        jobs[who] = r.json()["id"]
    coord = app.state.coordinator
    for _ in range(3):
        coord.round()  # starts the jobs: their masters' process rows
    return c, store, creds, node_token, jobs, alice


def test_no_job_process_gets_the_admin_token_only_its_own_jobs_credential(env):
    c, store, creds, node_token, jobs, _ = env
    with store.session() as s:
        rows = list(s.scalars(select(Process)))
    assert rows and all("admin-tok" not in str(p.env) and settings.JOB_TOKEN.name not in (p.env or {})
                        for p in rows)  # nothing secret stored with the rows
    r = c.post("/internal/agents/n0/heartbeat", headers=H(node_token), json={"procs": []})
    assert r.status_code == 200
    for w in r.json()["workers"]:
        assert "admin-tok" not in str(w["env"]) and creds.agent_token() not in str(w["env"])
        assert w["env"][settings.JOB_TOKEN.name] == creds.job_token(w["job"])


def test_a_jobs_credential_acts_on_its_job_only(env):
    c, _, creds, _, jobs, _ = env
    mine, other = creds.job_token(jobs["alice"]), jobs["bob"]
    ok = c.post(f"/internal/jobs/{jobs['alice']}/status", headers=H(mine), json={"state": "running", "step": 1})
    assert ok.status_code == 200
    for method, path in [("post", f"/internal/jobs/{other}/status"), ("post", f"/internal/jobs/{other}/kill"),
                         ("get", f"/internal/jobs/{other}/master-state"), ("post", f"/internal/jobs/{other}/master")]:
        r = getattr(c, method)(path, headers=H(mine), **({"json": {}} if method == "post" else {}))
        assert r.status_code == 403, (path, r.status_code)
    for path in ("/v1/jobs", f"/v1/jobs/{jobs['alice']}", "/v1/events", "/v1/cluster"):
        assert c.get(path, headers=H(mine)).status_code == 403, path  # not a user: no public API
    assert c.post("/internal/agents/n0/heartbeat", headers=H(mine), json={"procs": []}).status_code == 403
    assert c.post("/internal/agents/register", headers=H(mine), json={"name": "evil", "num_gpus": 1}).status_code == 403


def test_tenants_nodes_and_the_join_token_stay_in_their_lanes(env):
    c, _, creds, node_token, jobs, alice = env
    # a tenant: no internal route, another tenant's job is a 404
    assert c.post("/internal/agents/register", headers=H(alice), json={"name": "x", "num_gpus": 1}).status_code == 403
    assert c.post(f"/internal/jobs/{jobs['alice']}/status", headers=H(alice), json={}).status_code == 403
    assert c.get(f"/v1/jobs/{jobs['bob']}", headers=H(alice)).status_code == 404
    # the join token registers nodes, nothing else
    join = creds.agent_token()
    assert c.post("/internal/agents/n0/heartbeat", headers=H(join), json={"procs": []}).status_code == 403
    assert c.get("/v1/jobs", headers=H(join)).status_code == 403
    # a node's credential: its own heartbeats only
    c.post("/internal/agents/register", headers=H(join), json={"name": "n1", "num_gpus": 4})
    assert c.post("/internal/agents/n1/heartbeat", headers=H(node_token), json={"procs": []}).status_code == 403
    assert c.post("/internal/agents/n0/heartbeat", headers=H(node_token), json={"procs": []}).status_code == 200
    # credentials of another server (another secret) or forged ones are unknown
    assert c.get("/v1/jobs", headers=H(Credentials().job_token(jobs["alice"]))).status_code == 401
    forged = creds.job_token(jobs["alice"])[:-4] + "0000"
    assert c.post(f"/internal/jobs/{jobs['alice']}/status", headers=H(forged), json={}).status_code == 401
