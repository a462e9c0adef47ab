"""The cluster's state: nodes and GPUs, the event log and metrics (health: :mod:`.health`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import PlainTextResponse
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tidal.control import promstats
from tidal.control.api.deps import AdminDep, CoordinatorDep, Principal, StoreDep, UserDep, principal, require_user
from tidal.control.db import GPU, Event, Job, Node

router = APIRouter(tags=["cluster"])


@router.get("/v1/cluster")
def cluster(p: UserDep, store: StoreDep, coord: CoordinatorDep) -> dict[str, Any]:
    """Nodes and their GPUs; a user sees which GPUs are busy, not whose job holds them."""
    with store.session(write=False) as s:
        nodes = [_node_json(s, n, p) for n in s.scalars(select(Node).order_by(Node.ordinal))]
        counts = dict(s.execute(select(Job.state, func.count()).group_by(Job.state)).all())
        return {"nodes": nodes, "jobs": counts, "policy": coord.policy.name, "rounds": coord.rounds}


def _node_json(s: Session, n: Node, p: Principal) -> dict[str, Any]:
    gpus = s.scalars(select(GPU).where(GPU.node == n.name).order_by(GPU.index)).all()
    return {"name": n.name, "state": n.state, "address": n.address, "labels": dict(n.labels or {}),
            "virtual": n.virtual, "num_gpus": n.num_gpus, "last_heartbeat": n.last_heartbeat,
            "gpus": [{"gid": g.gid, "index": g.index, "state": g.state, "job": _visible_job(s, g.job_id, p),
                      "util": g.util} for g in gpus]}


def _visible_job(s: Session, job_id: str | None, p: Principal) -> str | None:
    """The job holding a GPU as ``p`` may see it: its id, "busy", or None when free."""
    if job_id is None:
        return None
    if p.admin:
        return job_id
    j = s.get(Job, job_id)
    return job_id if j is not None and j.user == p.name else "busy"


@router.get("/v1/events")
def events(_: AdminDep, store: StoreDep,
           since: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0) -> list[dict[str, Any]]:
    """The audit trail after event ``since`` (admin token)."""
    with store.session(write=False) as s:
        return [{"id": e.id, "time": e.time, "kind": e.kind, "job": e.job_id, "node": e.node, "gpu": e.gpu,
                 **(e.detail or {})} for e in s.scalars(select(Event).where(Event.id > since).order_by(Event.id))]


def optional_user(request: Request, store: StoreDep) -> Principal | None:
    """The caller of ``/metrics``: None without a token (a plain Prometheus
    scrape); otherwise a tenant's or the admin's token, checked as on the
    public API (401 unknown, 403 an agent's, node's or job's credential)."""
    if "authorization" not in request.headers:
        return None
    return require_user(principal(request, store))


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(request: Request, store: StoreDep, coord: CoordinatorDep,
            p: Annotated[Principal | None, Depends(optional_user)]) -> str:
    """Prometheus metrics (docs/dashboard.md): jobs, GPUs, nodes, events,
    rescale pauses, scheduler decision and API latency; per-job series
    (``job``, ``tenant``) for the jobs the caller's token may see (none
    without a token)."""
    state = request.app.state
    extra = [c for c in (getattr(state, "decisions", None), getattr(state, "request_stats", None)) if c is not None]
    return promstats.render(store, coord.rounds, p, extra)
