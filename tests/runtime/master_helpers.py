"""A recording :class:`~tidal.runtime.spawner.Spawner` for tests that drive a
JobMaster in-process (not collected by pytest)."""

from __future__ import annotations

from typing import Sequence

from tidal.runtime.spawner import WorkerLaunch


class RecordingSpawner:
    """Starts nothing: records every ``spawn`` call (worker ids and hosts) and
    every ``kill``; ``codes`` are the exit codes ``exit_codes()`` reports
    (None: running), which a test may set to make a worker fail."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.hosts: list[list[str | None]] = []
        self.killed: list[str] = []
        self.codes: dict[str, int | None] = {}

    @property
    def started(self) -> list[str]:
        """Every worker id started, in order."""
        return [w for call in self.calls for w in call]

    def spawn(self, launches: Sequence[WorkerLaunch]) -> None:
        self.calls.append([x.worker_id for x in launches])
        self.hosts.append([x.host for x in launches])
        for x in launches:
            self.codes[x.worker_id] = None

    def kill(self, worker_id: str) -> None:
        self.killed.append(worker_id)

    def exit_codes(self) -> dict[str, int | None]:
        return dict(self.codes)
