"""The cluster's state: nodes and GPUs, the event log, health and metrics."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tidal.control.api.deps import AdminDep, CoordinatorDep, Principal, StoreDep, UserDep
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


@router.get("/healthz")
def healthz(request: Request) -> dict[str, Any]:
    """Up; ``leader``: whether this replica schedules (the others serve the API)."""
    return {"status": "ok", "leader": request.app.state.elector.is_leading}


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(store: StoreDep, coord: CoordinatorDep) -> str:
    """Prometheus gauges: jobs and GPUs by state, scheduling rounds."""
    reg = CollectorRegistry()
    g_jobs = Gauge("tidal_jobs", "jobs by state", ["state"], registry=reg)
    g_gpus = Gauge("tidal_gpus", "GPUs by state", ["state"], registry=reg)
    with store.session(write=False) as s:
        for state, n in s.execute(select(Job.state, func.count()).group_by(Job.state)).all():
            g_jobs.labels(state).set(n)
        for state, n in s.execute(select(GPU.state, func.count()).group_by(GPU.state)).all():
            g_gpus.labels(state).set(n)
    Gauge("tidal_scheduler_rounds", "scheduling rounds", registry=reg).set(coord.rounds)
    return generate_latest(reg).decode()
