"""Rescale overhead model, per event.

Two mechanisms (EDL §4.2 and Fig. 4b; Elan §V-B):
- ``stop-resume``: checkpoint, stop every worker, relaunch at the new size and
  load. The whole job makes no progress for ``stop_resume_s`` (EDL measured
  40-60 s on TensorFlow; torchrun restarts are of the same order).
- ``stop-free``: newcomers start and warm up for ``warmup_s`` while the old
  workers keep training; then all workers pause ``pause_s`` (< 1 s) to switch
  process groups and copy state. Scale-in costs one ``pause_s``.

A suspended (preempted) job always pays ``stop_resume_s`` when it restarts, and
a fresh start pays ``launch_s``. The runtime's measured figures go in as the
fields (``pause_s``, ``stop_resume_s``, ``warmup_s``).
"""

from __future__ import annotations

from dataclasses import dataclass

Segments = tuple[tuple[float, float], ...]  # (start time, progress rate), rate 0 = paused


@dataclass(frozen=True)
class OverheadModel:
    mode: str = "stop-free"  # or "stop-resume"
    stop_resume_s: float = 50.0
    pause_s: float = 0.5
    warmup_s: float = 10.0
    launch_s: float = 0.0
    migrate_s: float | None = None  # default: the same as a rescale in this mode

    def __post_init__(self) -> None:
        if self.mode not in ("stop-free", "stop-resume"):
            raise ValueError(f"overhead mode must be 'stop-free' or 'stop-resume', got {self.mode!r}")

    def start(self, now: float, rate: float, resumed: bool) -> Segments:
        delay = self.stop_resume_s if resumed else self.launch_s
        return ((now, 0.0), (now + delay, rate)) if delay > 0 else ((now, rate),)

    def resize(self, now: float, old_rate: float, new_rate: float, grow: bool) -> Segments:
        """Progress segments of a running job whose GPU count changes now."""
        if self.mode == "stop-resume":
            return ((now, 0.0), (now + self.stop_resume_s, new_rate))
        if grow and self.warmup_s > 0:
            t = now + self.warmup_s
            return ((now, old_rate), (t, 0.0), (t + self.pause_s, new_rate))
        return ((now, 0.0), (now + self.pause_s, new_rate))

    def migrate(self, now: float, new_rate: float) -> Segments:
        delay = self.migrate_s if self.migrate_s is not None else (
            self.stop_resume_s if self.mode == "stop-resume" else self.warmup_s + self.pause_s
        )
        return ((now, 0.0), (now + delay, new_rate))
