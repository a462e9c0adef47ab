"""Runs last in tests/multihost (by name): nothing made by the harness survives."""

from __future__ import annotations

import shutil

import pytest

from netns import PREFIX, _owner_alive, list_links, list_namespaces, owned_here


def test_no_namespace_or_link_left() -> None:
    """Every set this run built is gone, and no harness namespace or root link
    is left without a live owner (one of a concurrent run is not ours to judge)."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 'ip' not found")
    assert owned_here() == []
    orphans = [n for n in list_namespaces() + list_links()
               if n.startswith(PREFIX) and not _owner_alive(n.split("-", 1)[0])]
    assert orphans == []
