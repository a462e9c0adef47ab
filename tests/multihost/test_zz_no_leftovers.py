"""Runs last in tests/multihost (by name): nothing made by the harness survives."""

from __future__ import annotations

import shutil

import pytest

from netns import PREFIX, list_links, list_namespaces


def test_no_namespace_or_link_left() -> None:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 'ip' not found")
    assert [n for n in list_namespaces() if n.startswith(PREFIX)] == []
    assert [n for n in list_links() if n.startswith(PREFIX)] == []
