"""The dashboard's routes: the page and its assets (no token: they hold no
data), and its JSON views and live stream, which take a bearer token through
the public API's dependencies (:mod:`tidal.control.api.deps`): a tenant sees
its own jobs, the admin all; a bad token is a 401 and the page shows its
login form again. Hidden from the OpenAPI schema: the page is their client."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from importlib import resources
from typing import Annotated, Any, AsyncIterator

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse

from tidal.control.api.deps import CoordinatorDep, JobId, LogsDirDep, Principal, StoreDep, UserDep, principal
from tidal.control.dashboard.jobpage import job_detail
from tidal.control.dashboard.views import me, overview
from tidal.control.promstats import DecisionLog

log = logging.getLogger(__name__)

router = APIRouter(prefix="/dashboard", include_in_schema=False)

#: the page's files and their types (nothing else is served from the package)
ASSETS = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "charts.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
#: no inline script, no third-party origin, no framing
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY",
}
NO_STORE = {"Cache-Control": "no-store"}
#: the stream's period; an unchanged snapshot is sent again at least every KEEPALIVE_S
PERIOD_S, KEEPALIVE_S = 1.0, 15.0
#: the stream checks its token again this often (a rotated token ends it)
RECHECK_S = 10.0
StreamJob = Annotated[str | None, Query(max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")]


def _asset(name: str) -> Response:
    body = (resources.files(__package__) / "static" / name).read_bytes()
    return Response(body, media_type=ASSETS[name], headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})


@router.get("")
def root() -> RedirectResponse:
    return RedirectResponse("/dashboard/", status_code=307)


@router.get("/")
def page() -> Response:
    """The single page (login form and views)."""
    return _asset("index.html")


@router.get("/static/{name}")
def asset(name: str) -> Response:
    if name not in ASSETS:
        raise HTTPException(404, "no such file")
    return _asset(name)


@router.get("/api/me")
def whoami(p: UserDep) -> JSONResponse:
    """Who the token is: the login form's check."""
    return JSONResponse(me(p), headers=NO_STORE)


@router.get("/api/overview")
def overview_view(request: Request, p: UserDep, store: StoreDep, coord: CoordinatorDep) -> JSONResponse:
    """Nodes, GPUs, jobs and recent scheduler decisions, as ``p`` may see them."""
    st = request.app.state
    return JSONResponse(overview(store, coord, p, _decisions(st), st.dashboard_history), headers=NO_STORE)


@router.get("/api/jobs/{job_id}")
def job_view(request: Request, job_id: JobId, p: UserDep, store: StoreDep, coord: CoordinatorDep,
             logs_dir: LogsDirDep) -> JSONResponse:
    """One job's page (404 for another tenant's job)."""
    d = job_detail(store, p, job_id, logs_dir, coord.policy.name, request.app.state.dashboard_history)
    return JSONResponse(d, headers=NO_STORE)


@router.get("/api/stream")
async def stream(request: Request, p: UserDep, store: StoreDep, coord: CoordinatorDep, logs_dir: LogsDirDep,
                 job: StreamJob = None) -> StreamingResponse:
    """Server-sent events: the overview (and job ``job``'s page) as one JSON
    document each time it changes, checked every second."""

    def build() -> dict[str, Any]:
        st = request.app.state
        snap = overview(store, coord, p, _decisions(st), st.dashboard_history)
        if job is not None:
            try:
                snap["job"] = job_detail(store, p, job, logs_dir, coord.policy.name, st.dashboard_history)
            except HTTPException as e:
                snap["job_error"] = str(e.detail)
        return snap

    return StreamingResponse(_events(request, build), media_type="text/event-stream",
                             headers={**NO_STORE, "X-Accel-Buffering": "no"})


async def _events(request: Request, build: Any) -> AsyncIterator[str]:
    last, sent, checked = "", 0.0, time.monotonic()
    while not await request.is_disconnected():
        if time.monotonic() - checked > RECHECK_S:
            checked = time.monotonic()
            if not await run_in_threadpool(_still_valid, request):
                yield "event: auth\ndata: {}\n\n"
                return
        snap = await run_in_threadpool(build)
        key = json.dumps({k: v for k, v in snap.items() if k != "time"}, sort_keys=True, default=str)
        if key != last or time.monotonic() - sent > KEEPALIVE_S:
            last, sent = key, time.monotonic()
            yield f"data: {json.dumps(snap, default=str)}\n\n"
        await asyncio.sleep(PERIOD_S)


def _decisions(state: Any) -> DecisionLog | None:
    """The coordinator's decision log, None if it records none."""
    return state.decisions if getattr(state, "decisions_recorded", False) else None


def _still_valid(request: Request) -> bool:
    """The stream's token is still known (not rotated away)."""
    try:
        p: Principal = principal(request, request.app.state.store)
    except HTTPException:
        return False
    return p.role in ("admin", "tenant")
