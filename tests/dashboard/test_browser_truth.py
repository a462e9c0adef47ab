"""The dashboard tells what the CLI tells, in a real browser (headless
Chromium), against an in-process server whose jobs are set in its store (no
scheduling loop runs, so nothing moves them):

* a job that ended at step 128 of 100000 shows 128/100000, as ``tidal jobs``
  does, never 100%; it shows when it ended, not a deadline countdown;
* a running job with no step for longer than the control plane's stall
  time-out is marked stalled (and has no throughput), with the reason
  ``tidal jobs`` gives; one that steps is not;
* identical consecutive scheduler rounds are one row with a count;
* the progress label stays on its bar's line in a narrow window;
* an auto-sized job shows its sizing plan, its memory limit and the plan's
  GPU range (not its spec's).
"""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest

from dash_helpers import hdr
from served import served as served_app

pytestmark = pytest.mark.timeout(120)

MIB = 2**20
COUNTDOWN = re.compile(r"\bin \d")  # "in 33 min"


def _set(store, job_id: str, **fields) -> None:
    from tidal.control.db import Job

    with store.session() as s:
        j = s.get(Job, job_id)
        for k, v in fields.items():
            setattr(j, k, v)


def _jobs(client, store, now: float) -> dict[str, str]:
    """alice's jobs, each put in the state the tests look at."""
    sub = {"script": "train.py", "gpus": "1-2", "iterations": 100000, "deadline": 3600}
    ids = {name: client.post("/v1/jobs", json={**sub, "name": name}, headers=hdr("alice-tok")).json()["id"]
           for name in ("ended", "stuck", "steps")}
    ids["auto"] = client.post("/v1/jobs", json={"script": "train.py", "iterations": 1000, "name": "auto"},
                              headers=hdr("alice-tok")).json()["id"]
    _set(store, ids["ended"], state="completed", start_time=now - 600, end_time=now - 120, exit_info="completed",
         progress={"state": "finished", "step": 128, "step_time_s": 0.1, "step_at": now - 125})
    formed = {"state": "running", "world_size": 1, "step_time_s": 0.1}
    _set(store, ids["stuck"], state="running", start_time=now - 3000, master_url="http://127.0.0.1:1",
         progress={**formed, "step": 500, "step_at": now - 1000})  # past the 900 s stall time-out
    _set(store, ids["steps"], state="running", start_time=now - 60, master_url="http://127.0.0.1:1",
         progress={**formed, "step": 40, "step_at": now - 1})
    plan = {"gpus": 2, "min": 1, "max": 3, "memory": 512 * MIB, "predicted": {},
            "reason": "the smallest count with 90% of the best modelled throughput"}
    _set(store, ids["auto"], state="running", start_time=now - 60, tags={"_memory": 512 * MIB},
         autoconf={"stage": "planned", "plan": plan, "samples": [[1, 64, 0.2, "job"], [2, 64, 0.11, "job"]],
                   "peak": 300 * MIB, "fit": [0.0, 0.2, 0.0]},
         progress={**formed, "step": 10, "step_at": now - 1})
    return ids


def _decisions(app, store, ids: dict[str, str], now: float) -> None:
    """Five identical rounds, then one that differs (newest)."""
    from tidal.control.promstats import DecisionLog
    from tidal.control.snapshot import build_snapshot
    from tidal.scheduler.api import Plan

    log = DecisionLog()
    with store.session(write=False) as s:
        sn, _, _ = build_snapshot(s, now, app.state.coordinator.overheads)
    same = Plan(admit=set(), drop={}, allocation={ids["stuck"]: 1})
    for k in range(5):
        log.record("edf", sn, same, 0.001 * (k + 1), now=now - 10 + k)
    log.record("edf", sn, Plan(admit=set(), drop={}, allocation={ids["stuck"]: 2}), 0.002, now=now - 2)
    app.state.decisions, app.state.decisions_recorded = log, True


@pytest.fixture(scope="module")
def served(tmp_path_factory, browser):
    from fastapi.testclient import TestClient

    from tidal.control.db import Store
    from tidal.control.server import create_app

    home = tmp_path_factory.mktemp("truth")
    store = Store(f"sqlite:///{home / 't.db'}")
    app = create_app(store, admin_token="admin-tok", home=home, start_loop=False)
    client = TestClient(app)
    store.add_user("alice", token="alice-tok")
    client.post("/internal/agents/register", json={"name": "n0", "num_gpus": 4, "virtual": True},
                headers=hdr("admin-tok"))
    now = time.time()
    ids = _jobs(client, store, now)
    _decisions(app, store, ids, now)
    with served_app(app) as base:
        yield SimpleNamespace(url=f"{base}/dashboard/", client=client, ids=ids)


def _login(page, served, view: str = "jobs") -> None:
    page.goto(served.url)
    page.fill("#token", "alice-tok")
    page.click("#login-button")
    page.locator("#whoami").wait_for()
    page.goto(f"{served.url}#/{view}")


def _cli_rows(served) -> dict[str, list[str]]:
    """``tidal jobs``' cells (id, state, GPUs, step, ...) for alice's jobs, as the CLI renders them."""
    from rich.console import Console

    from tidal.cli import cluster as cli

    jobs = served.client.get("/v1/jobs", headers=hdr("alice-tok")).json()
    con = Console(width=400, record=True)
    con.print(cli.jobs_table(jobs, wide=True))
    lines = [ln for ln in con.export_text().splitlines() if "│" in ln]
    return {cells[0]: cells for cells in ([c.strip() for c in ln.split("│")[1:-1]] for ln in lines)}


def test_progress_and_state_are_the_clis(page, served):
    from playwright.sync_api import expect

    cli = _cli_rows(served)
    _login(page, served)
    ended = page.locator(f'#jobs-table tr[data-job="{served.ids["ended"]}"]')
    assert cli[served.ids["ended"]][1:4] == ["completed", "0", "128/100000"]
    expect(ended.locator("td.progress .step")).to_have_text("128/100000")
    expect(ended.locator("td.progress")).not_to_contain_text("100%")
    expect(ended.locator('[data-role="state"]')).to_have_text("completed")
    for name in ("stuck", "steps"):
        row = page.locator(f'#jobs-table tr[data-job="{served.ids[name]}"]')
        expect(row.locator('[data-role="state"]')).to_have_text(cli[served.ids[name]][1])
        expect(row.locator("td.progress .step")).to_have_text(cli[served.ids[name]][3])
    page.goto(f"{served.url}#/job/{served.ids['ended']}")
    expect(page.locator("#job-summary")).to_contain_text("128/100000 (0.1%)")


def test_a_job_past_the_stall_timeout_is_marked_stalled(page, served):
    from playwright.sync_api import expect

    api = {j["id"]: j for j in served.client.get("/v1/jobs", headers=hdr("alice-tok")).json()}
    stuck, steps = api[served.ids["stuck"]], api[served.ids["steps"]]
    assert stuck["stalled_s"] >= 1000 and stuck["reason"].startswith("stalled: no step committed for")
    assert steps["stalled_s"] == 0 and steps["reason"] == ""
    _login(page, served)
    row = page.locator(f'#jobs-table tr[data-job="{served.ids["stuck"]}"]')
    expect(row.locator('[data-role="stalled"]')).to_contain_text("stalled 17 min")
    expect(row.locator('[data-role="state"]')).to_have_class("badge running stalled")
    expect(row.locator("td").nth(4)).to_have_text("–")  # no throughput from a stale step time
    healthy = page.locator(f'#jobs-table tr[data-job="{served.ids["steps"]}"]')
    expect(healthy.locator('[data-role="stalled"]')).to_have_count(0)
    page.goto(f"{served.url}#/job/{served.ids['stuck']}")
    expect(page.locator("#job-state")).to_contain_text("stalled")
    expect(page.locator("#job-summary")).to_contain_text("stalled: no step committed for")
    page.goto(f"{served.url}#/jobs")
    shot(page, "jobs-truth")


def test_an_ended_job_shows_when_it_ended_not_a_countdown(page, served):
    from playwright.sync_api import expect

    _login(page, served)
    row = page.locator(f'#jobs-table tr[data-job="{served.ids["ended"]}"]')
    expect(row.locator("td.finish")).to_contain_text("ended")
    expect(row.locator("td.finish")).to_contain_text("2 min ago")
    expect(row.locator("td.deadline")).to_contain_text("(met)")
    expect(row).not_to_contain_text(COUNTDOWN)
    page.goto(f"{served.url}#/job/{served.ids['ended']}")
    summary = page.locator("#job-summary")
    expect(summary).to_contain_text("Ended")
    expect(summary).to_contain_text("2 min ago")
    expect(summary).not_to_contain_text("Predicted finish")
    expect(summary).not_to_contain_text(COUNTDOWN)


def test_identical_scheduler_rounds_are_one_row_with_a_count(page, served):
    from playwright.sync_api import expect

    _login(page, served, "scheduler")
    body = page.locator("#decisions-table tbody tr")
    expect(body).to_have_count(2)
    expect(body.nth(0).locator("td.count")).to_have_text("")  # the newest, different round
    expect(body.nth(1).locator("td.count")).to_have_text("×5")
    expect(body.nth(1)).to_contain_text("→1")
    expect(body.nth(1)).to_contain_text("max 5.00")
    shot(page, "scheduler-folded")


def test_the_progress_label_stays_beside_its_bar(browser, served):
    from playwright.sync_api import expect

    ctx = browser.new_context(viewport={"width": 760, "height": 700})
    page = ctx.new_page()
    try:
        _login(page, served)
        for name in ("ended", "stuck", "steps"):
            cell = page.locator(f'#jobs-table tr[data-job="{served.ids[name]}"] td.progress')
            expect(cell).to_be_visible()
            bar, label = cell.locator(".bar").bounding_box(), cell.locator(".step").bounding_box()
            mid = label["y"] + label["height"] / 2
            assert bar["y"] - 6 <= mid <= bar["y"] + bar["height"] + 6, (name, bar, label)
            assert label["x"] > bar["x"] + bar["width"] - 1, (name, bar, label)
    finally:
        ctx.close()


def test_an_auto_sized_job_shows_its_plan_and_memory_limit(page, served):
    from playwright.sync_api import expect

    _login(page, served)
    row = page.locator(f'#jobs-table tr[data-job="{served.ids["auto"]}"]')
    expect(row.locator("td").nth(3)).to_have_text("0 / 1 / 3")  # the plan's range, not the spec's
    page.goto(f"{served.url}#/job/{served.ids['auto']}")
    expect(page.locator("#job-summary")).to_contain_text("0 / 1 / 3")
    sizing = page.locator("#job-sizing")
    expect(sizing).to_be_visible()
    expect(sizing).to_contain_text("2 GPUs (range 1–3)")
    expect(sizing).to_contain_text("512 MiB per worker")
    expect(sizing).to_contain_text("1 GPU, 2 GPUs")
    expect(sizing).to_contain_text("90% of the best modelled throughput")
    shot(page, "job-autosized")
    page.goto(f"{served.url}#/job/{served.ids['steps']}")  # a job sized by its spec: no such section
    expect(page.locator("#job-summary")).to_contain_text("0 / 1 / 2")
    expect(page.locator("#job-sizing")).to_be_hidden()


def shot(page, name: str) -> None:
    from test_browser import DOCS_IMG

    DOCS_IMG.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(DOCS_IMG / f"dashboard-{name}.png"), full_page=True)
