"""Hung-worker detection from the workers' liveness beats.

Every worker beats ``[n, step, phase]`` into the job's store; the master
reads the beats periodically (:meth:`HealthMonitor.observe`, on its
monotonic clock) and finds the members that hang (:meth:`HealthMonitor.hung`):
a member whose beat did not change for ``hang_timeout_s`` (e.g. a stopped
process), or that has been in the compute phase of a step for that long
while a peer waits in the all-reduce of the same step. Killing it makes its
peers' collective fail at once, so the usual recovery (a forced scale-in,
EDL §4.2) runs instead of waiting for the process group's timeout.

A member whose beats stopped for ``silent_timeout_s`` (``$TIDAL_SILENT_TIMEOUT_S``)
while a peer still beats is *cut off* (:meth:`HealthMonitor.cut_off`): a
silent host may not be killable, so besides the kill the master aborts the
generation and the others leave their collective
(:mod:`tidal.runtime.abortable`). The no-beat rule of :meth:`HealthMonitor.hung`
uses the smaller of the two timeouts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from tidal import settings
from tidal.net import LOOPBACK

if TYPE_CHECKING:
    from tidal.runtime.spawner import Spawner

LOCAL_HOSTS = ("localhost", LOOPBACK)


@dataclass
class _Beat:
    """What the monitor last saw of one worker: its raw beat, when it last
    changed, its (step, phase) and since when."""

    raw: bytes | None
    changed: float
    state: tuple[int, str] | None
    since: float


class HealthMonitor:
    """Liveness clocks of a job's members. Owned by the master's periodic
    step (under the master's lock); ``hang_timeout_s`` 0 never judges."""

    def __init__(self, hang_timeout_s: float, silent_timeout_s: float | None = None) -> None:
        self.hang_timeout_s = float(hang_timeout_s)
        self.silent_timeout_s = float(settings.SILENT_TIMEOUT_S.get() if silent_timeout_s is None
                                      else silent_timeout_s)
        self._beats: dict[str, _Beat] = {}
        self._last: float | None = None

    @property
    def observed_at(self) -> float | None:
        """When :meth:`observe` last ran (the master's monotonic clock)."""
        return self._last

    @property
    def no_beat_s(self) -> float:
        """How long a member may go without a beat before it is judged
        (the smaller positive timeout; 0: never)."""
        return min((t for t in (self.hang_timeout_s, self.silent_timeout_s) if t > 0), default=0.0)

    def observe(self, beats: Mapping[str, bytes | None], now: float) -> None:
        """Take the members' current raw beats (None: never beat) at ``now``."""
        if self._last is not None and now - self._last > (self.no_beat_s or self.hang_timeout_s) / 2:
            # this check itself did not run for a while (the host stalled, the lock was
            # held): what looks like silence may be ours, so start the clocks again
            for b in self._beats.values():
                b.changed = b.since = now
        self._last = now
        for w, raw in beats.items():
            b = self._beats.get(w)
            if b is None:
                b = self._beats[w] = _Beat(raw, now, None, now)
            if raw != b.raw:
                b.raw, b.changed = raw, now
            if raw is not None:
                beat = json.loads(raw)
                state = (int(beat[1]), str(beat[2]))
                if state != b.state:
                    b.state, b.since = state, now

    def hung(self, members: Iterable[str], gone: set[str], leaving: set[str], now: float) -> list[tuple[str, str]]:
        """``(worker, why)`` for the hung ``members``; ``gone`` were killed
        already, ``leaving`` leave at the next switch (neither is judged)."""
        if self.hang_timeout_s <= 0:
            return []
        members = list(members)
        waiting: dict[int, float] = {}  # step -> since when a peer waits in its all-reduce
        for w in members:
            st = self._beats[w].state
            if st is not None and st[1] == "sync":
                waiting[st[0]] = min(waiting.get(st[0], now), self._beats[w].since)
        found: list[tuple[str, str]] = []
        for w in members:
            b = self._beats[w]
            if w in gone or w in leaving or b.raw is None:
                continue  # never beat (e.g. a newcomer still receiving its state): not judged
            if now - b.changed > (self.no_beat_s or self.hang_timeout_s):
                found.append((w, f"no liveness beat for {now - b.changed:.1f}s"))
            elif b.state is not None and b.state[1] == "compute" and b.state[0] in waiting \
                    and now - waiting[b.state[0]] > self.hang_timeout_s:
                found.append((w, f"in compute of step {b.state[0]} while a peer waited "
                                 f"{now - waiting[b.state[0]]:.1f}s in the all-reduce"))
        if len(found) == len([w for w in members if w not in gone]):
            return []  # everyone silent at once: the master's view is stale (e.g. it just restarted), not a hang
        return found

    def cut_off(self, members: Iterable[str], leaving: set[str], now: float) -> dict[str, float]:
        """Members (not ``leaving``) whose beat stopped more than
        ``silent_timeout_s`` ago, with how long, while another member beat
        within the last 3 s: its host went silent (a cut link, a stopped or
        dead machine). None while every member is quiet: then the master's
        own view is stale (it stalled, or it was cut off itself)."""
        if self.silent_timeout_s <= 0:
            return {}
        quiet = {w: now - b.changed for w in members if w not in leaving
                 and (b := self._beats.get(w)) is not None and b.raw is not None}
        cut = {w: q for w, q in quiet.items() if q > self.silent_timeout_s}
        return cut if cut and any(q <= 3.0 for q in quiet.values()) else {}

    def silent(self, now: float, quiet_s: float = 3.0, phase: str | None = None) -> set[str]:
        """Workers that have beaten before but not in the last ``quiet_s``
        seconds (as last observed): a recovery does not wait for their report;
        with ``phase``, only those last seen in it (``"join"``: lost before
        their first step)."""
        return {w for w, b in self._beats.items() if b.raw is not None and now - b.changed > quiet_s
                and (phase is None or (b.state is not None and b.state[1] == phase))}


def _is_worker(pid: int, worker_id: str) -> bool:
    """Whether process ``pid`` still is worker ``worker_id`` (its environment
    names it), so a reused pid is never killed. Linux ``/proc`` only."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return False
    return f"{settings.WORKER_ID.name}={worker_id}".encode() in env


def kill_worker(spawner: "Spawner | None", worker_id: str, info: Mapping[str, Any]) -> str:
    """Stop a hung worker for good: through the spawner if there is one,
    else by pid when it runs on this host (``info``: its registration).
    Returns what was done, for the record."""
    try:
        if spawner is not None:
            spawner.kill(worker_id)
            return "killed"
        pid = int(info.get("pid") or 0)
        if pid and info.get("host") in (socket.gethostname(), *LOCAL_HOSTS) and _is_worker(pid, worker_id):
            os.kill(pid, signal.SIGKILL)
            return "killed"
    except (OSError, RuntimeError) as e:
        return f"kill failed: {e}"
    return "reported (cannot kill it from here)"
