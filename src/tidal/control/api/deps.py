"""Dependencies shared by the routers: the app's state and who is calling.

Every caller sends a bearer token; its role (:mod:`tidal.control.credentials`)
decides what it may do. Tenants see and change only their own jobs (another
user's job is a 404); the admin may do everything; the public API takes only
tenant and admin tokens; the agents' and masters' internal API takes the
agent join token (registration), a node's credential (that node's
heartbeats) and a job's credential (that job's routes)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import Depends, HTTPException, Path as PathParam, Request
from sqlalchemy.orm import Session

from tidal.control.coordinator import Coordinator
from tidal.control.credentials import ADMIN, AGENT, JOB, NODE, TENANT, Credentials, Principal
from tidal.control.db import Job, Store

#: a job id or node name in a path: no NUL, no slash, bounded (the store takes it as is)
JobId = Annotated[str, PathParam(max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")]
NodeName = Annotated[str, PathParam(max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")]

__all__ = ["JobId", "NodeName", "Principal", "StoreDep", "CoordinatorDep", "LogsDirDep", "UserDep", "AdminDep", "AgentDep", "NodeDep",
           "JobCredDep", "own_job"]


def get_store(request: Request) -> Store:
    return request.app.state.store


def get_coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


def get_logs_dir(request: Request) -> Path:
    return request.app.state.logs_dir


StoreDep = Annotated[Store, Depends(get_store)]
CoordinatorDep = Annotated[Coordinator, Depends(get_coordinator)]
LogsDirDep = Annotated[Path, Depends(get_logs_dir)]


def principal(request: Request, store: StoreDep) -> Principal:
    """Any known token (401 without one or with an unknown one)."""
    auth = request.headers.get("authorization", "")
    if not auth.lower().startswith("bearer "):
        raise HTTPException(401, "missing bearer token")
    token = auth.split(" ", 1)[1].strip()
    creds: Credentials = request.app.state.credentials
    derived = creds.check(token)
    if derived is not None:
        return derived
    user = store.user_for_token(token)
    if user is None:
        raise HTTPException(401, "unknown token")
    return Principal(name=user.name, role=ADMIN if user.is_admin else TENANT)


AnyDep = Annotated[Principal, Depends(principal)]


def require_user(p: AnyDep) -> Principal:
    """A tenant's or the admin's token: the public API (403 for the
    credentials of agents, nodes and jobs)."""
    if p.role not in (ADMIN, TENANT):
        raise HTTPException(403, f"a {p.role} credential cannot use the public API")
    return p


UserDep = Annotated[Principal, Depends(require_user)]


def require_admin(p: AnyDep) -> Principal:
    """The admin token (403 for any other)."""
    if not p.admin:
        raise HTTPException(403, "admin token required")
    return p


AdminDep = Annotated[Principal, Depends(require_admin)]


def require_agent(p: AnyDep) -> Principal:
    """The agents' join token (or the admin's): registering a node."""
    if p.role not in (ADMIN, AGENT):
        raise HTTPException(403, "the agent join token is required")
    return p


AgentDep = Annotated[Principal, Depends(require_agent)]


def require_node(name: str, p: AnyDep) -> Principal:
    """The credential of node ``name`` (a path parameter), or the admin's."""
    if not (p.admin or (p.role == NODE and p.scope == name)):
        raise HTTPException(403, f"only node {name}'s credential may act for it")
    return p


NodeDep = Annotated[Principal, Depends(require_node)]


def require_job_credential(job_id: str, p: AnyDep) -> Principal:
    """The credential of job ``job_id`` (a path parameter), or the admin's."""
    if not (p.admin or (p.role == JOB and p.scope == job_id)):
        raise HTTPException(403, f"only job {job_id}'s credential may act for it")
    return p


JobCredDep = Annotated[Principal, Depends(require_job_credential)]


def own_job(s: Session, job_id: str, p: Principal) -> Job:
    """The job if ``p`` may see it: another user's job is a 404, like a missing one."""
    j = s.get(Job, job_id)
    if j is None or (not p.admin and j.user != p.name):
        raise HTTPException(404, f"no job {job_id}")
    return j
