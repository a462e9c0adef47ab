"""Where worker processes run: the :class:`Spawner` protocol and its registry.

A spawner is bound to one job. It starts workers by id, stops one, and tells
which of the workers it started have exited. Implementations:

- ``local`` (:class:`LocalSpawner`): processes of the training script on this
  host, for ``tidal run``;
- ``agents`` (:mod:`tidal.control.spawner`): rows in the control plane's
  process table, which the node agents reconcile against;
- later engines (Ray, Kubernetes) register the same way.

Each argument has one meaning: ``worker_id`` is the runtime's worker id
(``w0``, ``w1``, ...), ``host`` a host (node) name, ``device`` the index of a
GPU on that host (the agents expose it as ``CUDA_VISIBLE_DEVICES``, the
local spawner as ``LOCAL_RANK``, torchrun's convention).
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from tidal import settings
from tidal.net import LOOPBACK
from tidal.runtime.warm import SparePool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerLaunch:
    """One worker to start: its id and, if the caller chose, where."""

    worker_id: str
    host: str | None = None
    device: int | None = None


@runtime_checkable
class Spawner(Protocol):
    """Starts and stops one job's worker processes."""

    def spawn(self, launches: Sequence[WorkerLaunch]) -> None:
        """Start these workers; raise if any cannot be started (then none is)."""

    def kill(self, worker_id: str) -> None:
        """Stop a worker for good (e.g. it hung); no-op if it is gone."""

    def exit_codes(self) -> dict[str, int | None]:
        """Exit code of every worker this spawner started (None: still running);
        empty if the spawner cannot see its processes."""


SpawnerFactory = Callable[..., Spawner]
_REGISTRY: dict[str, SpawnerFactory] = {}
# spawners that live in packages this one must not import (they import it):
# loaded by module name on first use, like an entry point
_PLUGINS: dict[str, str] = {"agents": "tidal.control.spawner"}


def register_spawner(name: str) -> Callable[[SpawnerFactory], SpawnerFactory]:
    """Decorator: ``@register_spawner("ray")`` on a factory of spawners."""

    def deco(factory: SpawnerFactory) -> SpawnerFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"spawner {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return deco


def make_spawner(name: str, **options: Any) -> Spawner:
    if name not in _REGISTRY and name in _PLUGINS:
        importlib.import_module(_PLUGINS[name])  # registers itself
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown spawner {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    return factory(**options)


def spawner_names() -> list[str]:
    return sorted(set(_REGISTRY) | set(_PLUGINS))


def failed_workers(spawner: Spawner | None) -> set[str]:
    """Workers whose process exited with an error."""
    if spawner is None:
        return set()
    return {w for w, c in spawner.exit_codes().items() if c not in (None, 0)}


LOCAL_HOSTS = ("localhost", LOOPBACK, "")


def local_gpus(env: dict[str, str]) -> list[str]:
    """The GPUs a process started with ``env`` sees: ``CUDA_VISIBLE_DEVICES``
    if set, else as many as torch counts (none without CUDA)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        return [] if ids and ids[0].startswith("-") else ids
    try:
        import torch
    except ImportError:
        return []
    return [str(i) for i in range(torch.cuda.device_count())]


@register_spawner("local")
class LocalSpawner:
    """Processes of ``script`` on this host (``tidal run``). ``master_url``
    is set once the master listens.

    Like torchrun, every worker gets ``LOCAL_RANK``: here the lowest slot no
    live worker of this spawner holds, or ``WorkerLaunch.device`` when the
    caller chose. With GPUs (``gpus``: the ids of this host's visible GPUs,
    detected when None) the slot is the worker's GPU (``cuda:$LOCAL_RANK``,
    see :func:`tidal.runtime.devices.local_device`), so no GPU is given twice
    and a worker beyond the last free GPU is refused."""

    def __init__(self, script: str, args: Sequence[str] = (), env: dict[str, str] | None = None,
                 master_url: str = "", gpus: Sequence[str] | None = None, spares: int = 0) -> None:
        self.script, self.args = script, list(args)
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.gpus = list(gpus) if gpus is not None else local_gpus(self.env)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.slots: dict[str, int] = {}  # worker -> LOCAL_RANK (its GPU index with GPUs)
        self.started: dict[str, float] = {}  # worker -> when it was started (monotonic clock)
        self._tails: dict[int, tuple[deque[str], threading.Thread]] = {}  # pid -> its last stderr lines, their reader
        self._lock = threading.Lock()
        self.master_url = master_url
        # warm processes a scale-out's newcomers start from (tidal.runtime.warm); see fill_spares
        self.spares = SparePool(script, spares,
                                lambda argv, fds: self._popen(argv, self.env, stdin=subprocess.PIPE, pass_fds=fds))

    def _assign(self, launches: Sequence[WorkerLaunch]) -> list[int]:
        """One slot per launch, none held by a live worker; all or none."""
        held = {s for w, s in self.slots.items() if self.procs[w].poll() is None}
        out = []
        for x in launches:
            slot = x.device if x.device is not None else next(i for i in range(len(held) + 1) if i not in held)
            if slot in held:
                raise ValueError(f"worker {x.worker_id}: local slot/GPU {slot} is held by a running worker")
            if self.gpus and slot >= len(self.gpus):
                raise ValueError(f"worker {x.worker_id}: this host has {len(self.gpus)} GPU(s) "
                                 f"({','.join(self.gpus)}) and all are held by running workers; "
                                 "one worker per GPU")
            held.add(slot)
            out.append(slot)
        return out

    def spawn(self, launches: Sequence[WorkerLaunch]) -> None:
        bad = [x.host for x in launches if x.host not in (None, *LOCAL_HOSTS)]
        if bad:
            raise ValueError(f"the local spawner starts workers on this host only, not on {bad}")
        with self._lock:
            slots = self._assign(launches)
        for x, slot in zip(launches, slots):
            grant = {settings.MASTER_URL.name: self.master_url, settings.WORKER_ID.name: x.worker_id,
                     "LOCAL_RANK": str(slot)}
            p = self.spares.take(grant, self.args)
            how = "warm spare"
            if p is None:
                p, how = self._popen([sys.executable, "-u", self.script, *self.args], dict(self.env, **grant)), "new"
            with self._lock:
                self.procs[x.worker_id] = p
                self.slots[x.worker_id] = slot
                self.started[x.worker_id] = time.monotonic()
            log.info("started worker %s (%s process %d, LOCAL_RANK %d)", x.worker_id, how, p.pid, slot)

    def _popen(self, argv: list[str], env: dict[str, str], stdin: int | None = None,
               pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
        """A process whose stderr is passed on to ours, its last lines kept. It
        runs in a session of its own, as torchrun's workers do: a terminal's
        Ctrl-C reaches the launcher only, which stops the workers in order
        (:meth:`terminate`), and where the kernel groups CPU time by session
        (autogroup) each worker is scheduled like a torchrun worker."""
        p = subprocess.Popen(argv, env=env, stdin=stdin, stderr=subprocess.PIPE, pass_fds=pass_fds,
                             start_new_session=True)
        tail: deque[str] = deque(maxlen=8)
        relay = threading.Thread(target=_relay, args=(p.stderr, tail), name=f"tidal-stderr-{p.pid}", daemon=True)
        relay.start()
        with self._lock:
            self._tails[p.pid] = (tail, relay)
        return p

    def fill_spares(self) -> int:
        """Start the warm spares that are missing (call when the job is steady);
        returns how many of them are warm."""
        self.spares.fill()
        return self.spares.warm()

    def kill(self, worker_id: str) -> None:
        with self._lock:
            p = self.procs.get(worker_id)
        if p is not None and p.poll() is None:
            p.kill()

    def exit_codes(self) -> dict[str, int | None]:
        with self._lock:
            return {w: p.poll() for w, p in self.procs.items()}

    def last_error(self, worker_id: str) -> str:
        """The last non-blank line an exited worker wrote to stderr (a
        traceback's exception line), or ""."""
        with self._lock:
            p = self.procs.get(worker_id)
            tail, relay = self._tails.get(p.pid, (deque(), None)) if p is not None else (deque(), None)
        if relay is not None:
            relay.join(timeout=2.0)  # the process exited: its pipe is drained soon
        return tail[-1] if tail else ""

    def terminate(self, grace_s: float = 10.0) -> None:
        """SIGTERM every live worker, SIGKILL after ``grace_s``; the spares go at once."""
        self.spares.close()
        with self._lock:
            procs = list(self.procs.values())
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.kill()


def _relay(stream: Any, tail: deque[str]) -> None:
    """Pass a worker's stderr on to this process's, keeping its last non-blank lines."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except (OSError, ValueError):  # our stderr is gone: keep draining the pipe
            pass
        if line.strip():
            tail.append(line.rstrip())
    stream.close()
