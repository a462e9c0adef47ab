"""``/metrics`` as Prometheus reads it (prometheus_client's own text parser):
names follow its conventions, per-job series show only to whoever may see
the job, and the Grafana dashboard in deploy/grafana uses only metrics the
server exposes. In-process app over a SQLite store, no agent."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families


from dash_helpers import hdr  # noqa: E402

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tidal-dashboard.json"
NAME = re.compile(r"^tidal_[a-z][a-z0-9_]*$")
#: a quantity of time must be in seconds; no other unit than the base ones
TIME_WORDS = ("duration", "latency", "pause", "timestamp", "time")
BAD_UNITS = ("_ms", "_milliseconds", "_microseconds", "_minutes", "_hours", "_kb", "_mb", "_gb", "_percent")


@pytest.fixture
def env(tenants):
    """The two tenants' server; alice's job reported a step time and two
    rescales (one pause of 20 ms, one of 2 s)."""
    client, app, a, b = tenants
    changes = [{"kind": "scale_out", "from_size": 1, "to_size": 2, "pause_s": 0.02, "switch_step": 5,
                "switched_at": 1.0}, {"kind": "scale_in", "from_size": 2, "to_size": 1, "pause_s": 2.0,
                                      "switch_step": 9, "switched_at": 2.0}]
    r = client.post(f"/internal/jobs/{a}/status", json={"step": 12, "step_time_s": 0.25, "changes": changes},
                    headers=hdr("admin-tok"))
    assert r.status_code == 200
    return client, app, a, b


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metric_names_follow_prometheus_conventions(env):
    client, *_ = env
    fams = families(client.get("/metrics", headers=hdr("admin-tok")).text)
    assert len(fams) >= 15
    for name, f in fams.items():
        assert NAME.match(name), f"{name}: not tidal_ + snake case"
        assert not name.endswith("_total"), f"{name}: only a counter's samples end in _total"
        assert not any(name.endswith(u) or f"{u}_" in name for u in BAD_UNITS), f"{name}: not a base unit"
        if any(w in name for w in TIME_WORDS):
            assert name.endswith("_seconds"), f"{name}: a time must be in seconds"
        for s in f.samples:
            if f.type == "counter":
                assert s.name == f"{name}_total", f"counter sample {s.name} must end in _total"
            elif f.type == "histogram":
                assert s.name in (f"{name}_bucket", f"{name}_count", f"{name}_sum"), s.name
            else:
                assert s.name == name, s.name
    for must, kind in [("tidal_scheduler_decision_duration_seconds", "histogram"),
                       ("tidal_rescale_pause_seconds", "histogram"), ("tidal_api_request_duration_seconds", "histogram"),
                       ("tidal_scheduler_rounds", "counter"), ("tidal_job_steps", "counter"),
                       ("tidal_job_gpus", "gauge"), ("tidal_node_up", "gauge")]:
        assert fams[must].type == kind, must
    labels = lambda n: {k for s in fams[n].samples for k in s.labels}  # noqa: E731
    assert {"job", "tenant"} <= labels("tidal_job_gpus") and "node" in labels("tidal_node_gpus")
    assert {"method", "route", "status", "le"} <= labels("tidal_api_request_duration_seconds")


def test_pauses_and_requests_land_in_their_histograms(env):
    client, _, a, _ = env
    client.get("/v1/jobs/nope", headers=hdr("alice-tok"))
    fams = families(client.get("/metrics").text)
    pause = {(s.name, s.labels.get("kind"), s.labels.get("le")): s.value for s in fams["tidal_rescale_pause_seconds"].samples}
    assert pause[("tidal_rescale_pause_seconds_bucket", "scale_out", "0.025")] == 1
    assert pause[("tidal_rescale_pause_seconds_bucket", "scale_in", "1.0")] == 0  # 2 s is over 1 s
    assert pause[("tidal_rescale_pause_seconds_bucket", "scale_in", "2.5")] == 1
    assert pause[("tidal_rescale_pause_seconds_sum", "scale_in", None)] == pytest.approx(2.0)
    api = [s for s in fams["tidal_api_request_duration_seconds"].samples if s.name.endswith("_count")]
    # the route's template, never the raw path (junk URLs add no series)
    assert any(s.labels["route"] == "/v1/jobs/{job_id}" and s.labels["status"] == "404" for s in api)
    assert not any("nope" in s.labels["route"] for s in api)


def test_per_job_series_show_only_to_whoever_may_see_the_job(env):
    client, _, a, b = env

    def jobs_in(headers: dict) -> set[str]:
        fams = families(client.get("/metrics", headers=headers).text)
        return {s.labels["job"] for f in fams.values() for s in f.samples if "job" in s.labels}

    assert jobs_in({}) == set()  # an anonymous scrape names no job and no tenant
    assert "alice" not in client.get("/metrics").text
    assert jobs_in(hdr("alice-tok")) == {a}
    assert jobs_in(hdr("admin-tok")) == {a, b}
    assert client.get("/metrics", headers=hdr("wrong")).status_code == 401
    steps = {s.labels["job"]: s.value for s in families(client.get("/metrics", headers=hdr("admin-tok")).text)[
        "tidal_job_steps"].samples}
    assert steps == {a: 12, b: 0}


def exposed_names(text: str) -> set[str]:
    """Every series name a query may use, also of families without samples yet."""
    out = set()
    for f in text_string_to_metric_families(text):
        if f.type == "counter":
            out.add(f"{f.name}_total")
        elif f.type == "histogram":
            out |= {f"{f.name}_bucket", f"{f.name}_count", f"{f.name}_sum"}
        else:
            out.add(f.name)
    return out


def test_the_grafana_dashboard_uses_only_exposed_metrics(env):
    client, *_ = env
    dash = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"]]
    used = {m for e in exprs for m in re.findall(r"\btidal_[a-z0-9_]+", e)}
    exposed = exposed_names(client.get("/metrics", headers=hdr("admin-tok")).text)
    assert used and used <= exposed, f"not exposed: {sorted(used - exposed)}"
    # every histogram and the per-job series have a panel
    for name in ("tidal_scheduler_decision_duration_seconds_bucket", "tidal_rescale_pause_seconds_bucket",
                 "tidal_api_request_duration_seconds_bucket", "tidal_job_steps_total", "tidal_job_gpus"):
        assert name in used, name
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dash["panels"])
