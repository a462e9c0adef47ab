"""Dependencies shared by the routers: the app's state and who is calling.

Users authenticate with a bearer token and see and change only their own jobs
(another user's job is a 404); the admin token may do everything, including
cluster operations; agents and job masters use the agent token, which is an
admin token too."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from sqlalchemy.orm import Session

from tidal.control.coordinator import Coordinator
from tidal.control.db import Job, Store


@dataclass(frozen=True)
class Principal:
    """The caller, from its bearer token."""

    name: str
    admin: bool


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
    user = store.user_for_token(auth.split(" ", 1)[1].strip())
    if user is None:
        raise HTTPException(401, "unknown token")
    return Principal(name=user.name, admin=user.is_admin)


UserDep = Annotated[Principal, Depends(principal)]


def require_admin(p: UserDep) -> Principal:
    """An admin (or agent) token (403 for a user's)."""
    if not p.admin:
        raise HTTPException(403, "admin token required")
    return p


AdminDep = Annotated[Principal, Depends(require_admin)]


def own_job(s: Session, job_id: str, p: Principal) -> Job:
    """The job if ``p`` may see it: another user's job is a 404, like a missing one."""
    j = s.get(Job, job_id)
    if j is None or (not p.admin and j.user != p.name):
        raise HTTPException(404, f"no job {job_id}")
    return j
