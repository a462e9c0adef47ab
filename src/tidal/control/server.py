"""``tidal server``: the control plane's REST API (FastAPI, OpenAPI docs at
``/docs``) over the store, with the scheduler loop running beside it.

The routes live in :mod:`tidal.control.api` (users, jobs, cluster, internal);
this module assembles them into an app over one store and one coordinator. A
bad request gets a 4xx naming the field; the service never crashes on one.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncContextManager, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import select

from tidal import settings
from tidal.control.api import cluster, internal, jobs, users
from tidal.control.coordinator import Coordinator
from tidal.control.db import Node, Store
from tidal.core.errors import InputError
from tidal.net import advertise_addr, bind_addr

log = logging.getLogger(__name__)


def create_app(
    store: Store,
    *,
    policy: str = "edf",
    admin_token: str | None = None,
    agent_token: str | None = None,
    tick_s: float = 2.0,
    home: Path | None = None,
    server_url: str = "",
    start_loop: bool = True,
) -> FastAPI:
    """The API over ``store``: ``home`` (default ``$TIDAL_HOME``) holds the
    processes' logs; ``start_loop`` runs the scheduler loop while the app
    serves (tests drive ``app.state.coordinator.round()`` themselves)."""
    home = Path(home or settings.home())
    admin_token = admin_token or secrets.token_urlsafe(24)
    agent_token = agent_token or admin_token
    store.add_user("admin", admin=True, token=admin_token)
    if agent_token != admin_token:
        store.add_user("agent", admin=True, token=agent_token)
    coord = Coordinator(store, policy, server_url=server_url, agent_token=agent_token, tick_s=tick_s, home=home)
    app = FastAPI(title="Tidal control plane", version="0.1.0", lifespan=_lifespan(start_loop),
                  description="Submit elastic training jobs; the scheduler reshapes them.")
    app.state.store, app.state.coordinator = store, coord
    app.state.logs_dir = home / "logs"
    app.state.register_lock = threading.Lock()
    app.state.heartbeat_clock = internal.HeartbeatClock(time.time())
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_exception_handler(Exception, _any_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(InputError, _bad_input)
    for module in (users, jobs, cluster, internal):
        app.include_router(module.router)
    _reset_after_restart(store)
    return app


def _lifespan(start_loop: bool) -> Callable[[FastAPI], AsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        coord = app.state.coordinator
        if start_loop:
            coord.start()
        try:
            yield
        finally:
            coord.stop()

    return lifespan


MAX_BODY_BYTES = 1 << 20  # the public API: a job spec is a few hundred bytes
MAX_INTERNAL_BODY_BYTES = 16 << 20  # agents' reports carry log chunks (256 KB per process and tick)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` (``/internal/``:
    :data:`MAX_INTERNAL_BODY_BYTES`) gets 413 before any handler parses it
    (by its Content-Length, or while it streams in)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = MAX_INTERNAL_BODY_BYTES if str(scope.get("path", "")).startswith("/internal/") else self.max_bytes
        length = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if length.isdigit() and int(length) > limit:
            return await self._too_large(scope, receive, send, limit)
        seen = 0

        async def counted() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._too_large(scope, receive, send, limit)

    @staticmethod
    async def _too_large(scope: dict[str, Any], receive: Any, send: Any, limit: int) -> None:
        resp = JSONResponse(status_code=413, content={"detail": f"request body over {limit} bytes"})
        await resp(scope, receive, send)


class _TooLarge(Exception):
    pass


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    """422 naming each field and reason, without echoing the input (which may
    be huge, or hold values JSON cannot carry, such as Infinity)."""
    assert isinstance(exc, RequestValidationError)
    errors = [{"loc": [str(x) for x in e.get("loc", ())][:8], "msg": str(e.get("msg", ""))[:300],
               "type": str(e.get("type", ""))} for e in exc.errors()[:20]]
    return JSONResponse(status_code=422, content={"detail": errors})


async def _bad_input(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(status_code=422, content={"detail": str(exc)[:1000]})


async def _any_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return JSONResponse(status_code=500, content={"detail": f"internal error: {type(exc).__name__}"})


def _reset_after_restart(store: Store) -> None:
    """A restarted server resumes from the store (the coordinator resumes
    each job's phase and its change in flight)."""
    with store.session() as s:
        # the server was away, not the nodes: their heartbeat clocks start now
        # (otherwise the first agent back would have all the others declared down)
        for n in s.scalars(select(Node).where(Node.state == "up")):
            n.last_heartbeat = time.time()
        store.log(s, "server.start")


def serve(
    host: str | None = None,
    port: int = 8470,
    db_url: str | None = None,
    policy: str = "edf",
    admin_token: str | None = None,
    tick_s: float = 2.0,
    home: Path | None = None,
    advertise: str | None = None,
) -> None:
    """Run the server until interrupted; state in ``home`` (default
    ``$TIDAL_HOME``): the SQLite store unless ``db_url``, and the admin token
    (kept across restarts unless one is given). ``advertise``: the address
    job masters and agents on other hosts reach it at (default: ``host``, or
    with 0.0.0.0 this host's first non-loopback address; :mod:`tidal.net`)."""
    import uvicorn

    host = bind_addr(host)

    home = Path(home or settings.home())
    home.mkdir(parents=True, exist_ok=True)
    store = Store(db_url or f"sqlite:///{home / 'tidal.db'}")
    token_file = home / "admin.token"
    if admin_token is None:
        admin_token = token_file.read_text().strip() if token_file.exists() else secrets.token_urlsafe(24)
    token_file.write_text(admin_token)
    token_file.chmod(0o600)
    url = f"http://{advertise_addr(host, explicit=advertise or settings.ADVERTISE_ADDR.get())}:{port}"
    app = create_app(store, policy=policy, admin_token=admin_token, tick_s=tick_s, home=home, server_url=url)
    uvicorn.run(app, host=host, port=port, log_level="warning")
