"""Where parameter servers run: threads of this process (tests, small jobs) or
processes of this host. A launcher starts a server with an id, a number of
handler threads and the job's checkpoint directory, and can kill it."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from typing import Protocol

from tidal.ps.server import PSServer

log = logging.getLogger(__name__)


class PSHandle(Protocol):
    id: str
    addr: str
    threads: int

    def kill(self) -> None:
        """Ends the server at once, losing its memory (a crash)."""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Waits for a server told to ``shutdown`` to end (killing it after ``timeout_s``)."""

    def alive(self) -> bool:
        """False once the server is gone."""


class Launcher(Protocol):
    def start(self, ps_id: str, threads: int, ckpt_dir: str) -> PSHandle:
        """A new, idle server."""

    def close(self) -> None:
        """Ends every server this launcher started."""


class _ThreadPS:
    def __init__(self, srv: PSServer) -> None:
        self.srv, self.id, self.addr, self.threads = srv, srv.id, srv.addr, srv.threads

    def kill(self) -> None:
        self.srv.close(abort=True)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.srv.close()

    def alive(self) -> bool:
        return not self.srv.stopped.is_set()


class ThreadLauncher:
    """Servers in this process; ``work_s`` maps a server id to a simulated
    per-request service time (a slow host)."""

    def __init__(self, work_s: dict[str, float] | None = None) -> None:
        self.work_s = dict(work_s or {})
        self.started: list[_ThreadPS] = []

    def start(self, ps_id: str, threads: int, ckpt_dir: str) -> PSHandle:
        h = _ThreadPS(PSServer(ps_id, ckpt_dir, threads=threads, work_s=self.work_s.get(ps_id, 0.0)))
        self.started.append(h)
        return h

    def close(self) -> None:
        for h in self.started:
            h.stop()
        self.started = []


class _ProcessPS:
    def __init__(self, ps_id: str, threads: int, proc: subprocess.Popen[str], addr: str) -> None:
        self.id, self.threads, self.proc, self.addr = ps_id, threads, proc, addr

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("parameter server %s did not stop within %.0f s; killing it", self.id, timeout_s)
        self.kill()

    def alive(self) -> bool:
        return self.proc.poll() is None


class ProcessLauncher:
    """Servers as processes of this host (``python -m tidal.ps``)."""

    def __init__(self, start_timeout_s: float = 60.0) -> None:
        self.start_timeout_s = start_timeout_s
        self.started: list[_ProcessPS] = []

    def start(self, ps_id: str, threads: int, ckpt_dir: str) -> PSHandle:
        cmd = [sys.executable, "-m", "tidal.ps", "--id", ps_id, "--threads", str(threads),
               "--ckpt", ckpt_dir]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline() if proc.stdout else ""),
                                  daemon=True)
        reader.start()
        reader.join(self.start_timeout_s)
        if not line or not line[0].startswith("PS_ADDR "):
            proc.kill()
            proc.wait()
            reader.join(5)
            if proc.stdout:
                proc.stdout.close()
            raise RuntimeError(f"parameter server {ps_id} did not start (exit {proc.poll()})")
        h = _ProcessPS(ps_id, threads, proc, line[0].split()[1])
        self.started.append(h)
        return h

    def close(self) -> None:
        """Kills the servers still running (the master asked them to shut down first)."""
        for h in self.started:
            h.stop(timeout_s=5.0)
        self.started = []
