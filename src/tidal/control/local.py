"""An embedded cluster on this machine: one server and N agents with virtual
GPUs, as processes (``tidal up``, ``tidal demo`` and the end-to-end tests).

``tidal up`` runs the server inside its own process (:class:`EmbeddedServer`)
so that it holds the coordinator: a Ctrl-C drains it (:func:`drain`: every
running job is suspended with a checkpoint and goes back to ``pending``)
before the agents and the server stop, and the next ``tidal up`` on the same
home resumes those jobs. The demo and the tests run the server as a process
of its own, which they can kill and restart.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from tidal import settings
from tidal.control.client import Api
from tidal.net import LOOPBACK

log = logging.getLogger(__name__)

#: the most virtual GPUs one node registers with (the server's registration takes 1-1024)
MAX_GPUS_PER_NODE = 1024
#: the most nodes ``tidal up`` starts: each is an agent process on this machine
MAX_NODES = 64
#: how long a graceful stop waits for the running jobs to suspend before stopping at once
DRAIN_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class LocalCluster:
    def __init__(
        self,
        home: Path,
        *,
        nodes: int = 2,
        gpus_per_node: int = 4,
        policy: str = "edf",
        tick_s: float = 1.0,
        port: int | None = None,
        db_url: str | None = None,
        in_process: bool = False,
        layout: Sequence[tuple[int, str]] | None = None,
    ) -> None:
        """``in_process``: the server runs in this process (:class:`EmbeddedServer`,
        ``tidal up``), else as a process of its own. ``layout`` gives each
        node's (GPU count, GPU type) — nodes of different sizes and types;
        without it, ``nodes`` alike nodes of ``gpus_per_node`` untyped GPUs."""
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.layout: tuple[tuple[int, str], ...] = (
            tuple((int(g), t) for g, t in layout) if layout else ((gpus_per_node, ""),) * nodes)
        self.nodes = len(self.layout)
        self.gpus_per_node = self.layout[0][0] if self.layout else gpus_per_node
        self.policy, self.tick_s = policy, tick_s
        self.port = port or free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.db_url = db_url
        self.admin_token = secrets.token_urlsafe(24)
        self.server: subprocess.Popen | None = None
        self.embedded: EmbeddedServer | None = EmbeddedServer(self) if in_process else None
        self.agents: list[subprocess.Popen] = []
        # its "nodes" are processes on this machine: one disk, so checkpoints are shared by all of them
        self.env = {**os.environ, settings.HOME.name: str(self.home), "OMP_NUM_THREADS": "1",
                    settings.CHECKPOINT_SHARED.name: "1"}

    def _spawn(self, args: list[str], log_name: str, **env: str) -> subprocess.Popen:
        # credentials go in the environment, never on a command line (visible to every user in ps)
        with open(self.home / f"{log_name}.log", "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "tidal", *args], env={**self.env, **env}, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def start_server(self, timeout_s: float = 60.0) -> None:
        if self.embedded is not None:
            self.embedded.start()
        else:
            args = ["server", "--port", str(self.port), "--policy", self.policy, "--tick", str(self.tick_s)]
            if self.db_url:
                args += ["--db", self.db_url]
            self.server = self._spawn(args, "server", **{settings.ADMIN_TOKEN.name: self.admin_token})
        api = Api(self.url, self.admin_token)
        deadline = time.time() + timeout_s
        while not api.healthy():
            if self.server is not None and self.server.poll() is not None:
                raise RuntimeError(f"server exited with {self.server.returncode}; see {self.home / 'server.log'}")
            if self.embedded is not None and not self.embedded.running():
                raise RuntimeError(f"the server stopped while starting; see {self.home / 'server.log'}")
            if time.time() > deadline:
                raise TimeoutError("server did not come up")
            time.sleep(0.2)
        (self.home / "server.json").write_text(json.dumps({"url": self.url}))

    def describe(self) -> str:
        """The nodes in words: ``2 node(s) × 4 virtual GPU(s)``, or each group
        (``1 node(s) × 4 T4, 1 node(s) × 2 A100``) when they differ."""
        groups: list[list] = []
        for gpus, gtype in self.layout:
            if groups and groups[-1][1:] == [gpus, gtype]:
                groups[-1][0] += 1
            else:
                groups.append([1, gpus, gtype])
        return ", ".join(f"{c} node(s) × {g} {t or 'virtual'} GPU(s)" if not t else f"{c} node(s) × {g} {t}"
                         for c, g, t in groups)

    def _spawn_agent(self, i: int) -> subprocess.Popen:
        join = (self.home / "agent.token").read_text().strip()  # written by the server: register, nothing else
        gpus, gtype = self.layout[i]
        args = ["agent", "--server", self.url, "--name", f"node-{i}", "--virtual-gpus", str(gpus),
                "--interval", "0.3"] + (["--gpu-type", gtype] if gtype else [])
        return self._spawn(args, f"agent-{i}", **{settings.TOKEN.name: join})

    def start(self, timeout_s: float = 60.0) -> "LocalCluster":
        self.start_server(timeout_s)
        for i in range(self.nodes):
            self.agents.append(self._spawn_agent(i))
        api = Api(self.url, self.admin_token)
        deadline = time.time() + timeout_s
        while len([n for n in api.cluster()["nodes"] if n["state"] == "up"]) < self.nodes:
            if time.time() > deadline:
                raise TimeoutError("agents did not register")
            time.sleep(0.2)
        return self

    def api(self, token: str | None = None) -> Api:
        return Api(self.url, token or self.admin_token)

    def stop_server(self) -> None:
        if self.embedded is not None:
            self.embedded.stop()
        if self.server and self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.server.kill()

    def restart_server(self) -> None:
        self.stop_server()
        self.start_server()

    def kill_agent(self, i: int) -> None:
        """``kill -9`` of node ``i``'s agent alone: the processes it launched
        run on (each leads its own session)."""
        self.agents[i].kill()
        self.agents[i].wait()

    def start_agent(self, i: int) -> None:
        """Node ``i``'s agent again (after :meth:`kill_agent`), on the same
        work directory: it adopts the processes still running."""
        if self.agents[i].poll() is None:
            raise RuntimeError(f"the agent of node-{i} still runs")
        self.agents[i] = self._spawn_agent(i)

    def stop(self) -> None:
        for p in self.agents:
            if p.poll() is None:
                p.terminate()
        for p in self.agents:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.stop_server()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class EmbeddedServer:
    """The server of a :class:`LocalCluster` inside this process: the app of
    ``tidal server`` (:func:`tidal.control.server.create_app`) served by
    uvicorn in a thread, on loopback, with the cluster's home, port, policy
    and admin token. Holding it gives the coordinator (:attr:`coordinator`),
    which a graceful stop drains, and the suspended jobs found in the store
    when it started (:attr:`resuming`), before its policy could start any."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.resuming: list[str] = []
        self.app: Any = None
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None
        self._umask: int | None = None  # this process's before start (restored by stop)

    @property
    def coordinator(self) -> Any:
        """The scheduler loop (:class:`tidal.control.coordinator.Coordinator`)."""
        return self.app.state.coordinator

    @property
    def store(self) -> Any:
        """The store (:class:`tidal.control.db.Store`)."""
        return self.app.state.store

    def start(self) -> None:
        """Build the app over the home's store and serve it in a thread
        (:meth:`running` turns False if it cannot listen)."""
        import uvicorn

        from tidal.control.credentials import Credentials
        from tidal.control.db import Store
        # the same app and files as `tidal server` (its private-file writer too)
        from tidal.control.server import create_app, write_private, secret_path

        c = self.cluster
        # as `tidal server`: the store, logs and checkpoints are this user's only (until stop: this process
        # may go on after its cluster, e.g. a test run, and files it makes then are not the server's)
        self._umask = os.umask(0o077)
        store = Store(c.db_url or f"sqlite:///{c.home / 'tidal.db'}")
        self.resuming = suspended_jobs(store)  # before the coordinator exists: none has been started again
        credentials = Credentials.from_file(secret_path(c.home))
        for name, text in (("admin.token", c.admin_token), ("agent.token", credentials.agent_token())):
            write_private(c.home / name, text)
        self.app = create_app(store, policy=c.policy, admin_token=c.admin_token, credentials=credentials,
                              tick_s=c.tick_s, home=c.home, server_url=c.url)
        # log_config=None: the server's records go where this process sends its logging
        config = uvicorn.Config(self.app, host=LOOPBACK, port=c.port, log_level="warning", log_config=None,
                                timeout_graceful_shutdown=5)
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, name="tidal-server", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop serving (the coordinator stops with the app)."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._umask is not None:
            os.umask(self._umask)
            self._umask = None



@dataclass
class DrainResult:
    """Where a graceful stop left the jobs that ran when it began."""

    suspended: list[str] = field(default_factory=list)  # pending again, with a checkpoint
    refused: dict[str, str] = field(default_factory=dict)  # job -> its master's answer (e.g. no checkpoint dir)
    unsettled: list[str] = field(default_factory=list)  # still running when the time was up
    ended: dict[str, str] = field(default_factory=dict)  # job -> the state it ended in meanwhile


def drain(server: EmbeddedServer, say: Callable[[str], None], timeout_s: float = DRAIN_TIMEOUT_S,
          poll_s: float = 0.5) -> DrainResult:
    """Suspend every running job of ``server``'s cluster with a checkpoint
    (the coordinator's own suspension; they go back to ``pending`` and the
    next start of the cluster resumes them), saying what it does through
    ``say``. Returns when every job settled, or only jobs whose master refused
    are left, or after ``timeout_s``. The coordinator starts nothing from
    now on. A KeyboardInterrupt (a second Ctrl-C) ends the wait at once."""
    coord = server.coordinator
    coord.drain()
    coord.wake()
    first = sorted(coord.draining_left())
    if not first:
        say("stopping: no job is running")
        return DrainResult()
    say(f"stopping: suspending {len(first)} running job(s) with a checkpoint: {', '.join(first)} "
        "(Ctrl-C again to stop at once)")
    start = time.monotonic()
    refused: dict[str, str] = {}
    next_note = start + 10.0
    while True:
        left = set(coord.draining_left())
        for jid, answer in sorted(_refusals(server.store, left - set(refused)).items()):
            refused[jid] = answer
            say(f"{jid} cannot be suspended (its master refused: {answer}); it will be stopped and fail")
        now = time.monotonic()
        if left <= set(refused) or now - start >= timeout_s:
            break
        if now >= next_note:
            waiting = sorted(left - set(refused))
            say(f"waiting for {len(waiting)} job(s) to checkpoint: {', '.join(waiting)} ({now - start:.0f} s)")
            next_note = now + 10.0
        coord.wake()
        time.sleep(poll_s)
    states = job_states(server.store, first)
    return DrainResult(suspended=[j for j in first if states.get(j) == "pending"], refused=refused,
                       unsettled=sorted(left - set(refused)),
                       ended={j: st for j, st in states.items() if st in ("completed", "failed", "cancelled")})


def _refusals(store: Any, ids: set[str]) -> dict[str, str]:
    """The jobs of ``ids`` whose master refused a suspension, with its answer."""
    from tidal.control.db import Job

    out: dict[str, str] = {}
    with store.session(write=False) as s:
        for jid in ids:
            j = s.get(Job, jid)
            answer = (j.tags or {}).get("_unsuspendable") if j is not None else None
            if answer:
                out[jid] = str(answer)
    return out


def job_states(store: Any, ids: list[str]) -> dict[str, str]:
    """The state of each job of ``ids`` (those the store knows)."""
    from tidal.control.db import Job

    with store.session(write=False) as s:
        return {jid: j.state for jid in ids if (j := s.get(Job, jid)) is not None}


def layout_conflict(home: Path, gpus: Sequence[int]) -> str | None:
    """Why agents with these GPU counts (``node-0``, ``node-1``...) cannot
    rejoin the cluster kept in ``home`` (a node keeps its GPU count), or None."""
    db = home / "tidal.db"
    if not db.exists():
        return None
    from tidal.control.db import Node, Store

    store = Store(f"sqlite:///{db}")
    try:
        with store.session(write=False) as s:
            known = {n.name: n.num_gpus for n in s.query(Node).all()}
    finally:
        store.engine.dispose()
    clash = [f"node-{i} has {known[f'node-{i}']} GPU(s), not {n}" for i, n in enumerate(gpus)
             if f"node-{i}" in known and known[f"node-{i}"] != n]
    if not clash:
        return None
    return (f"the cluster in {home} was made with other nodes ({'; '.join(clash)}); "
            "start it with the same --gpus and --nodes (or --cluster), or use another --home")


def suspended_jobs(store: Any) -> list[str]:
    """Pending jobs that were suspended with a checkpoint (they resume from it)."""
    from tidal.control.db import Job

    with store.session(write=False) as s:
        return sorted(j.id for j in s.query(Job).filter(Job.state == "pending") if "_resume_step" in (j.tags or {}))
