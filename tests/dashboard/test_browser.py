"""The dashboard in a real browser (headless Chromium) against an embedded
cluster: a server and 2 agents x 2 virtual GPUs (of types T4 and A100), one small real elastic job
of tenant alice (PyTorch on CPU, gloo), as in tests/control/test_e2e.py.

Checked as a user sees it: a bad token gets the login page back with an
error; alice sees her job on its GPUs, in the jobs table and on its page,
which follows a rescale live (no reload) with the pause and its reason; bob
sees neither her job nor its id, and no buttons on a job he cannot change;
a node whose agent dies is marked down. The screenshots go to docs/img/."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import tidal.control.demo_job as demo_job
from tidal.control.local import LocalCluster

DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
pytestmark = pytest.mark.timeout(300)


def wait(pred, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def small_job(name: str, gpus: str | int, steps: int = 2000, elastic: bool = True) -> dict:
    """demo_job: 2048 samples, batch 64, 10 ms of pretend work per sample."""
    return {"name": name, "script": demo_job.__file__, "gpus": gpus, "iterations": steps, "deadline": 3600,
            "elastic": elastic,
            "args": ["--samples", "2048", "--epochs", str(max(1, steps * 64 // 2048)), "--sample-time", "0.01"]}


@pytest.fixture(scope="module")
def live(tmp_path_factory, browser):
    """The cluster, with alice's job training on 2 GPUs."""
    home = tmp_path_factory.mktemp("dashboard") / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_NODE_GRACE_S", "10")  # the node-down test: 10 s of silence, not the default grace
        with LocalCluster(home, layout=[(2, "T4"), (2, "A100")], policy="edf", tick_s=1.0) as c:
            admin = c.api()
            alice, bob = c.api(admin.add_user("alice")), c.api(admin.add_user("bob"))
            jid = alice.submit(small_job("train", "1-2"))["id"]
            wait(lambda: len(alice.job(jid)["gpus"]) == 2 and alice.job(jid)["step"] > 2, 150,
                 "the job to train on 2 GPUs")
            yield SimpleNamespace(url=f"{c.url}/dashboard/", cluster=c, admin=admin, alice=alice, bob=bob, job=jid)


def login(page, live, token: str) -> None:
    page.goto(live.url)
    page.fill("#token", token)
    page.click("#login-button")


def shot(page, name: str) -> None:
    DOCS_IMG.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(DOCS_IMG / f"dashboard-{name}.png"), full_page=True)


def test_a_bad_token_gets_the_login_page_with_an_error(page, live):
    from playwright.sync_api import expect

    login(page, live, "not-a-token")
    expect(page.locator("#login-error")).to_have_text("That token is not valid.")
    expect(page.locator("#login")).to_be_visible()
    expect(page.locator("#app")).to_be_hidden()
    # an agent's join token is known to the server but may not use the public API
    login(page, live, (live.cluster.home / "agent.token").read_text().strip())
    expect(page.locator("#login-error")).to_contain_text("cannot use the dashboard")
    shot(page, "login")


def test_a_tenant_sees_its_running_job_on_its_gpus(page, live):
    from playwright.sync_api import expect

    login(page, live, live.alice.token)
    expect(page.locator("#whoami")).to_have_text("alice (tenant)")
    held = page.locator(f'.gpu[data-job="{live.job}"]')
    expect(held).to_have_count(2)
    assert sorted(int(g) for g in held.evaluate_all("els => els.map(e => e.dataset.gid)")) == live.alice.job(live.job)["gpus"]
    expect(page.locator(".node .badge.up")).to_have_count(2)
    # each node with its GPU type (the agents' --gpu-type), and the cluster's GPUs by type
    expect(page.locator('.node[data-node="node-0"] .gpu-type')).to_have_text("2 × T4")  # its agent's --gpu-type
    expect(page.locator('.node[data-node="node-1"] .gpu-type')).to_have_text("2 × A100")
    expect(page.locator("#cluster-summary")).to_contain_text("GPUs busy (2 A100, 2 T4)")  # types by name
    expect(page.locator("#live")).to_have_text("live")
    shot(page, "cluster")
    page.click('a[data-route="jobs"]')
    row = page.locator(f'#jobs-table tr[data-job="{live.job}"]')
    expect(row).to_contain_text("running")
    expect(row.locator("td").nth(3)).to_have_text("2 / 1 / 2")
    expect(row.locator("td").nth(4)).to_contain_text("samples/s")
    page.fill("#job-filter", "no-such-job")
    expect(row).to_have_count(0)
    page.fill("#job-filter", "train")
    expect(row).to_have_count(1)
    shot(page, "jobs")


def test_the_job_page_follows_a_rescale_live(page, live):
    from playwright.sync_api import expect

    login(page, live, live.alice.token)
    page.goto(f"{live.url}#/job/{live.job}")
    expect(page.locator("#job-title")).to_have_text(live.job)
    expect(page.locator("#job-summary")).to_contain_text("2 / 1 / 2")
    expect(page.locator("#scale-form")).to_be_visible()  # her own running job: she may scale and cancel it
    expect(page.locator("#cancel-button")).to_be_visible()
    page.evaluate("window.__sameDocument = true")
    live.alice.scale(live.job, 1)  # pinned at 1 GPU: the job shrinks without stopping
    change = page.locator('#changes-table tr[data-kind="scale_in"]')
    expect(change).to_have_count(1, timeout=60_000)
    expect(change).to_contain_text("2 → 1")
    expect(change).to_contain_text("pinned at 1 GPUs by alice")
    expect(change.locator("td").nth(3)).to_contain_text(" ms")
    expect(page.locator("#job-summary")).to_contain_text("1 / 1 / 2", timeout=30_000)
    assert page.evaluate("window.__sameDocument === true"), "the page reloaded instead of updating"
    expect(page.locator("#job-admission")).to_contain_text("admitted")
    expect(page.locator("#timeline-chart svg path.size")).to_have_count(1)
    expect(page.locator("#job-logs")).to_contain_text("[w")
    shot(page, "job")


def test_a_tenant_cannot_see_another_tenants_job(page, live):
    from playwright.sync_api import expect

    bob = live.bob
    # rigid on all 4 GPUs, behind alice's earlier deadline: it waits, and is cancelled at once
    mine = bob.submit(small_job("bobs", 4, elastic=False))["id"]
    bob.cancel(mine)
    wait(lambda: bob.job(mine)["state"] == "cancelled", 30, "bob's job to be cancelled")
    login(page, live, bob.token)
    expect(page.locator("#whoami")).to_have_text("bob (tenant)")
    expect(page.locator(".gpu.other")).to_have_count(1)  # alice's GPU: busy, whose is not said
    expect(page.locator(f'[data-job="{live.job}"]')).to_have_count(0)
    assert live.job not in page.content()
    page.click('a[data-route="jobs"]')
    expect(page.locator(f'#jobs-table tr[data-job="{mine}"]')).to_have_count(1)
    expect(page.locator(f'#jobs-table tr[data-job="{live.job}"]')).to_have_count(0)
    page.goto(f"{live.url}#/job/{live.job}")
    expect(page.locator("#job-error")).to_have_text(f"no job {live.job}")
    expect(page.locator("#job-body")).to_be_hidden()
    page.goto(f"{live.url}#/job/{mine}")
    expect(page.locator("#job-state")).to_have_text("cancelled")
    expect(page.locator("#scale-form")).to_be_hidden()  # a finished job: nothing to do
    expect(page.locator("#cancel-button")).to_be_hidden()


def test_the_admin_sees_every_job_and_the_scheduler(page, live):
    from playwright.sync_api import expect

    login(page, live, live.cluster.admin_token)
    expect(page.locator("#whoami")).to_have_text("admin (admin)")
    expect(page.locator(f'.gpu[data-job="{live.job}"]')).to_have_count(1)
    page.click('a[data-route="scheduler"]')
    expect(page.locator("#sched-summary")).to_contain_text("policy edf")
    if _decisions_made(live.admin.http.send("GET", "/metrics").text):
        expect(page.locator("#decisions-table tbody tr").first).to_contain_text(" ms")
        expect(page.locator("#latency-chart svg path.live")).to_have_count(1)
    else:  # the coordinator keeps no decision log: the view says so
        expect(page.locator("#sched-note")).to_contain_text("does not record")
    shot(page, "scheduler")


def _decisions_made(metrics: str) -> float:
    """Plans timed by the server (its decision-latency histogram's count)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(metrics)
               for s in f.samples if s.name == "tidal_scheduler_decision_duration_seconds_count")


def test_a_node_whose_agent_died_is_marked_down(page, live):
    from playwright.sync_api import expect

    login(page, live, live.cluster.admin_token)
    nodes = live.admin.cluster()["nodes"]
    idle = next(n["name"] for n in nodes if not any(g["job"] for g in n["gpus"]))
    expect(page.locator(f'.node[data-node="{idle}"] .badge')).to_have_text("up")
    live.cluster.kill_agent(int(idle.split("-")[1]))
    expect(page.locator(f'.node[data-node="{idle}"] .badge')).to_have_text("DOWN", timeout=40_000)
    expect(page.locator(f'.node[data-node="{idle}"]')).to_have_class("node down")
    expect(page.locator(f'.gpu[data-job="{live.job}"]')).to_have_count(1)  # the job trains on
    shot(page, "node-down")
