"""The web dashboard (``/dashboard/``): plain HTML, JavaScript and CSS
served from this package's ``static/`` directory, and JSON views behind the
public API's own token checks (docs/dashboard.md). :func:`mount` adds it to
the server's app."""

from __future__ import annotations

from fastapi import FastAPI

from tidal.control.dashboard.routes import router
from tidal.control.dashboard.views import History

__all__ = ["mount", "router"]


def mount(app: FastAPI) -> None:
    """Serve the dashboard from ``app`` (its throughput history lives in ``app.state``)."""
    app.state.dashboard_history = History()
    app.include_router(router)
