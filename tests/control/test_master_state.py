"""A job master's state kept by the server (so a master whose host died
restarts elsewhere from it), over real HTTP: the server's copy keeps the
newest document, refuses writes from a master on another node than the
job's current one, and the mirrored backend loads the newer of the local
and the server's copy. Also: the worker's master client follows a master to
a new address named by its locator, and the agent writes that address."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import uvicorn

from tidal.agent.agent import Agent
from tidal.control.db import Process, Store
from tidal.control.local import free_port
from tidal.control.masterstate import SEQ, Fenced, Mirrored, ServerBackend
from tidal.control.server import create_app
from tidal.httpjson import JsonHttp
from tidal.runtime.client import MasterClient, MasterUnavailable, url_file
from tidal.runtime.persistence import FileBackend

TOKEN = "admin-tok"


@pytest.fixture
def server(store_url, tmp_path):
    """The real app on a loopback port (its store SQLite or PostgreSQL), a
    job ``a`` whose master runs on n0."""
    store = Store(store_url)
    app = create_app(store, admin_token=TOKEN, home=tmp_path, start_loop=False)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    http = JsonHttp(f"http://127.0.0.1:{port}", token=TOKEN, patience_s=10)
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    for n in ("n0", "n1"):
        assert http.call("POST", "/internal/agents/register", {"name": n, "num_gpus": 2, "virtual": True})[0] == 200
    alice = store.add_user("alice", token="alice-tok")
    user = JsonHttp(http.url, token=alice)
    status, ans = user.call("POST", "/v1/jobs", {"name": "a", "script": "train.py", "gpus": "1-2",
                                                "iterations": 10})
    assert status == 201, ans
    job = ans["id"]
    with store.session() as s:
        s.add(Process(job_id=job, name="master", kind="master", node="n0", argv=[], env={}))
    yield http, store, job, port
    srv.should_exit = True
    t.join(timeout=10)


def test_the_servers_copy_keeps_the_newest_and_refuses_another_nodes_master(server):
    http, store, job, port = server
    n0 = ServerBackend(f"http://127.0.0.1:{port}", job, token=TOKEN, node="n0")
    assert n0.load() is None
    n0.save({"gen": 3, SEQ: 2})
    n0.save({"gen": 2, SEQ: 1})  # a late write of an older document
    assert n0.load() == {"gen": 3, SEQ: 2}
    with pytest.raises(Fenced, match="runs on n0"):
        ServerBackend(f"http://127.0.0.1:{port}", job, token=TOKEN, node="n1").save({"gen": 9, SEQ: 9})
    assert n0.load()["gen"] == 3
    # the old master's status reports are refused the same way; the current one's are taken
    assert http.call("POST", f"/internal/jobs/{job}/status", {"state": "running", "step": 7, "node": "n1"})[0] == 409
    assert http.call("POST", f"/internal/jobs/{job}/status", {"state": "running", "step": 7, "node": "n0"})[0] == 200
    assert http.call("GET", f"/internal/jobs/{job}/master-state", None)[0] == 200
    assert http.call("GET", "/internal/jobs/nope/master-state", None)[0] == 404
    assert http.call("POST", f"/internal/jobs/{job}/master-state", {"seq": -1, "doc": {}})[0] == 422
    assert JsonHttp(http.url, token="alice-tok").call("GET", f"/internal/jobs/{job}/master-state", None)[0] == 403


def test_the_mirrored_backend_loads_the_newer_copy_and_stops_when_fenced(server, tmp_path):
    http, store, job, port = server
    here = Mirrored(FileBackend(str(tmp_path / "n0" / "a.json")), ServerBackend(f"http://127.0.0.1:{port}", job,
                                                                                 token=TOKEN, node="n0"))
    for gen in range(1, 6):
        here.save({"gen": gen})
    assert here.flush(10)
    here.close()
    # another host (no local file): the server's copy, and the sequence goes on from it
    there = Mirrored(FileBackend(str(tmp_path / "n1" / "a.json")), ServerBackend(f"http://127.0.0.1:{port}", job,
                                                                                  token=TOKEN, node="n0"))
    assert there.load() == {"gen": 5, SEQ: 5}
    there.save({"gen": 6})
    assert there.flush(10)
    # the first host's file is older now: the server's copy wins there too
    again = Mirrored(FileBackend(str(tmp_path / "n0" / "a.json")), ServerBackend(f"http://127.0.0.1:{port}", job,
                                                                                  token=TOKEN, node="n0"))
    assert again.load()["gen"] == 6
    there.close()
    again.close()
    fenced = Mirrored(FileBackend(str(tmp_path / "n1" / "b.json")), ServerBackend(f"http://127.0.0.1:{port}", job,
                                                                                   token=TOKEN, node="n1"))
    fenced.save({"gen": 99})
    assert fenced.fenced.wait(10)
    fenced.close()
    assert ServerBackend(f"http://127.0.0.1:{port}", job, token=TOKEN).load()["gen"] == 6


def test_the_heartbeat_tells_agents_where_each_jobs_master_is(server, tmp_path):
    http, store, job, port = server
    assert http.call("POST", f"/internal/jobs/{job}/master", {"url": "http://10.0.0.2:5000", "node": "n0"})[0] == 200
    with store.session() as s:
        s.add(Process(job_id=job, name="w0", kind="worker", node="n1", argv=["true"], env={}))
    status, ans = http.call("POST", "/internal/agents/n1/heartbeat", {"procs": []})
    assert status == 200 and ans["masters"] == {job: "http://10.0.0.2:5000"}
    agent = Agent(http.url, TOKEN, "n1", 2, virtual=True, workdir=tmp_path / "agent")
    agent._write_master_urls(ans["masters"])
    path = tmp_path / "agent" / "masters" / f"{job}.url"
    assert path.read_text() == "http://10.0.0.2:5000"
    assert url_file(path)() == "http://10.0.0.2:5000" and url_file(tmp_path / "none")() is None


def test_a_master_client_follows_its_locator_to_the_masters_new_address(tmp_path):
    from tidal.runtime import JobMaster, MasterServer

    master = JobMaster("j", 1)
    srv = MasterServer(master, host="127.0.0.1", port=0).start()
    try:
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the old master's host
        where = Path(tmp_path / "master.url")
        client = MasterClient(dead, patience_s=20, locate=url_file(where))
        threading.Timer(0.5, lambda: where.write_text(srv.url)).start()
        assert client.status().job == "j"
        assert client.url == srv.url
        with pytest.raises(MasterUnavailable):
            MasterClient(dead, patience_s=1.0).status()  # no locator: the patience runs out
    finally:
        srv.stop()
