"""The Ray engine: Ray nodes become Tidal nodes.

:class:`RayEngine` connects to a Ray cluster as a driver and keeps one
:class:`~tidal.agent.agent.Agent` thread per alive Ray node (named
``ray-<first 8 hex digits of the node id>``, with the node's ``GPU``
resource as its GPU count). The agents register, heart-beat and reconcile
exactly like ``tidal agent``; only their launcher differs: each process row
starts inside a Ray actor pinned to the node (``NodeAffinitySchedulingStrategy``,
``soft=False``) that asks for one GPU when the row is a GPU worker, so Ray
picks the device and sets ``CUDA_VISIBLE_DEVICES``; the actor runs the row's
argv as a subprocess and answers :class:`RayHandle`'s poll, signal and log
reads.

A node's state in Tidal follows Ray's node table (:class:`NodeTable`): its
agent beats only while ``ray.nodes()`` lists the node alive and the server
cannot have marked it down yet. A node Ray lists dead or gone, and a node
whose agent went silent for nearly the server's node time-out (its
heartbeat stuck on the actors of a node that just died, before Ray noticed),
is retired: its agent stops for good, the server marks the node down and its
jobs recover as for a lost host, and it never comes back up meanwhile (no
down, up, down again). Ray never reuses a node id, so a node that rejoins
Ray does so under a new id and becomes a new Tidal node.

Assumption: the agents' work directories (logs' fallback, the master URL
files workers read) are on a disk every Ray node sees, as on one machine.
Ray is imported lazily: ``pip install 'tidal[ray]'``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tidal import settings
from tidal.agent.agent import Agent, Launcher
from tidal.agent.proctable import EXIT_UNKNOWN, Handle
from tidal.control.api.internal import NODE_TIMEOUT_S
from tidal.net import LOOPBACK

log = logging.getLogger("tidal.engines.ray")

CALL_S = 10.0  # patience for one actor call
LOG_TAIL_MAX = 8 * 1024 * 1024  # read from an exited process's actor before the actor is released
#: a Ray node's agent silent this long is retired: by the time its next heartbeat arrived the server
#: (node time-out :data:`NODE_TIMEOUT_S`, judged every second) may have marked the node down
RETIRE_SILENT_S = NODE_TIMEOUT_S - 2.0


def require_ray() -> Any:
    """The ``ray`` module, or a clear error naming the extra to install. Ray
    sends usage statistics unless told not to: it is told not to."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("the Ray engine needs Ray: pip install 'tidal[ray]'") from e
    return ray


def connect(address: str | None) -> Any:
    """``ray.init`` to the cluster at ``address`` (None: ``$RAY_ADDRESS`` or
    the local one), once per process. A loopback address keeps this driver on
    loopback too (Ray otherwise resolves 127.0.0.1 to the host's first
    routable address)."""
    host = (address or "").rsplit(":", 1)[0]
    if host in (LOOPBACK, "localhost"):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read when ray is imported
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
    return ray


# -- node source ------------------------------------------------------------------------
def node_name(node_id: str) -> str:
    return f"ray-{node_id[:8]}"


def plan(running: set[str], nodes: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """Which Ray nodes need an agent started (alive, with a GPU, none
    running: id -> node) and which agents to stop (their node is dead or
    gone), from ``ray.nodes()``. A node without GPUs is no Tidal node (a job
    master runs on a GPU node, next to its workers)."""
    alive = {str(n["NodeID"]): n for n in nodes if n.get("Alive") and node_gpus(n) > 0}
    return {k: n for k, n in alive.items() if k not in running}, {k for k in running if k not in alive}


def node_gpus(node: dict[str, Any]) -> int:
    return int((node.get("Resources") or {}).get("GPU", 0))


class NodeTable:
    """Ray's node table as Tidal follows it: ``list_nodes`` (``ray.nodes``,
    or a fake in tests) read by :meth:`refresh`, and the node ids retired
    for good. Shared by the engine's loop and its agents' threads."""

    def __init__(self, list_nodes: Callable[[], list[dict[str, Any]]], retire_silent_s: float = RETIRE_SILENT_S) -> None:
        self.list_nodes, self.retire_silent_s = list_nodes, retire_silent_s
        self.nodes: list[dict[str, Any]] = []
        self.retired: dict[str, str] = {}  # node id -> why
        self._lock = threading.Lock()

    def refresh(self) -> None:
        """Read Ray's node table again."""
        nodes = list(self.list_nodes())
        with self._lock:
            self.nodes = nodes

    def ray_alive(self, node_id: str) -> bool:
        """Whether Ray's table (as last read) lists ``node_id`` alive."""
        with self._lock:
            return any(str(n["NodeID"]) == node_id and n.get("Alive") for n in self.nodes)

    def plan(self, running: set[str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """The nodes to start an agent for (alive with GPUs, never retired:
        id -> node) and the running agents to stop (id -> why): nodes Ray
        lists dead or gone are retired now."""
        with self._lock:
            start, gone = plan(running, self.nodes)
            for node_id in gone:
                self.retired.setdefault(node_id, "Ray lists it dead or gone")
            retired = dict(self.retired)
        return ({k: n for k, n in start.items() if k not in retired},
                {k: why for k, why in retired.items() if k in running})

    def may_beat(self, node_id: str, silent_s: float) -> bool:
        """Whether the agent of ``node_id``, silent for ``silent_s`` seconds,
        may heart-beat now; False retires the node (for good)."""
        alive = self.ray_alive(node_id)
        with self._lock:
            if node_id in self.retired:
                return False
            if alive and silent_s < self.retire_silent_s:
                return True
            why = ("Ray lists it dead or gone" if not alive else
                   f"its agent was silent {silent_s:.1f} s, so the server has marked it down")
            self.retired[node_id] = why
        log.warning("Ray node %s (%s) is retired: %s; it stays down in Tidal (a node back in Ray has a new id)",
                    node_id, node_name(node_id), why)
        return False


class NodeRetired(OSError):
    """A retired Ray node's agent does not heart-beat (it stops)."""


class RayAgent(Agent):
    """The agent of one Ray node: an :class:`~tidal.agent.agent.Agent` whose
    heartbeats follow ``ray_nodes`` (:meth:`NodeTable.may_beat`). Its silence
    counts from the last heartbeat the server took, or from the last that
    could not reach the server (a server that takes no heartbeat judges no
    node down)."""

    def __init__(self, node_id: str, ray_nodes: NodeTable, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.node_id, self.ray_nodes = node_id, ray_nodes  # (``self.table`` is the agent's process table)
        self.heard_at = time.monotonic()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        start = time.monotonic()
        if path.endswith("/heartbeat") and not self.ray_nodes.may_beat(self.node_id, start - self.heard_at):
            self.stop()
            raise NodeRetired(f"Ray node {self.node_id} is retired: {self.name} does not heart-beat")
        try:
            ans = super()._post(path, body)
        except Exception:
            self.heard_at = time.monotonic()
            raise
        self.heard_at = start  # the server took it about when it was sent
        return ans


# -- the actor and its handle -------------------------------------------------------------
def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """The process dies with the actor that started it (a Ray node's death kills its actors)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ProcActor:
    """Runs one process row on its node (a Ray actor class once wrapped by
    ``ray.remote``)."""

    def __init__(self) -> None:
        self.popen: Any = None
        self.log_path = ""

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None, log_path: str, gpu: bool) -> int:
        import subprocess

        import ray

        env = dict(env)
        if gpu:  # the device Ray gave this actor, not Tidal's index on the node
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in ray.get_gpu_ids())
        self.log_path = log_path
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as fh:
            self.popen = subprocess.Popen(argv, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                          start_new_session=True, preexec_fn=_die_with_parent)
        return int(self.popen.pid)

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def read_log(self, offset: int, limit: int) -> bytes:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(offset)
                return fh.read(limit)
        except FileNotFoundError:
            return b""


class RayHandle(Handle):
    """A process inside a :class:`ProcActor`. Its pid is 0 until the actor
    started it (Ray may wait for the node's GPU to free). Once it exited and
    its log was read the actor is killed, which returns its GPU to Ray. An
    actor that died (its node did) reports :data:`EXIT_UNKNOWN`, at once
    when ``node_alive()`` says Ray lists its node dead (no call waits on it)."""

    def __init__(self, actor: Any, start_ref: Any, node_alive: Callable[[], bool] = lambda: True) -> None:
        self.actor, self._start, self.node_alive = actor, start_ref, node_alive
        self.pid, self.started = 0, None  # never adopted by pid: the process is on another node
        self._code: int | None = None
        self._released = False

    def _ray(self) -> Any:
        import ray

        return ray

    def _running(self) -> bool:
        """Whether the process was started (the pid is known)."""
        if not self.pid:
            ready, _ = self._ray().wait([self._start], timeout=0)
            if ready:
                self.pid = int(self._ray().get(self._start))
        return bool(self.pid)

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        ray = self._ray()
        if not self.node_alive():
            log.warning("actor of pid %d gone with its Ray node", self.pid)
            self._code = EXIT_UNKNOWN
            return self._code
        try:
            if not self._running():
                return None
            self._code = ray.get(self.actor.poll.remote(), timeout=CALL_S)
        except ray.exceptions.GetTimeoutError:
            return None
        except ray.exceptions.RayError as e:  # the actor (or its node) died
            log.warning("actor of pid %d gone: %s", self.pid, type(e).__name__)
            self._code = EXIT_UNKNOWN
        return self._code

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        ray = self._ray()
        try:
            if not self._running():  # not started yet: never will be
                ray.kill(self.actor)
                self._code, self._released = -sig, True
                return
            ray.get(self.actor.signal.remote(sig), timeout=CALL_S)
        except ray.exceptions.RayError as e:
            log.warning("cannot signal pid %d: %s", self.pid, type(e).__name__)

    def read_log(self, path: Path, offset: int, limit: int) -> bytes:
        if self._released or not self.pid:
            return b"" if not self.pid else super().read_log(path, offset, limit)
        ray = self._ray()
        exited = self._code is not None
        try:  # once it exited: the whole rest, then the actor goes
            data = ray.get(self.actor.read_log.remote(offset, LOG_TAIL_MAX if exited else limit), timeout=CALL_S)
        except ray.exceptions.RayError:
            data = super().read_log(path, offset, limit)  # the shared disk
        if exited:
            ray.kill(self.actor)
            self._released = True
        return data


def ray_launcher(node_id: str, node_alive: Callable[[], bool] = lambda: True) -> Launcher:
    """A launcher starting each process row in a :class:`ProcActor` on Ray
    node ``node_id`` (``node_alive``: whether Ray lists it alive)."""
    ray = require_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_cls = ray.remote(ProcActor)

    def launch(w: dict[str, Any], argv: list[str], env: dict[str, str], cwd: str | None, log_path: Path) -> Handle:
        gpu = w.get("kind") != "master" and (w.get("env") or {}).get("CUDA_VISIBLE_DEVICES", "-1").isdigit()
        actor = actor_cls.options(num_cpus=0, num_gpus=1 if gpu else 0, name=None, max_restarts=0,
                                  scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        return RayHandle(actor, actor.start.remote(argv, env, cwd, str(log_path), gpu), node_alive)

    return launch


# -- the runner ---------------------------------------------------------------------------------
class RayEngine:
    """One agent thread per alive Ray node, kept in step with ``ray.nodes()``
    every ``poll_s`` seconds (:class:`NodeTable`), until :meth:`stop`."""

    def __init__(self, server: str, join_token: str, *, ray_address: str | None = None, interval_s: float = 0.5,
                 poll_s: float = 1.0, workdir: Path | None = None) -> None:
        self.server, self.join_token, self.ray_address = server, join_token, ray_address
        self.interval_s, self.poll_s = interval_s, poll_s
        self.workdir = Path(workdir or settings.home() / "agents")
        self.agents: dict[str, tuple[Agent, threading.Thread]] = {}
        self.ray_nodes = NodeTable(lambda: connect(self.ray_address).nodes())
        self._stop = threading.Event()

    def sync(self) -> None:
        """Start an agent for each new alive node, stop those of retired nodes."""
        self.ray_nodes.refresh()
        start, stop = self.ray_nodes.plan(set(self.agents))
        for node_id, why in stop.items():
            agent, thread = self.agents.pop(node_id)
            log.warning("Ray node %s is retired (%s): its agent %s stops", node_id, why, agent.name)
            agent.stop()
        for node_id, node in start.items():
            name = node_name(node_id)
            agent = RayAgent(node_id, self.ray_nodes, self.server, self.join_token, name, node_gpus(node), virtual=True,
                             interval_s=self.interval_s, workdir=self.workdir / name,
                             address=str(node.get("NodeManagerAddress") or LOOPBACK),
                             launcher=ray_launcher(node_id, lambda n=node_id: self.ray_nodes.ray_alive(n)))
            thread = threading.Thread(target=agent.run, name=f"agent-{name}", daemon=True)
            thread.start()
            self.agents[node_id] = (agent, thread)
            log.info("Ray node %s: agent %s with %d GPU(s)", node_id, name, agent.num_gpus)

    def run(self) -> None:
        connect(self.ray_address)
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception:  # noqa: BLE001 - Ray's GCS briefly unreachable: the next round retries
                log.exception("cannot list Ray's nodes")
            self._stop.wait(self.poll_s)
        for agent, _ in self.agents.values():
            agent.stop()
        for _, thread in self.agents.values():
            thread.join(timeout=30)

    def stop(self) -> None:
        self._stop.set()

    def start(self) -> threading.Thread:
        """:meth:`run` in a daemon thread."""
        thread = threading.Thread(target=self.run, name="tidal-ray-engine", daemon=True)
        thread.start()
        return thread
