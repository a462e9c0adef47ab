"""An embedded cluster on this machine: one server and N agents with virtual
GPUs, as processes (``tidal up``, ``tidal demo`` and the end-to-end tests)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

from tidal import settings
from tidal.control.client import Api
from tidal.net import LOOPBACK


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
    ) -> None:
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.nodes, self.gpus_per_node = nodes, gpus_per_node
        self.policy, self.tick_s = policy, tick_s
        self.port = port or free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.db_url = db_url
        self.admin_token = secrets.token_urlsafe(24)
        self.server: subprocess.Popen | None = None
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
        args = ["server", "--port", str(self.port), "--policy", self.policy, "--tick", str(self.tick_s)]
        if self.db_url:
            args += ["--db", self.db_url]
        self.server = self._spawn(args, "server", **{settings.ADMIN_TOKEN.name: self.admin_token})
        api = Api(self.url, self.admin_token)
        deadline = time.time() + timeout_s
        while not api.healthy():
            if self.server.poll() is not None:
                raise RuntimeError(f"server exited with {self.server.returncode}; see {self.home / 'server.log'}")
            if time.time() > deadline:
                raise TimeoutError("server did not come up")
            time.sleep(0.2)
        (self.home / "server.json").write_text(json.dumps({"url": self.url}))

    def _spawn_agent(self, i: int) -> subprocess.Popen:
        join = (self.home / "agent.token").read_text().strip()  # written by the server: register, nothing else
        return self._spawn(["agent", "--server", self.url, "--name", f"node-{i}", "--virtual-gpus",
                            str(self.gpus_per_node), "--interval", "0.3"], f"agent-{i}", **{settings.TOKEN.name: join})

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
