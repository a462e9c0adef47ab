"""kill -9 of a node agent, then a restart: the new agent adopts the
processes the old one launched (its process table is on disk) instead of
launching them a second time, stops those the server gave up meanwhile, and
reports those that ended while it was away. The server finds a dead agent
on any cluster size (the coordinator judges silent nodes too).

Fast tests of the table and the adoption rule first, then the fault on a
live cluster (server + 2 agents x 2 virtual GPUs, one real elastic job on
all 4 GPUs), where no process row and no OS process may ever be
duplicated, no job may fail, every sample is used exactly once and no GPU
is held twice."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from tidal import settings
from tidal.agent.agent import Agent
from tidal.agent.proctable import EXIT_UNKNOWN, Adopted, Child, Proc, ProcTable, start_time
from tidal.control.api import internal
from tidal.control.db import Node, Process, Store
from tidal.control.local import LocalCluster
from tidal.control.server import create_app
from test_e2e import check_exactly_once, job, job_on_4_gpus, procs, replay_gpu_holders, wait

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"]


def _row(i: int, kind: str = "worker", desired: str = "run") -> dict:
    return {"id": i, "job": "j", "name": "master" if kind == "master" else f"w{i}", "kind": kind,
            "argv": SLEEPER, "env": {}, "desired": desired, "gated": False}


def _agent(workdir: Path) -> Agent:
    """An agent that never reaches a server (the tests drive its steps)."""
    return Agent("http://127.0.0.1:9", "t", "n0", 2, virtual=True, workdir=workdir, address="127.0.0.1")


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while start_time(pid) is not None:
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(autouse=True)
def _node_down_after_10_s(monkeypatch):
    """These scenarios are about a node declared down: 10 s of silence, not
    the default grace period (an agent back within it keeps its jobs)."""
    monkeypatch.setenv("TIDAL_NODE_GRACE_S", "10")


@pytest.fixture
def sleeper():
    p = subprocess.Popen(SLEEPER, stdout=subprocess.DEVNULL, start_new_session=True)
    yield p
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def test_the_table_adopts_the_same_process_only(tmp_path, sleeper):
    """Adopted: same boot, same pid, same start time. A recycled pid (same
    pid, another start time), another boot or a dead process is not ours:
    its handle reports it gone with an unknown exit code."""
    proc = Proc(3, "j", "w0", "worker", Child(sleeper), tmp_path / "w0.log", offset=12, gpu="1", restarts=2)
    path = tmp_path / "procs.json"
    ProcTable(path).save({3: proc}, {5: {"id": 5, "state": "exited", "pid": 9, "exit_code": 0, "log": ""}})
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    procs, finished = ProcTable(path).load()
    p = procs[3]
    assert isinstance(p.handle, Adopted) and p.handle.pid == sleeper.pid and p.handle.poll() is None
    assert (p.job, p.name, p.offset, p.gpu, p.restarts) == ("j", "w0", 12, "1", 2)
    assert finished == {5: {"id": 5, "state": "exited", "pid": 9, "exit_code": 0, "log": ""}}

    doc = json.loads(path.read_text())
    recycled = {**doc, "procs": [{**doc["procs"][0], "start_time": doc["procs"][0]["start_time"] - 1}]}
    path.write_text(json.dumps(recycled))
    assert ProcTable(path).load()[0][3].handle.poll() == EXIT_UNKNOWN
    path.write_text(json.dumps({**doc, "boot_id": "another-boot"}))
    assert ProcTable(path).load()[0][3].handle.poll() == EXIT_UNKNOWN

    path.write_text(json.dumps(doc))
    adopted = ProcTable(path).load()[0][3].handle
    adopted.kill()  # the process group, while it is the same process
    assert _gone(sleeper.pid) and adopted.poll() == EXIT_UNKNOWN
    sleeper.wait()
    path.write_text("{not json")
    assert ProcTable(path).load() == ({}, {})


def test_a_restarted_agent_adopts_reports_and_stops_without_launching_twice(tmp_path):
    """Agent 1 launches a worker and a master and "dies" (no shutdown); the
    master dies too while nobody watches. Agent 2 on the same work directory
    adopts the worker (same pid, log shipped from the saved offset, never a
    second launch), reports the master failed with exit code None once, and
    neither restarts nor relaunches it; a stop for the worker stops the
    adopted process. Agent 3 reports that unacknowledged exit again and
    launches nothing."""
    a1 = _agent(tmp_path)
    worker, master = _row(7), _row(8, "master")
    a1._reconcile([worker, master])
    pids = {i: a1.procs[i].handle.pid for i in (7, 8)}
    wait(lambda: all("up" in a1.procs[i].log_path.read_text() for i in (7, 8)), 30, "the processes to start")
    assert {r["id"]: r["log"] for r in a1._collect()} == {7: "up\n", 8: "up\n"}
    a1._save()  # what a tick does after its heartbeat; then the agent is killed
    os.killpg(pids[8], signal.SIGKILL)
    assert _gone(pids[8])

    a2 = _agent(tmp_path)
    a2._reconcile([worker, master])
    assert {i: p.handle.pid for i, p in a2.procs.items()} == pids
    assert all(isinstance(p.handle, Adopted) for p in a2.procs.values())
    reports = {r["id"]: r for r in a2._collect()}
    assert reports[7]["state"] == "running" and reports[7]["log"] == ""  # shipped by agent 1 already
    assert (reports[8]["state"], reports[8]["exit_code"]) == ("failed", None)
    assert set(a2.procs) == {7}  # the master is not restarted from an unknown exit
    a2.finished.clear()
    a2.acked.add(8)  # the heartbeat delivered the exit
    a2._reconcile([worker, master])
    assert set(a2.procs) == {7} and [r["id"] for r in a2._collect()] == [7]
    a2._reconcile([{**worker, "desired": "stop"}])
    assert _gone(pids[7])
    reports = {r["id"]: r for r in a2._collect()}
    assert (reports[7]["state"], reports[7]["exit_code"]) == ("failed", None)
    a2._save()

    a3 = _agent(tmp_path)
    assert not a3.procs and set(a3.finished) == {7}
    a3._reconcile([worker])  # the server did not hear of its exit yet: still wanted
    assert not a3.procs
    assert [(r["id"], r["state"]) for r in a3._collect()] == [(7, "failed")]


def _hdr() -> dict[str, str]:
    return {"Authorization": "Bearer adm"}


def test_unknown_exits_are_judged_and_a_lone_dead_node_goes_down(tmp_path):
    """A worker that ended unseen is failed (its GPU can be freed); the
    job's current master is lost (the coordinator restarts it elsewhere or
    here), never relaunched as it was. And the coordinator's watch takes a
    one-node cluster's silent node down; a watch that itself stalled does
    not."""
    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    app = create_app(store, admin_token="adm", home=tmp_path, start_loop=False)
    client = TestClient(app)
    client.post("/internal/agents/register", json={"name": "n0", "num_gpus": 2, "virtual": True}, headers=_hdr())
    with store.session() as s:
        rows = [Process(job_id="j", name="master", kind="master", node="n0", state="running"),
                Process(job_id="j", name="w0", kind="worker", node="n0", gpu=0, state="running")]
        s.add_all(rows)
        s.flush()
        ids = [r.id for r in rows]
    reports = [{"id": i, "state": "failed", "pid": 1, "exit_code": None} for i in ids]
    r = client.post("/internal/agents/n0/heartbeat", json={"procs": reports}, headers=_hdr())
    assert r.status_code == 200
    with store.session() as s:
        got = {p.name: (p.state, p.desired, p.exit_code) for p in s.query(Process)}
    assert got == {"master": ("lost", "stop", None), "w0": ("failed", "run", None)}
    assert not r.json()["workers"] or all(w["desired"] == "stop" for w in r.json()["workers"])

    watch = internal.SilentNodeWatch()
    with store.session() as s:
        s.execute(update(Node).values(last_heartbeat=time.time() - 60))
    assert watch(store, watch.clock.last + internal.NODE_TIMEOUT_S) is False  # its own stall: clocks restart
    with store.session() as s:
        assert s.get(Node, "n0").state == "up"
        s.execute(update(Node).values(last_heartbeat=time.time() - 60))
    coord = app.state.coordinator
    coord.start()  # its watch timer judges the silent node, with no heartbeat anywhere
    try:
        wait(lambda: client.get("/v1/cluster", headers=_hdr()).json()["nodes"][0]["state"] == "down", 15,
             "the silent node to go down")
    finally:
        coord.stop()


# -- the fault on a live cluster ---------------------------------------------------------------
class ProcessCensus:
    """Counts, every half second, the live OS processes per (job, worker id
    or "master") the agents of ``home`` launched (session leaders with its
    ``$TIDAL_HOME``); remembers the most seen at once."""

    def __init__(self, home: Path) -> None:
        self.home, self.most = str(home), collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def leaders(self) -> list[tuple[tuple[str, str], int]]:
        """((job, worker id or "master"), pid) of every live one."""
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if fields[0] == "Z" or fields[3] != d.name or env.get(settings.HOME.name) != self.home:
                continue  # a zombie, not a session leader, or not this cluster's
            master_file = env.get(settings.MASTER_FILE.name)
            if master_file:
                out.append(((Path(master_file).stem, env.get(settings.WORKER_ID.name, "master")), int(d.name)))
        return out

    def count(self) -> collections.Counter:
        return collections.Counter(key for key, _pid in self.leaders())

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for key, n in self.count().items():
                self.most[key] = max(self.most[key], n)

    def __enter__(self) -> "ProcessCensus":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def _cluster(home: Path) -> Iterator[LocalCluster]:
    """The live cluster; whatever its agents launched is killed at the end,
    also when a test failed with an agent down."""
    try:
        with LocalCluster(home, nodes=2, gpus_per_node=2, policy="edf", tick_s=1.0) as c:
            yield c
    finally:
        for _key, pid in ProcessCensus(home).leaders():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass




def _finish(admin, user, a, census, rec, samples, epochs):
    wait(lambda: user.job(a)["state"] in ("completed", "failed"), 200, "A to finish", user)
    final = user.job(a)
    assert final["state"] == "completed", final
    names = [p["name"] for p in final["processes"]]
    assert len(names) == len(set(names)), f"a process row twice: {names}"
    assert census.most and max(census.most.values()) == 1, f"an OS process twice: {census.most}"
    replay_gpu_holders(admin.events())
    check_exactly_once(rec / "a", samples, epochs)


@pytest.mark.slow
def test_agent_killed_for_3s_adopts_its_master_and_workers(tmp_path):
    """kill -9 of the agent of the job master's node, back after 3 s (before
    the node time-out): the new agent adopts the master and both workers,
    the job trains on without a recovery, and nothing runs twice."""
    rec = tmp_path / "records"
    samples, epochs = 2048, 4
    with _cluster(tmp_path / "home") as c:
        admin, user, a = job_on_4_gpus(c, rec, samples, epochs)
        with ProcessCensus(c.home) as census:
            node = procs(user, a, kind="master")[0]["node"]
            before = {p["name"]: p["pid"] for p in procs(user, a, node=node)}
            assert len(before) == 3
            c.kill_agent(int(node[-1]))
            time.sleep(3)
            assert {p["name"]: p["pid"] for p in procs(user, a, node=node)} == before
            step = user.job(a)["step"]
            c.start_agent(int(node[-1]))
            wait(lambda: user.job(a)["step"] > step + 5, 60, "A to train on", user)
            assert {p["name"]: (p["pid"], p["state"]) for p in procs(user, a, node=node)} == \
                {n: (pid, "running") for n, pid in before.items()}
            assert all(n["state"] == "up" for n in admin.cluster()["nodes"])
            _finish(admin, user, a, census, rec, samples, epochs)
        final = user.job(a)
        assert not any(ch["kind"] == "recover" for ch in (final["progress"] or {}).get("changes", []))


@pytest.mark.slow  # ~75 s: CI's second step runs it
def test_agent_killed_for_15s_stops_what_the_server_gave_up(tmp_path):
    """kill -9 of a workers-only node's agent, back after 15 s: meanwhile
    the node is marked down and its workers lost. The returning agent adopts
    them, then stops them as the server wants (it never launches them
    again); the job re-forms, grows back and completes."""
    rec = tmp_path / "records"
    samples, epochs = 2048, 8
    with _cluster(tmp_path / "home") as c:
        admin, user, a = job_on_4_gpus(c, rec, samples, epochs)
        with ProcessCensus(c.home) as census:
            master_node = procs(user, a, kind="master")[0]["node"]
            node = "node-1" if master_node == "node-0" else "node-0"
            orphans = {p["name"]: p["pid"] for p in procs(user, a, node=node)}
            assert len(orphans) == 2
            c.kill_agent(int(node[-1]))
            killed = time.time()
            wait(lambda: {p["state"] for p in procs(user, a, node=node)} == {"lost"}, 30,
                 "the silent node's workers to be lost", user)
            assert any(n["name"] == node and n["state"] == "down" for n in admin.cluster()["nodes"])
            assert all(start_time(pid) is not None for pid in orphans.values())  # still running, unwatched
            time.sleep(max(0.0, killed + 15 - time.time()))
            c.start_agent(int(node[-1]))
            wait(lambda: all(start_time(pid) is None for pid in orphans.values()), 30,
                 "the returning agent to stop the lost workers", user)
            wait(lambda: {p["state"] for p in procs(user, a, node=node) if p["name"] in orphans} == {"failed"},
                 15, "their rows to be failed", user)
            _finish(admin, user, a, census, rec, samples, epochs)
        assert any(n["name"] == node and n["state"] == "up" for n in admin.cluster()["nodes"])
