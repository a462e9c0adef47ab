"""The agent's process table, kept on disk so that a restarted agent adopts
the processes it launched before instead of launching them a second time.

``procs.json`` in the agent's work directory is rewritten atomically (a
temporary file, then ``os.replace``) whenever it changes: after a launch,
after an exit is seen, and after each heartbeat (the log offsets). It holds,
per process row, the job, name and kind, the pid, the process's start time
(field 22 of ``/proc/PID/stat``, in clock ticks since boot), the log file and
how much of it was shipped, the master restarts so far, the gate file,
the GPU and its limits (the cgroups made for it, so that a restarted agent
still watches them and removes them); plus the exit reports the server has not acknowledged yet, and the
machine's boot id. Neither the argv nor the environment is written (a job
master's environment holds its credential).

Adoption rule: a recorded process is adopted when the machine did not reboot
(same boot id) and a live process with the same pid has the same start time;
a recycled pid (another start time), a zombie or a missing pid is not ours.
An adopted process is not this agent's child, so its exit code cannot be
collected: once it is gone, :meth:`Handle.poll` answers :data:`EXIT_UNKNOWN`
and the agent reports it ``failed`` with ``exit_code`` None.

Linux only: where there is no ``/proc`` no start time is known and nothing is
adopted.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.agent.limits import Placement

log = logging.getLogger("tidal.agent")

#: what :meth:`Handle.poll` answers for a process that ended with an exit code
#: nobody can know (an adopted one); outside Popen's range (0..255, -1..-64)
EXIT_UNKNOWN = -256

BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot of the machine ("" where unknown)."""
    try:
        return BOOT_ID_FILE.read_text().strip()
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None if there
    is no such live process (a zombie is not live)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


class Handle(ABC):
    """A process the agent runs: its own child or an adopted one. Signals go
    to the process's group (it leads its own session), and only while the
    process is known to be alive, so a recycled pid is never signalled."""

    pid: int
    started: int | None

    @abstractmethod
    def poll(self) -> int | None:
        """None while it runs; then its exit code (-N: killed by signal N),
        or :data:`EXIT_UNKNOWN`."""

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:  # it left its group: the process alone
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def read_log(self, path: Path, offset: int, limit: int) -> bytes:
        """Up to ``limit`` bytes of its log from ``offset`` (b"" if there is
        none yet). Here the file on this machine; a handle to a process on
        another machine may fetch it from there."""
        try:
            with path.open("rb") as fh:
                fh.seek(offset)
                return fh.read(limit)
        except FileNotFoundError:
            return b""

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code once it ended (``subprocess.TimeoutExpired`` after ``timeout`` s)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.05)
        return code


class Child(Handle):
    """A process this agent launched (``subprocess.Popen``)."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.started = start_time(popen.pid)  # our unreaped child: the pid cannot be recycled yet

    def poll(self) -> int | None:
        return self.popen.poll()


class Adopted(Handle):
    """A process a previous run of this agent launched, alive as long as its
    pid names a process with its start time."""

    def __init__(self, pid: int, started: int | None, alive: bool = True) -> None:
        self.pid, self.started = pid, started
        self._gone = not alive or started is None

    def poll(self) -> int | None:
        if not self._gone and start_time(self.pid) != self.started:
            self._gone = True
        return EXIT_UNKNOWN if self._gone else None


@dataclass
class Proc:
    """One process row the agent runs."""

    id: int
    job: str
    name: str
    kind: str
    handle: Handle
    log_path: Path
    offset: int = 0  # how much of the log the server has
    gpu: str = "-1"
    gate: str | None = None
    restarts: int = 0  # of a job master, here
    spec: dict[str, Any] = field(default_factory=dict)  # the server's row it was launched from (not kept on disk)
    limits: Placement | None = None  # its memory and CPU limits (tidal.agent.limits)
    reported: str = ""
    stop_sent: float = 0.0
    error: str = ""  # why it ended, when its exit code does not say (e.g. its restart failed); not kept on disk

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "job": self.job, "name": self.name, "kind": self.kind, "pid": self.handle.pid,
                "start_time": self.handle.started, "log": str(self.log_path), "offset": self.offset,
                "gpu": self.gpu, "gate": self.gate, "restarts": self.restarts,
                "limits": self.limits.record() if self.limits is not None else None}

    @classmethod
    def adopt(cls, r: dict[str, Any], same_boot: bool) -> "Proc":
        """The process of a record, adopted if it is still the same process
        (else its handle reports it gone)."""
        pid, started = int(r["pid"]), r.get("start_time")
        alive = same_boot and started is not None and start_time(pid) == int(started)
        return cls(int(r["id"]), str(r["job"]), str(r["name"]), str(r.get("kind", "worker")),
                   Adopted(pid, None if started is None else int(started), alive), Path(r["log"]),
                   offset=int(r.get("offset", 0)), gpu=str(r.get("gpu", "-1")), gate=r.get("gate"),
                   restarts=int(r.get("restarts", 0)), limits=Placement.from_record(r.get("limits")))


class ProcTable:
    """``procs.json``: the processes and the unacknowledged exit reports."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._written = ""

    def save(self, procs: dict[int, Proc], finished: dict[int, dict[str, Any]]) -> None:
        """Write the table if it changed (atomically, readable by this user only)."""
        text = json.dumps({"boot_id": boot_id(), "procs": [p.record() for p in procs.values()],
                           "finished": list(finished.values())}, sort_keys=True)
        if text == self._written:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, self.path)
        self._written = text

    def load(self) -> tuple[dict[int, Proc], dict[int, dict[str, Any]]]:
        """The recorded processes (adopted, or gone: see :class:`Adopted`) and
        exit reports; nothing if there is no readable table."""
        try:
            doc = json.loads(self.path.read_text())
            same_boot = bool(doc.get("boot_id")) and doc.get("boot_id") == boot_id()
            procs = {int(r["id"]): Proc.adopt(r, same_boot) for r in doc.get("procs", [])}
            finished = {int(r["id"]): dict(r) for r in doc.get("finished", [])}
        except FileNotFoundError:
            return {}, {}
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.error("process table %s unreadable (%s): no process adopted", self.path, e)
            return {}, {}
        for p in procs.values():
            alive = p.handle.poll() is None
            log.info("%s %s/%s (pid %d) from the process table", "adopted" if alive else "lost track of",
                     p.job, p.name, p.handle.pid)
        return procs, finished
