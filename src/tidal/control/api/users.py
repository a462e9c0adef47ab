"""``/v1/users``: accounts (admin token)."""

from __future__ import annotations

from fastapi import APIRouter

from tidal.control.api.deps import AdminDep, StoreDep

router = APIRouter(prefix="/v1/users", tags=["admin"])


@router.post("/{name}")
def add_user(name: str, store: StoreDep, _: AdminDep, admin_flag: bool = False) -> dict[str, str]:
    """Create a user and return its API token."""
    return {"name": name, "token": store.add_user(name, admin=admin_flag)}
