"""Per-worker memory and CPU limits, enforced by the node agent (docs/resources.md).

A worker row may carry ``resources`` (``{"memory": bytes, "cpus": float}``,
from the job spec's ``resources:``). The agent gives each such process a
:class:`Placement` made by the first backend that works here
(``$TIDAL_LIMITS=auto``):

* ``cgroup2``: a child cgroup of the agent's own with ``memory.max``,
  ``memory.swap.max`` 0, ``memory.oom.group`` 1 and ``cpu.max``; an OOM kill
  shows in ``memory.events`` (``oom_kill``), the peak in ``memory.peak``.
* ``cgroup1``: a child of the agent's memory cgroup with
  ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``), a child of
  its cpu cgroup with ``cpu.cfs_quota_us``; an OOM kill shows in
  ``memory.oom_control`` (``oom_kill``), or as ``memory.failcnt`` plus SIGKILL.
* ``watchdog``: no cgroup; the agent sums the RSS of the worker's session
  (every process the worker started, ``/proc/PID/stat``) every
  :data:`POLL_S` and kills the session with SIGKILL above the limit.

CPUs without a writable cpu controller: the process is pinned to
``ceil(cpus)`` CPUs (``sched_setaffinity``, right after it starts).

The process enters its cgroups before it runs anything: the agent starts it
through ``sh``, which writes its own pid (the pid the worker keeps) to the
cgroups' ``cgroup.procs`` and then ``exec``\\ s the command; the agent writes
the pid again after the start (for a launcher whose process may not write
there). Every cgroup made is removed when its process has ended (leftover
processes in it are killed first), also when the launch failed.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from tidal.agent.proctable import Handle

log = logging.getLogger("tidal.agent")

PREFIX = "tidal-"  # every cgroup the agent makes is named so
PERIOD_US = 100_000  # CFS period for the CPU quota
POLL_S = 0.1  # how often the watchdog samples
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MODES = ("auto", "cgroup2", "cgroup1", "watchdog", "off")

#: starts a command after writing its pid to each file named before ``--``
_ENTER = 'while [ "$1" != -- ]; do echo $$ > "$1" 2>/dev/null; shift; done; shift; exec "$@"'


@dataclass(frozen=True)
class Limits:
    """A process's limits: ``memory`` in bytes and ``cpus`` (0: none)."""

    memory: int = 0
    cpus: float = 0.0

    @classmethod
    def of(cls, d: Mapping[str, Any] | None) -> "Limits":
        d = d or {}
        return cls(int(d.get("memory") or 0), float(d.get("cpus") or 0.0))

    def __bool__(self) -> bool:
        return bool(self.memory or self.cpus)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_keys(path: Path) -> dict[str, int]:
    """``key value`` lines (``memory.events``, ``memory.oom_control``)."""
    out: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        k, _, v = line.partition(" ")
        if v.strip().isdigit():
            out[k] = int(v)
    return out


def _try_write(path: Path, value: str) -> bool:
    """Write a knob that may be missing here (no swap accounting, an old kernel)."""
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


@dataclass
class Placement:
    """Where one process's limits live: its backend, the cgroups made for it
    (removed when it ends), how its CPUs are held, and what was seen."""

    key: str
    limits: Limits
    backend: str  # cgroup2 | cgroup1 | watchdog
    memory_dir: str = ""
    cpu_dir: str = ""  # cgroup v1's separate cpu hierarchy
    cpu: str = "none"  # cpu.max | cfs_quota | affinity | none
    peak: int = 0  # highest memory use seen, bytes
    killed: bool = False  # by the watchdog

    @property
    def dirs(self) -> list[Path]:
        return [Path(d) for d in (self.memory_dir, self.cpu_dir) if d]

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def usage(self) -> int | None:
        """The cgroup's memory use now (None: the watchdog measures it)."""
        name = {"cgroup2": "memory.current", "cgroup1": "memory.usage_in_bytes"}.get(self.backend)
        return _read_int(Path(self.memory_dir) / name) if name and self.memory_dir else None

    def peak_bytes(self) -> int:
        name = {"cgroup2": "memory.peak", "cgroup1": "memory.max_usage_in_bytes"}.get(self.backend)
        kernel = _read_int(Path(self.memory_dir) / name) if name and self.memory_dir else None
        return max(self.peak, kernel or 0)

    def oom_killed(self, exit_code: int | None) -> bool:
        """Whether the process ended because it ran out of its memory."""
        if self.killed:
            return True
        d = Path(self.memory_dir)
        if self.backend == "cgroup2" and self.memory_dir:
            return _read_keys(d / "memory.events").get("oom_kill", 0) > 0
        if self.backend == "cgroup1" and self.memory_dir:
            if _read_keys(d / "memory.oom_control").get("oom_kill", 0) > 0:
                return True
            return (_read_int(d / "memory.failcnt") or 0) > 0 and exit_code == -9
        return False

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        d["limits"] = asdict(self.limits)
        return d

    @classmethod
    def from_record(cls, r: Mapping[str, Any] | None) -> "Placement | None":
        if not r:
            return None
        return cls(**{**r, "limits": Limits.of(r.get("limits"))})


def own_cgroup(controller: str, proc_cgroup: Path = PROC_CGROUP) -> str | None:
    """This process's cgroup path in the hierarchy of ``controller`` (v1), or
    in the unified hierarchy for ``""`` (v2); None if it has none."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if (controller == "" and parts[0] == "0" and parts[1] == "") or controller in parts[1].split(","):
            return parts[2]
    return None


def remove_cgroup(d: Path, timeout_s: float = 3.0) -> bool:
    """Kill what is left in cgroup ``d`` and remove it; False if it stays."""
    if not d.exists():
        return True
    if not ((d / "cgroup.kill").exists() and _try_write(d / "cgroup.kill", "1")):
        for pid in _pids(d):
            try:
                os.kill(pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(d)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.ENOTEMPTY) or time.monotonic() > deadline:
                log.error("cannot remove cgroup %s: %s", d, e)
                return False
        time.sleep(0.05)


def _pids(d: Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


class Backend:
    """How placements are made. The base class is the watchdog: no cgroup."""

    name = "watchdog"

    def create(self, key: str, limits: Limits) -> Placement:
        return Placement(key, limits, self.name)

    def remove(self, pl: Placement) -> bool:
        return all([remove_cgroup(d) for d in pl.dirs])


class CgroupV2(Backend):
    """Children of ``parent``, a cgroup v2 directory this agent may write."""

    name = "cgroup2"

    def __init__(self, parent: Path) -> None:
        self.parent = Path(parent)
        self.enabled: set[str] | None = None

    @classmethod
    def find(cls, root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> "CgroupV2 | None":
        """The agent's own v2 cgroup if it offers the memory controller and is writable."""
        rel = own_cgroup("", proc_cgroup)
        if rel is None:
            return None
        for mount in (root, root / "unified"):
            parent = mount / rel.lstrip("/")
            if "memory" in _controllers(parent) and os.access(parent, os.W_OK):
                return cls(parent)
        return None

    def _enable(self) -> set[str]:
        """Memory (and cpu) for the children. A cgroup holding processes cannot
        hand controllers down (v2's no-internal-process rule): the agent moves
        itself to a leaf ``tidal-agent`` first."""
        if self.enabled is None:
            want = ["memory"] + (["cpu"] if "cpu" in _controllers(self.parent) else [])
            try:
                self._subtree(want)
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
                leaf = self.parent / f"{PREFIX}agent"
                leaf.mkdir(exist_ok=True)
                (leaf / "cgroup.procs").write_text(str(os.getpid()))
                self._subtree(want)
            self.enabled = set(want)
        return self.enabled

    def _subtree(self, want: list[str]) -> None:
        for c in want:
            (self.parent / "cgroup.subtree_control").write_text(f"+{c}")

    def create(self, key: str, limits: Limits) -> Placement:
        enabled = self._enable()
        d = self.parent / f"{PREFIX}{key}"
        d.mkdir()
        pl = Placement(key, limits, self.name, memory_dir=str(d))
        try:
            if limits.memory:
                (d / "memory.max").write_text(str(limits.memory))
                _try_write(d / "memory.swap.max", "0")
                _try_write(d / "memory.oom.group", "1")  # the whole worker goes, not a random child of it
            if limits.cpus and "cpu" in enabled:
                (d / "cpu.max").write_text(f"{max(1000, round(limits.cpus * PERIOD_US))} {PERIOD_US}")
                pl.cpu = "cpu.max"
        except OSError:
            self.remove(pl)
            raise
        return pl


def _controllers(d: Path) -> set[str]:
    try:
        return set((d / "cgroup.controllers").read_text().split())
    except OSError:
        return set()


class CgroupV1(Backend):
    """Children of the agent's cgroups in the v1 ``memory`` (and ``cpu``) hierarchies."""

    name = "cgroup1"

    def __init__(self, memory_parent: Path, cpu_parent: Path | None = None) -> None:
        self.memory_parent = Path(memory_parent)
        self.cpu_parent = cpu_parent

    @classmethod
    def find(cls, root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> "CgroupV1 | None":
        mem = own_cgroup("memory", proc_cgroup)
        if mem is None:
            return None
        parent = root / "memory" / mem.lstrip("/")
        if not ((parent / "memory.limit_in_bytes").exists() and os.access(parent, os.W_OK)):
            return None
        cpu, cpu_parent = own_cgroup("cpu", proc_cgroup), None
        for name in ("cpu", "cpu,cpuacct"):
            d = root / name / (cpu or "").lstrip("/")
            if cpu is not None and (d / "cpu.cfs_quota_us").exists() and os.access(d, os.W_OK):
                cpu_parent = d
                break
        return cls(parent, cpu_parent)

    def create(self, key: str, limits: Limits) -> Placement:
        pl = Placement(key, limits, self.name)
        try:
            if limits.memory:
                d = self.memory_parent / f"{PREFIX}{key}"
                d.mkdir()
                pl.memory_dir = str(d)
                (d / "memory.limit_in_bytes").write_text(str(limits.memory))
                _try_write(d / "memory.memsw.limit_in_bytes", str(limits.memory))  # no swap beyond it
            if limits.cpus and self.cpu_parent is not None:
                c = self.cpu_parent / f"{PREFIX}{key}"
                c.mkdir()
                pl.cpu_dir = str(c)
                (c / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (c / "cpu.cfs_quota_us").write_text(str(max(1000, round(limits.cpus * PERIOD_US))))
                pl.cpu = "cfs_quota"
        except OSError:
            self.remove(pl)
            raise
        return pl


def detect(mode: str = "auto", root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> Backend | None:
    """The backend for ``$TIDAL_LIMITS`` (``mode``); None for ``off``."""
    if mode not in MODES:
        raise ValueError(f"limits mode {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "off":
        return None
    finders = {"cgroup2": CgroupV2.find, "cgroup1": CgroupV1.find}
    for name in (("cgroup2", "cgroup1") if mode == "auto" else (mode,) if mode in finders else ()):
        found = finders[name](root, proc_cgroup)
        if found is not None:
            return found
        if mode != "auto":
            log.warning("no writable %s memory controller here: limits fall back to the RSS watchdog", name)
    return Backend()


def session_rss(sids: set[int], proc: Path = Path("/proc")) -> dict[int, int]:
    """Resident memory (bytes) of each session in ``sids``: the sum over its
    processes (a worker leads its session; its children are in it)."""
    out = dict.fromkeys(sids, 0)
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            stat = (proc / name / "stat").read_text()
        except OSError:
            continue
        f = stat[stat.rfind(")") + 2:].split()
        if len(f) > 21 and int(f[3]) in out:
            out[int(f[3])] += int(f[21]) * PAGE
    return out


def node_memory(meminfo: Path = Path("/proc/meminfo"), root: Path = CGROUP_ROOT,
                proc_cgroup: Path = PROC_CGROUP) -> int:
    """This node's memory in bytes (0: unknown): ``MemTotal``, or the agent's
    own cgroup limit if lower."""
    total = 0
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    caps = []
    v1, v2 = own_cgroup("memory", proc_cgroup), own_cgroup("", proc_cgroup)
    if v1 is not None:
        caps.append(_read_int(root / "memory" / v1.lstrip("/") / "memory.limit_in_bytes"))
    if v2 is not None:
        caps.append(_read_int(root / v2.lstrip("/") / "memory.max"))
    caps = [c for c in caps if c] + ([total] if total else [])
    return min(caps, default=0)


class Limiter:
    """The agent's side of the limits: places each process, watches it
    (peaks; the watchdog's kills) from one thread, tells whether it ended
    out of memory, and removes its cgroups."""

    def __init__(self, backend: Backend | None, poll_s: float = POLL_S) -> None:
        self.backend = backend  # None: limits off
        self.poll_s = poll_s
        self._watched: dict[str, tuple[Placement, Handle]] = {}  # key -> (placement, its process)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_cpu = 0

    @classmethod
    def detect(cls, mode: str = "auto") -> "Limiter":
        backend = detect(mode)
        log.info("per-worker limits: %s", backend.name if backend else "off")
        return cls(backend)

    def place(self, key: str, limits: Limits) -> Placement | None:
        """A placement for a process about to start (None: no limits)."""
        if not limits or self.backend is None:
            return None
        try:
            return self.backend.create(key, limits)
        except OSError as e:
            log.warning("no cgroup for %s (%s): its memory is watched instead", key, e)
            return Placement(key, limits, "watchdog")

    @staticmethod
    def wrap(pl: Placement | None, argv: list[str]) -> list[str]:
        """``argv`` started inside the placement's cgroups."""
        files = pl.procs_files() if pl is not None else []
        return ["/bin/sh", "-c", _ENTER, "tidal-limits", *files, "--", *argv] if files else list(argv)

    def started(self, pl: Placement | None, handle: Handle) -> None:
        """The process runs: it is in its cgroups (written again here), pinned if
        its CPUs have no controller, and watched."""
        if pl is None:
            return
        for f in pl.procs_files():
            _try_write(Path(f), str(handle.pid))
        if pl.limits.cpus and pl.cpu == "none":
            self._pin(pl, handle.pid)
        self.watch(pl, handle)

    def watch(self, pl: Placement | None, handle: Handle) -> None:
        if pl is None:
            return
        with self._lock:
            self._watched[pl.key] = (pl, handle)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tidal-limits", daemon=True)
                self._thread.start()

    def finished(self, pl: Placement | None, exit_code: int | None) -> dict[str, Any] | None:
        """The process ended: its cgroups go; the OOM report if it ran out of
        memory (``limit`` and ``peak`` in bytes, ``backend``), else None."""
        if pl is None:
            return None
        with self._lock:
            self._watched.pop(pl.key, None)
        oom, peak = pl.oom_killed(exit_code), pl.peak_bytes()
        self.release(pl)
        if not oom:
            return None
        log.warning("%s ran out of memory: limit %d MiB, peak %d MiB (%s)", pl.key, pl.limits.memory >> 20,
                    peak >> 20, pl.backend)
        return {"limit": pl.limits.memory, "peak": peak, "backend": pl.backend}

    @staticmethod
    def release(pl: Placement | None) -> None:
        """Remove the placement's cgroups (after its process ended, or a failed launch)."""
        if pl is not None:
            Backend().remove(pl)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _pin(self, pl: Placement, pid: int) -> None:
        """No cpu controller: pin every thread of the process to ``ceil(cpus)``
        CPUs, taken round robin so that workers spread."""
        cpus = sorted(os.sched_getaffinity(0))
        n = min(len(cpus), math.ceil(pl.limits.cpus))
        chosen = {cpus[(self._next_cpu + i) % len(cpus)] for i in range(n)}
        self._next_cpu += n
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), chosen)
            pl.cpu = "affinity"
        except OSError as e:
            log.warning("cannot pin %s to CPUs %s: %s", pl.key, sorted(chosen), e)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - the watch goes on
                log.exception("limits watch failed")

    def sample(self) -> None:
        """One look at every watched process: its peak; the watchdog kills a
        process over its memory limit (its whole session, SIGKILL)."""
        with self._lock:
            items = list(self._watched.values())
        dog = [h.pid for pl, h in items if pl.backend == "watchdog" and pl.limits.memory]
        rss = session_rss(set(dog)) if dog else {}
        for pl, h in items:
            used = rss.get(h.pid) if pl.backend == "watchdog" else pl.usage()
            if not used:
                continue
            pl.peak = max(pl.peak, used)
            if pl.backend == "watchdog" and pl.limits.memory and used > pl.limits.memory and not pl.killed:
                if h.poll() is None:
                    pl.killed = True
                    log.warning("%s uses %d MiB, over its limit of %d MiB: killing it", pl.key, used >> 20,
                                pl.limits.memory >> 20)
                    h.kill()
