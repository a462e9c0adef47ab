"""Moving rows between parameter servers, and spotting a hot one.

A repartition from layout ``old`` to ``new`` (docs/ps.md, "Repartition"):

1. freeze every server of ``old``: from then on pushes and pulls get
   ``retry``; a push applied before the freeze is in the rows that move;
2. every server of ``new`` allocates its new rows (copying those it keeps);
3. every server of ``old`` sends the rows it gives up to their new holders;
4. every server of ``new`` switches to its new rows and writes a checkpoint;
   servers not in ``new`` retire. Workers then resend what was refused,
   routed by ``new``. Every update is applied once: before the freeze (and
   moved with its rows) or after the commit (by the new holder).

If a step before 4 fails, the old servers are unfrozen (``ready``) and keep
serving the old layout; the error is raised.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from tidal.ps.layout import Layout

Call = Callable[[str, str, dict[str, Any]], dict[str, Any]]
log = logging.getLogger(__name__)


def _each(call: Call, servers: list[str], op: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        answers = list(pool.map(lambda ps: call(ps, op, body), servers))
    for ps, a in zip(servers, answers):
        if a.get("status") != "ok":
            raise RuntimeError(f"repartition: {op} on {ps} failed: {a}")
    return answers


def repartition(old: Layout, new: Layout, call: Call) -> tuple[dict[str, float], dict[str, dict[str, list[int]]]]:
    """Runs the four steps; ``call(ps, op, body)`` reaches a server of either
    layout. Returns the pause (freeze to last commit) and its parts in ms, and
    each retired server's deduplication marks (``worker -> [seq, k]``)."""
    t0 = time.perf_counter()
    body = {"layout": new.to_json()}
    try:
        _each(call, old.servers, "freeze", {})
        _each(call, new.servers, "prepare", body)
        t1 = time.perf_counter()
        _each(call, old.servers, "send_rows", body)
    except Exception:
        _unfreeze(call, old.servers)
        raise
    t2 = time.perf_counter()
    _each(call, new.servers, "commit", body)
    t3 = time.perf_counter()
    gone = [ps for ps in old.servers if ps not in new.servers]
    answers = _each(call, gone, "commit", body) if gone else []
    t4 = time.perf_counter()
    timing = {"pause_ms": (t3 - t0) * 1e3, "prepare_ms": (t1 - t0) * 1e3, "move_ms": (t2 - t1) * 1e3,
              "commit_checkpoint_ms": (t3 - t2) * 1e3, "retire_ms": (t4 - t3) * 1e3}
    return timing, {ps: a.get("last", {}) for ps, a in zip(gone, answers)}


def _unfreeze(call: Call, servers: list[str]) -> None:
    """After a failed step 1-3: the old layout serves again (best effort per server)."""
    for ps in servers:
        try:
            call(ps, "ready", {})
        except Exception:  # noqa: BLE001 - the first error is the one raised
            log.exception("repartition rollback: %s could not be unfrozen", ps)


@dataclass
class HotDetector:
    """A server is hot when its mean queue delay over the last window is above
    ``delay_s`` and ``ratio`` times the median of the others (alone: above
    ``delay_s``), or its CPU use is above ``cpu`` cores."""

    delay_s: float = 0.05
    ratio: float = 3.0
    cpu: float = float("inf")
    _prev: dict[str, tuple[float, dict[str, float]]] = field(default_factory=dict)
    window: dict[str, dict[str, float]] = field(default_factory=dict)

    def observe(self, ps: str, stats: dict[str, float]) -> None:
        """Feeds one ``stats`` answer; keeps the delta to the previous one."""
        now = time.monotonic()
        prev = self._prev.get(ps)
        self._prev[ps] = (now, stats)
        if prev is None:
            return
        t, p = prev
        served = stats["served"] - p["served"]
        self.window[ps] = {"delay_s": (stats["delay_sum"] - p["delay_sum"]) / served if served else 0.0,
                           "cpu": (stats["cpu_s"] - p["cpu_s"]) / max(1e-6, now - t), "served": served}

    def forget(self, ps: str) -> None:
        self._prev.pop(ps, None)
        self.window.pop(ps, None)

    def hot(self) -> str | None:
        """The hottest server by queue delay, if it passes the test; else None."""
        if not self.window:
            return None
        ps = max(self.window, key=lambda k: self.window[k]["delay_s"])
        d = self.window[ps]["delay_s"]
        others = sorted(v["delay_s"] for k, v in self.window.items() if k != ps)
        median = others[len(others) // 2] if others else 0.0
        if d > self.delay_s and d > self.ratio * median:
            return ps
        cpu_hot = [k for k, v in self.window.items() if v["cpu"] > self.cpu]
        return cpu_hot[0] if cpu_hot else None
