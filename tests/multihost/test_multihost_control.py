"""The control plane across hosts: network namespaces stand in for hosts
(tests/multihost/netns.py). The server runs on host 0 (``--host 0.0.0.0``),
one agent with 2 virtual GPUs on each of hosts 1-3; the test's API client
enters host 0's namespace. A job on 4 GPUs spans two hosts, its master runs
on one of them and is reached at that host's address.

Then: the other host of the job dies (every process in it is killed); the
server marks the node down and its processes lost, the job goes on without
it. The server is restarted on its host; the agents on the other hosts
reconnect. The job completes, every sample was used exactly once per epoch
and the audit trail never shows a GPU held by two jobs."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

CONTROL = Path(__file__).resolve().parents[1] / "control"
if str(CONTROL) not in sys.path:
    sys.path.insert(0, str(CONTROL))

from test_e2e import check_exactly_once, job, procs, replay_gpu_holders, wait  # noqa: E402

from tidal.control.client import Api  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PORT = 28470


def _env(home: Path, grace: str = "10") -> dict[str, str]:
    e = dict(os.environ)
    for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TIDAL_BIND_ADDR", "TIDAL_ADVERTISE_ADDR", "TIDAL_SERVER"):
        e.pop(k, None)  # each process finds its own interface and address
    # the namespaces share this machine's disk: the job's checkpoint directory is shared storage for them
    e.update(OMP_NUM_THREADS="1", TIDAL_HOME=str(home), PYTHONUNBUFFERED="1", TIDAL_CHECKPOINT_SHARED="1")
    # most scenarios are about a host declared down: after 10 s of silence, not the default grace
    e["TIDAL_NODE_GRACE_S"] = grace
    e["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), e.get("PYTHONPATH", "")])
    return e


def _tidal(h: Any, args: list[str], home: Path, log: str, grace: str = "10") -> subprocess.Popen[bytes]:
    out = open(home / f"{log}.log", "ab")
    return h.popen([sys.executable, "-m", "tidal", *args], env=_env(home, grace), stdout=out,
                   stderr=subprocess.STDOUT)



SERVER_ARGS = ["server", "--host", "0.0.0.0", "--port", str(PORT), "--policy", "edf", "--tick", "1"]


def _control_plane(hs: Any, agents: int, home: Path,
                   grace: str = "10") -> tuple[subprocess.Popen[bytes], str, str]:
    """The server on host 0 and an agent with 2 virtual GPUs on hosts 1..agents:
    the server's process, its URL and the admin token."""
    home.mkdir()
    token = secrets.token_urlsafe(16)
    server = _tidal(hs[0], [*SERVER_ARGS, "--token", token], home, "server", grace)
    url = f"http://{hs[0].addr}:{PORT}"
    for i in range(1, agents + 1):
        _tidal(hs[i], ["agent", "--server", url, "--token", token, "--name", f"node-{i}", "--virtual-gpus", "2",
                       "--interval", "0.3"], home, f"agent-{i}", grace)
    return server, url, token


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_spans_hosts_survives_losing_one_and_a_server_restart(hosts: Any, tmp_path: Path) -> None:
    hs = hosts(4)
    home, rec = tmp_path / "home", tmp_path / "records"
    server, url, token = _control_plane(hs, 3, home)
    addr = {f"node-{i}": hs[i].addr for i in (1, 2, 3)}
    samples, epochs = 4096, 6
    with hs[0].entered():  # the API client talks to host 0 from inside the namespaces
        admin = Api(url, token)
        wait(admin.healthy, 60, "the server")
        wait(lambda: {n["name"]: n["address"] for n in admin.cluster()["nodes"] if n["state"] == "up"} == addr,
             60, "three agents registered with their own addresses")
        user = Api(url, admin.add_user("alice"))
        a = user.submit(job("a", rec, samples=samples, epochs=epochs, gpus="1-4", deadline=3600))["id"]
        wait(lambda: user.job(a)["world_size"] == 4 and user.job(a)["step"] > 3, 150, "A to train on 4 GPUs", user)
        master = procs(user, a, kind="master")[0]["node"]
        assert user.job(a)["master_url"].startswith(f"http://{addr[master]}:"), user.job(a)["master_url"]
        nodes = {p["node"] for p in procs(user, a, kind="worker", state="running")}
        assert len(nodes) == 2 and master in nodes, nodes  # 4 GPUs of 2 per host: two hosts
        other = next(n for n in nodes if n != master)

        # the other host of the job dies: its agent and its workers at once
        doomed = procs(user, a, node=other, state="running")
        hs.kill_host(int(other[-1]))
        wait(lambda: any(n["name"] == other and n["state"] == "down" for n in admin.cluster()["nodes"]), 40,
             f"{other} to be marked down", user)
        wait(lambda: {p["state"] for p in procs(user, a, node=other) if p["pid"] in {d["pid"] for d in doomed}}
             == {"lost"}, 30, "its processes to be marked lost", user)
        step = user.job(a)["step"]
        wait(lambda: user.job(a)["step"] > step + 3, 90, "A to train on after the loss", user)

        # the server restarts on its host; the agents on the others reconnect
        server.terminate()
        server.wait(timeout=20)
        server = _tidal(hs[0], [*SERVER_ARGS, "--token", token], home, "server")
        wait(admin.healthy, 60, "the restarted server")
        up = {n: addr[n] for n in addr if n != other}
        wait(lambda: {n["name"]: n["address"] for n in admin.cluster()["nodes"] if n["state"] == "up"} == up, 60,
             "the surviving agents to reconnect")
        wait(lambda: user.job(a)["state"] in ("completed", "failed"), 240, "A to finish", user)
        final = user.job(a)
        assert final["state"] == "completed", final
        assert final["gpus"] == []
        replay_gpu_holders(admin.events())
    check_exactly_once(rec / "a", samples, epochs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_host_cut_off_for_10s_comes_back_without_duplicates(hosts: Any, tmp_path: Path) -> None:
    """The link of the job's second host goes down for 10 s and comes back:
    the node is marked down and its processes lost; when the link heals the
    cut-off workers are stopped, not re-admitted, the job trains on, and the
    node's GPUs are handed out again only after that, never to two jobs.
    (During the cut the survivors wait in their all-reduce: a cut link sends
    no reset, so nothing fails until the cut-off processes are stopped.)"""
    hs = hosts(3)
    home, rec = tmp_path / "home", tmp_path / "records"
    _, url, token = _control_plane(hs, 2, home)
    samples, epochs = 4096, 8
    with hs[0].entered():
        admin = Api(url, token)
        wait(admin.healthy, 60, "the server")
        wait(lambda: sum(n["state"] == "up" for n in admin.cluster()["nodes"]) == 2, 60, "two agents")
        user = Api(url, admin.add_user("alice"))
        a = user.submit(job("a", rec, samples=samples, epochs=epochs, gpus="1-4", deadline=3600))["id"]
        wait(lambda: user.job(a)["world_size"] == 4 and user.job(a)["step"] > 3, 150, "A on 4 GPUs", user)
        master = procs(user, a, kind="master")[0]["node"]
        other = "node-1" if master == "node-2" else "node-2"
        cut_off = {p["pid"] for p in procs(user, a, node=other, state="running")}
        t_cut = time.monotonic()
        hs.cut(int(other[-1]))
        wait(lambda: any(n["name"] == other and n["state"] == "down" for n in admin.cluster()["nodes"]), 30,
             f"{other} to be marked down", user)
        time.sleep(max(0.0, 10.0 - (time.monotonic() - t_cut)))
        hs.heal(int(other[-1]))
        wait(lambda: any(n["name"] == other and n["state"] == "up" for n in admin.cluster()["nodes"]), 30,
             f"{other} to come back", user)
        wait(lambda: all(p["state"] not in ("pending", "running", "lost") for p in user.job(a)["processes"]
                         if p["node"] == other and p["pid"] in cut_off), 60, "the cut-off workers to be stopped", user)
        step = user.job(a)["step"]
        wait(lambda: user.job(a)["step"] > step + 3 or user.job(a)["state"] == "completed", 90,
             "A to train on without them", user)
        wait(lambda: user.job(a)["state"] in ("completed", "failed"), 240, "A to finish", user)
        final = user.job(a)
        assert final["state"] == "completed", final
        live = [p for p in final["processes"] if p["state"] in ("pending", "running")]
        assert live == [], live
        replay_gpu_holders(admin.events())
    check_exactly_once(rec / "a", samples, epochs)


def _kinds(admin: Api, jid: str) -> set[str]:
    return {e["kind"] for e in admin.events() if e.get("job") == jid}


def _steps(rec: Path, worker: str) -> list[tuple[int, int]]:
    path = rec / f"{worker}.txt"
    return [(int(ln.split()[0]), int(ln.split()[1])) for ln in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_masters_host_dies_and_the_master_moves_to_another_host_of_the_job(hosts: Any, tmp_path: Path) -> None:
    """The host running the job's master (and two of its workers) dies. The
    server marks it down, restarts the master on the job's other host from
    the store's copy of its state, the surviving workers find it there (their
    agent rewrites $TIDAL_MASTER_FILE) and re-form without the lost ones:
    no step is redone on the surviving host (no rollback to a checkpoint),
    the job finishes, every sample exactly once per epoch."""
    hs = hosts(3)
    home, rec = tmp_path / "home", tmp_path / "records"
    _, url, token = _control_plane(hs, 2, home, grace="60")  # the default grace: the master moves before it ends
    addr = {f"node-{i}": hs[i].addr for i in (1, 2)}
    samples, epochs = 4096, 6
    with hs[0].entered():
        admin = Api(url, token)
        wait(admin.healthy, 60, "the server")
        wait(lambda: sum(n["state"] == "up" for n in admin.cluster()["nodes"]) == 2, 60, "two agents")
        user = Api(url, admin.add_user("alice"))
        a = user.submit(job("a", rec, samples=samples, epochs=epochs, gpus="1-4", deadline=3600))["id"]
        wait(lambda: user.job(a)["world_size"] == 4 and user.job(a)["step"] > 3, 150, "A on 4 GPUs", user)
        doomed = procs(user, a, kind="master")[0]["node"]
        survivor = "node-1" if doomed == "node-2" else "node-2"
        kept = sorted(p["name"] for p in procs(user, a, node=survivor, kind="worker", state="running"))
        assert len(kept) == 2, kept
        t_kill = time.monotonic()
        hs.kill_host(int(doomed[-1]))
        wait(lambda: "job.master_relocated" in _kinds(admin, a), 30,
             "the master to be relocated (a master silent with its node is lost after 10 s)", user)
        moved_s = time.monotonic() - t_kill
        wait(lambda: user.job(a)["master_url"].startswith(f"http://{addr[survivor]}:"), 60,
             f"the new master to report from {survivor}", user)
        relocated = [p for p in procs(user, a, kind="master") if p["node"] == survivor]
        assert len(relocated) == 1, user.job(a)["processes"]
        step = user.job(a)["step"]
        wait(lambda: user.job(a)["step"] > step + 3 or user.job(a)["state"] == "completed", 120,
             "A to train on under the relocated master", user)
        print(f"master's host killed: moved after {moved_s:.1f} s, training again {time.monotonic() - t_kill:.1f} s")
        wait(lambda: user.job(a)["state"] in ("completed", "failed"), 240, "A to finish", user)
        final = user.job(a)
        assert final["state"] == "completed", final
        assert final["gpus"] == []
        assert not {"job.resume", "job.suspended"} & _kinds(admin, a)
        replay_gpu_holders(admin.events())
    for w in kept:  # the surviving workers never redid a step: nothing was rolled back
        steps = _steps(rec / "a", w)
        assert steps == sorted(set(steps)), f"{w} trained a step twice"
    check_exactly_once(rec / "a", samples, epochs)
