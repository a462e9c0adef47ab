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
reads. A Ray node that dies (not ``Alive``, or gone from ``ray.nodes()``)
has its agent stopped: it stops heart-beating, the server marks the node down
and its jobs recover as for a lost host.

Assumption: the agents' work directories (logs' fallback, the master URL
files workers read) are on a disk every Ray node sees, as on one machine.
Ray is imported lazily: ``pip install 'tidal[ray]'``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

from tidal import settings
from tidal.agent.agent import Agent, Launcher
from tidal.agent.proctable import EXIT_UNKNOWN, Handle
from tidal.net import LOOPBACK

log = logging.getLogger("tidal.engines.ray")

CALL_S = 10.0  # patience for one actor call
LOG_TAIL_MAX = 8 * 1024 * 1024  # read from an exited process's actor before the actor is released


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
    actor that died (its node did) reports :data:`EXIT_UNKNOWN`."""

    def __init__(self, actor: Any, start_ref: Any) -> None:
        self.actor, self._start = actor, start_ref
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


def ray_launcher(node_id: str) -> Launcher:
    """A launcher starting each process row in a :class:`ProcActor` on Ray node ``node_id``."""
    ray = require_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_cls = ray.remote(ProcActor)

    def launch(w: dict[str, Any], argv: list[str], env: dict[str, str], cwd: str | None, log_path: Path) -> Handle:
        gpu = w.get("kind") != "master" and (w.get("env") or {}).get("CUDA_VISIBLE_DEVICES", "-1").isdigit()
        actor = actor_cls.options(num_cpus=0, num_gpus=1 if gpu else 0, name=None, max_restarts=0,
                                  scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        return RayHandle(actor, actor.start.remote(argv, env, cwd, str(log_path), gpu))

    return launch


# -- the runner ---------------------------------------------------------------------------------
class RayEngine:
    """One agent thread per alive Ray node, kept in step with ``ray.nodes()``
    every ``poll_s`` seconds, until :meth:`stop`."""

    def __init__(self, server: str, join_token: str, *, ray_address: str | None = None, interval_s: float = 0.5,
                 poll_s: float = 1.0, workdir: Path | None = None) -> None:
        self.server, self.join_token, self.ray_address = server, join_token, ray_address
        self.interval_s, self.poll_s = interval_s, poll_s
        self.workdir = Path(workdir or settings.home() / "agents")
        self.agents: dict[str, tuple[Agent, threading.Thread]] = {}
        self._stop = threading.Event()

    def sync(self) -> None:
        """Start an agent for each new alive node, stop those of dead nodes."""
        ray = connect(self.ray_address)
        start, stop = plan(set(self.agents), ray.nodes())
        for node_id in stop:
            agent, thread = self.agents.pop(node_id)
            log.warning("Ray node %s is gone: its agent %s stops", node_id, agent.name)
            agent.stop()
        for node_id, node in start.items():
            name = node_name(node_id)
            agent = Agent(self.server, self.join_token, name, node_gpus(node), virtual=True,
                          interval_s=self.interval_s, workdir=self.workdir / name,
                          address=str(node.get("NodeManagerAddress") or LOOPBACK),
                          launcher=ray_launcher(node_id))
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
