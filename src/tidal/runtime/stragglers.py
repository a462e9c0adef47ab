"""Straggler detection (issue 5, item 3; EDL §5.2, DLRover §5.4).

Every rank's *compute* time of a step (batch start to ``job.step()``, i.e.
forward and backward, without the all-reduce) travels in the control tensor
that is reduced with the gradients anyway, so rank 0 sees all of them at no
extra collective. A rank slower than ``factor`` × the median for ``window``
consecutive steps is reported to the master once per generation; the master's
policy then reports it only or removes it by scale-in (EDL §5.2).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class StragglerConfig:
    """``factor`` × median compute time (and ``min_excess_s`` more) for
    ``window`` consecutive steps."""

    factor: float = 1.2
    window: int = 10
    # optionally also this much slower in absolute terms (0: EDL's relative rule only)
    min_excess_s: float = 0.0


@dataclass
class StragglerDetector:
    """Feed one list of per-rank compute times per step; returns the ranks
    that just crossed the threshold (each reported once until :meth:`reset`)."""

    config: StragglerConfig = field(default_factory=StragglerConfig)
    streak: dict[int, int] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)

    def reset(self) -> None:
        """Start over (a new generation: ranks and shares changed)."""
        self.streak.clear()
        self.reported.clear()

    def update(self, times: Sequence[float]) -> list[tuple[int, float]]:
        """``times[r]``: rank ``r``'s compute time of this step. Returns
        ``[(rank, ratio to the median)]`` of newly detected stragglers."""
        if len(times) < 2:
            return []
        med = statistics.median(times)
        out: list[tuple[int, float]] = []
        for r, t in enumerate(times):
            slow = med > 0 and t > self.config.factor * med and t - med > self.config.min_excess_s
            self.streak[r] = self.streak.get(r, 0) + 1 if slow else 0
            if self.streak[r] >= self.config.window and r not in self.reported:
                self.reported.add(r)
                out.append((r, t / med))
        return out
