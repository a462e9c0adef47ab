"""Headless Chromium (Debian's ``chromium`` package, driven by Playwright)
for the dashboard tests; skipped with the reason when either is missing.
Chromium runs without network access beyond loopback: background
networking, component updates, sync and QUIC are off."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dash_helpers import hdr

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str | None:
    for name in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if Path(name).exists():
            return name
    return shutil.which("chromium")


@pytest.fixture(scope="session")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
    exe = chromium_path()
    if exe is None:
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    """A fresh tab (its own session storage) of 1280 x 900."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = ctx.new_page()
    pg.set_default_timeout(20_000)
    try:
        yield pg
    finally:
        ctx.close()


@pytest.fixture
def tenants(tmp_path):
    """An in-process server (no loop, no agent) with a 4-GPU node and two
    tenants, alice and bob, with a job each; one scheduling round ran.
    Returns (client, app, alice's job, bob's job)."""
    from fastapi.testclient import TestClient

    from tidal.control.db import Store
    from tidal.control.server import create_app

    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    app = create_app(store, admin_token="admin-tok", home=tmp_path, start_loop=False)
    client = TestClient(app)
    store.add_user("alice", token="alice-tok")
    store.add_user("bob", token="bob-tok")
    client.post("/internal/agents/register", json={"name": "n0", "num_gpus": 4, "virtual": True},
                headers=hdr("admin-tok"))
    job = {"script": "train.py", "gpus": "1-2", "iterations": 100, "deadline": 600}
    a = client.post("/v1/jobs", json={**job, "name": "a"}, headers=hdr("alice-tok")).json()["id"]
    b = client.post("/v1/jobs", json={**job, "name": "b"}, headers=hdr("bob-tok")).json()["id"]
    app.state.coordinator.round()
    return client, app, a, b
