"""``/v1/users``: accounts (admin token)."""

from __future__ import annotations

import re

from fastapi import APIRouter, HTTPException

from tidal.control.api.deps import AdminDep, StoreDep
from tidal.control.db import User

router = APIRouter(prefix="/v1/users", tags=["admin"])

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RESERVED = ("admin", "agent")  # the server's own accounts


@router.post("/{name}")
def add_user(name: str, store: StoreDep, _: AdminDep, admin_flag: bool = False,
             rotate: bool = False) -> dict[str, str]:
    """Create a user and return its API token (422: a bad name; 409: it
    exists, unless ``rotate=true`` asks for a new token; the server's own
    accounts are never rotated here)."""
    if not NAME.match(name):
        raise HTTPException(422, f"user name {name!r}: use 1-64 letters, digits, '_', '.' or '-', "
                                 "starting with a letter or digit")
    if name in RESERVED:
        raise HTTPException(409, f"user {name!r} is the server's own account; it cannot be created or rotated here")
    with store.session() as s:
        exists = s.get(User, name) is not None
    if exists and not rotate:
        raise HTTPException(409, f"user {name!r} exists; add ?rotate=true (tidal user {name} --rotate) "
                                 "for a new token, which invalidates the old one")
    return {"name": name, "token": store.add_user(name, admin=admin_flag)}
