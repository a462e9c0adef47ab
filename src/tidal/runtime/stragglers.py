"""Straggler detection and the master's straggler policy (EDL §5.2, DLRover §5.4).

Every rank's *compute* time of a step (batch start to ``job.step()``, i.e.
forward and backward, without the all-reduce) travels in the control tensor
that is reduced with the gradients anyway, so rank 0 sees all of them at no
extra collective. A rank slower than ``factor`` × the median for ``window``
consecutive steps is reported to the master once per generation; the master's
policy (:func:`decide`) then reports it only, removes it by scale-in, replaces
it by a fresh worker (a migration) or gives it a smaller share of the global
batch (EDL §5.2).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from tidal.runtime.messages import Generation, ScaleAnswer

log = logging.getLogger(__name__)

STRAGGLER_POLICIES = ("report", "remove", "replace", "share")
_DONE = {"remove": "removed", "replace": "replaced", "share": "smaller share"}


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


def check_policy(policy: str) -> str:
    """``policy`` if it is one of :data:`STRAGGLER_POLICIES`, else ValueError."""
    if policy not in STRAGGLER_POLICIES:
        raise ValueError(f"straggler_policy must be one of {list(STRAGGLER_POLICIES)}, not {policy!r}")
    return policy


@dataclass(frozen=True)
class StragglerAction:
    """What the master does about one straggler: ``policy`` "report"
    (nothing more), "remove" (scale in ``rank``), "replace" (migrate
    ``rank``) or "share" (give it the batch share ``share``)."""

    policy: str
    worker_id: str = ""
    rank: int = -1
    share: float = 1.0

    def outcome(self, answer: ScaleAnswer) -> str:
        """The record's action once the master answered the change."""
        done = _DONE[self.policy]
        return done if answer.accepted else f"not {done}: {answer.message}"


def decide(policy: str, worker_id: str, gen: int, ratio: float, current: Generation | None) -> StragglerAction:
    """The policy's action for ``worker_id``, found ``ratio`` times slower
    than the median in generation ``gen``: only for a member of the current
    generation, else (and for "report") just the record. The "share" policy
    divides its share by the slowdown (compute time ~ local batch)."""
    if policy == "report" or current is None or gen != current.gen or worker_id not in current.members:
        return StragglerAction("report")
    r = current.rank_of(worker_id)
    cur = current.shares[r] if current.shares else 1.0
    return StragglerAction(policy, worker_id, r, cur / max(float(ratio), 1.0))


def record_straggler(records: list[dict[str, Any]], worker_id: str, gen: int, step: int, ratio: float,
                     detected_at: float | None, now: float | None = None) -> dict[str, Any] | None:
    """Append the master's record of a reported straggler (``Status.stragglers``)
    to ``records`` and return it; None for a retried report (one per generation)."""
    if any(s["worker_id"] == worker_id and s["gen"] == gen for s in records):
        return None
    now = time.time() if now is None else now
    rec = {"worker_id": worker_id, "gen": int(gen), "step": int(step), "ratio": float(ratio),
           "detected_at": float(detected_at or now), "reported_at": now, "action": "reported"}
    records.append(rec)
    log.warning("straggler %s in gen %d at step %d (%.2fx the median)", worker_id, gen, step, ratio)
    return rec
