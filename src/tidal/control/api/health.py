"""Health of a server replica, for load balancers and Kubernetes probes.

* ``GET /healthz`` — liveness: the process serves HTTP. Always 200 and no
  I/O; it says whether this replica leads and, if so, how long its
  scheduling loop has gone without a round (``loop_age_s``).
* ``GET /readyz`` — readiness: 200 when the store answers a trivial query
  within ``TIDAL_READY_DB_TIMEOUT_S`` and, on the leader, the scheduling loop
  started a round within its bound (``TIDAL_READY_LOOP_S``, at least 5 ticks;
  :class:`tidal.control.leader.LoopClock`); otherwise 503 with the reasons.
  Neither needs a token and neither says more than this (docs/security.md):
  a store error is named by its type; the details go to the server's log.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

from tidal.control.db import Store

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


class _Answer:
    """One probe query's outcome, filled in by its thread."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error = ""
        self.ms = 0.0


class DbProbe:
    """``SELECT 1`` on the store, waited for at most ``timeout_s``. At most one
    query is in flight: a probe that finds the last one still hanging (a
    silent database) waits on it instead of piling up threads."""

    def __init__(self, store: Store, timeout_s: float) -> None:
        self.store, self.timeout_s = store, timeout_s
        self._lock = threading.Lock()
        self._current: _Answer | None = None

    def check(self) -> tuple[str, float]:
        """``("ok", ms)``, or the reason the store did not answer."""
        with self._lock:
            ans = self._current
            if ans is None or ans.done.is_set():
                ans = self._current = _Answer()
                threading.Thread(target=self._query, args=(ans,), name="tidal-db-probe", daemon=True).start()
        if not ans.done.wait(self.timeout_s):
            return f"no answer from the store within {self.timeout_s:g} s", 1e3 * self.timeout_s
        return (ans.error or "ok"), ans.ms

    def _query(self, ans: _Answer) -> None:
        t0 = time.perf_counter()
        try:
            with self.store.session(write=False) as s:
                s.execute(text("SELECT 1"))
        except Exception as e:  # noqa: BLE001 - the answer is the error
            # the details (addresses, names) go to the log only: the endpoint needs no token
            log.warning("readiness: the store answered with an error: %s", e)
            ans.error = f"store error: {type(e).__name__}"
        ans.ms = 1e3 * (time.perf_counter() - t0)
        ans.done.set()


def _loop_age(request: Request) -> tuple[bool, float | None]:
    """Whether this replica leads, and its loop's age then (None when following)."""
    state = request.app.state
    leading = bool(state.elector.is_leading)
    return leading, (round(state.loop_clock.age(), 2) if leading else None)


@router.get("/healthz")
def healthz(request: Request) -> dict[str, Any]:
    """Liveness: up. ``leader`` (= ``leading``): whether this replica schedules
    (the others serve the API); ``loop_age_s``: seconds since its loop began a round."""
    leading, age = _loop_age(request)
    return {"status": "ok", "leader": leading, "leading": leading, "loop_age_s": age}


@router.get("/readyz", response_model=None)
def readyz(request: Request) -> dict[str, Any] | JSONResponse:
    """Readiness: the store answers and, when leading, the loop goes round; else 503."""
    state = request.app.state
    db, db_ms = state.db_probe.check()
    leading, age = _loop_age(request)
    reasons = [] if db == "ok" else [db]
    bound = state.loop_clock.bound_s
    if age is not None and age > bound:
        reasons.append(f"the scheduling loop started no round for {age:.0f} s (bound {bound:g} s)")
    body = {"status": "ready" if not reasons else "unready", "leading": leading, "db": db,
            "db_ms": round(db_ms, 1), "loop_age_s": age, "reasons": reasons}
    if reasons:
        log.warning("not ready: %s", "; ".join(reasons))
        return JSONResponse(status_code=503, content=body)
    return body
