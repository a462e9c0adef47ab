"""The server's Prometheus metrics and the in-memory records behind them.

* :class:`DecisionLog` — a bounded ring of the scheduler's recent decisions
  (policy, latency, what the plan admitted, dropped and allocated) and the
  ``tidal_scheduler_decision_duration_seconds`` histogram. The coordinator
  records each plan in it; the dashboard's scheduler view reads it.
* :class:`RequestTimer` — ASGI middleware: ``tidal_api_request_duration_seconds``
  by method, route template (never the raw path) and status.
* :func:`render` — the text ``/metrics`` serves: the store's state (jobs, GPUs,
  nodes, events, rescale pauses) plus the two above. Per-job series (labels
  ``job`` and ``tenant``) are shown to whoever may see the job: the admin all,
  a tenant its own, an anonymous scrape none (docs/dashboard.md, "Metrics").

Naming follows Prometheus: ``tidal_`` prefix, ``_total`` for counters,
``_seconds`` for times, base units.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from sqlalchemy import func, select

from tidal.control.credentials import Principal
from tidal.control.db import GPU, Event, Job, Node, Store

if TYPE_CHECKING:
    from tidal.scheduler.api import Plan, Snapshot

#: decision latency buckets: a round plans in milliseconds, a large ElasticFlow replan in seconds
DECISION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: a rescale's pause: stop-free changes pause tens of milliseconds, a stop-and-restart seconds
PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: API latency buckets
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: routes whose responses stream for as long as the client stays (not timed)
STREAMING_ROUTES = frozenset({"/dashboard/api/stream"})


class DecisionLog:
    """The last ``size`` scheduling decisions, and their latency histogram."""

    def __init__(self, size: int = 200) -> None:
        self._ring: deque[dict[str, Any]] = deque(maxlen=size)
        self._lock = threading.Lock()
        self._seq = 0
        self.latency = Histogram("tidal_scheduler_decision_duration_seconds",
                                 "Time the policy took to make one plan", ["policy"],
                                 buckets=DECISION_BUCKETS, registry=None)

    def record(self, policy: str, snap: "Snapshot", plan: "Plan", latency_s: float, now: float | None = None) -> None:
        """One plan of ``policy`` made from ``snap`` in ``latency_s`` seconds."""
        held = {v.job_id: len(v.gpus) for v in snap.jobs if v.gpus}
        entry = {
            "time": time.time() if now is None else now, "policy": policy, "latency_s": float(latency_s),
            "jobs": len(snap.jobs), "gpus": snap.cluster.num_gpus,
            "admit": sorted(plan.admit), "drop": dict(plan.drop),
            "allocation": {j: int(n) for j, n in plan.allocation.items()},
            "changes": {j: [held.get(j, 0), int(plan.allocation.get(j, 0))]
                        for j in set(held) | set(plan.allocation) if held.get(j, 0) != plan.allocation.get(j, 0)},
        }
        self.latency.labels(policy).observe(latency_s)
        with self._lock:
            self._seq += 1
            self._ring.append({"seq": self._seq, **entry})

    def recent(self, limit: int = 50) -> list[dict[str, Any]]:
        """The newest ``limit`` decisions, newest first."""
        with self._lock:
            return list(self._ring)[::-1][:limit]

    def collect(self) -> Iterable[Metric]:
        return _without_created(self.latency)


class RequestStats:
    """The API latency histogram the :class:`RequestTimer` fills."""

    def __init__(self) -> None:
        self.latency = Histogram("tidal_api_request_duration_seconds", "Time to answer an API request",
                                 ["method", "route", "status"], buckets=REQUEST_BUCKETS, registry=None)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.latency.labels(method, route, str(status)).observe(seconds)

    def collect(self) -> Iterable[Metric]:
        return _without_created(self.latency)


def _without_created(h: Histogram) -> Iterator[Metric]:
    """``h``'s families without the ``_created`` timestamps (OpenMetrics
    only; in the text format they would be a gauge series per label set)."""
    for m in h.collect():
        m.samples = [s for s in m.samples if not s.name.endswith("_created")]
        yield m


class RequestTimer:
    """ASGI middleware timing every HTTP request into ``stats``, labelled
    with the matched route's template (``/v1/jobs/{job_id}``; an unmatched
    path is ``other``, so junk URLs add no series)."""

    def __init__(self, app: Any, stats: RequestStats) -> None:
        self.app, self.stats = app, stats

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", None) or "other"
            if route not in STREAMING_ROUTES:
                self.stats.observe(scope.get("method", "GET"), route, status, time.perf_counter() - t0)


def install(app: Any) -> None:
    """Time ``app``'s requests (the middleware) and keep their histogram in
    ``app.state.request_stats``; ``app.state.decisions`` is the coordinator's
    decision log (``decisions_recorded``: False, and an empty log, if the
    coordinator keeps none)."""
    app.state.request_stats = RequestStats()
    coord = getattr(app.state, "coordinator", None)
    log = getattr(coord, "decisions", None)
    app.state.decisions_recorded = isinstance(log, DecisionLog)
    app.state.decisions = log if isinstance(log, DecisionLog) else DecisionLog()
    app.add_middleware(RequestTimer, stats=app.state.request_stats)


# -- /metrics --------------------------------------------------------------------------------------------------------
def render(store: Store, rounds: int, p: Principal | None, extra: Iterable[Any] = ()) -> str:
    """The Prometheus text of the cluster as ``p`` (None: an anonymous
    scrape) may see it; ``extra``: collectors with a ``collect()`` (the
    decision log, the request timer)."""
    reg = CollectorRegistry()
    reg.register(_StoreCollector(store, rounds, p))
    for c in extra:
        reg.register(c)
    return generate_latest(reg).decode()


class _StoreCollector:
    """The store's state as metric families, read in one session per scrape."""

    def __init__(self, store: Store, rounds: int, p: Principal | None) -> None:
        self.store, self.rounds, self.p = store, rounds, p

    def collect(self) -> Iterator[Metric]:
        with self.store.session(write=False) as s:
            yield from _cluster_families(s, self.rounds)
            yield from _node_families(s)
            jobs = list(s.scalars(select(Job)))
            yield from _pause_histogram(jobs)  # every job's pauses, named by none
            p = self.p
            # who may name a job: the public API's rule (tidal.control.api.deps.own_job)
            named = [j for j in jobs if p is not None and (p.admin or j.user == p.name)]
            yield from _job_families(s, named)


def _cluster_families(s: Any, rounds: int) -> Iterator[Metric]:
    g = GaugeMetricFamily("tidal_jobs", "Jobs by state", labels=["state"])
    for state, n in s.execute(select(Job.state, func.count()).group_by(Job.state)).all():
        g.add_metric([state], n)
    yield g
    g = GaugeMetricFamily("tidal_gpus", "GPUs by state", labels=["state"])
    for state, n in s.execute(select(GPU.state, func.count()).group_by(GPU.state)).all():
        g.add_metric([state], n)
    yield g
    yield CounterMetricFamily("tidal_scheduler_rounds", "Scheduling rounds run by this server", value=rounds)
    c = CounterMetricFamily("tidal_events", "Audit events recorded, by kind", labels=["kind"])
    for kind, n in s.execute(select(Event.kind, func.count()).group_by(Event.kind)).all():
        c.add_metric([kind], n)
    yield c


def _node_families(s: Any) -> Iterator[Metric]:
    up = GaugeMetricFamily("tidal_node_up", "1 if the node's agent is heart-beating", labels=["node"])
    beat = GaugeMetricFamily("tidal_node_last_heartbeat_timestamp_seconds", "The node's last heartbeat (Unix time)",
                             labels=["node"])
    gpus = GaugeMetricFamily("tidal_node_gpus", "GPUs of the node by state", labels=["node", "state"])
    util = GaugeMetricFamily("tidal_gpu_utilization_ratio", "GPU utilisation the agent reports (0-1)",
                             labels=["node", "gpu"])
    counts: dict[tuple[str, str], int] = {}
    for g in s.scalars(select(GPU)):
        counts[(g.node, g.state)] = counts.get((g.node, g.state), 0) + 1
        util.add_metric([g.node, str(g.index)], float(g.util or 0.0))
    for n in s.scalars(select(Node).order_by(Node.ordinal)):
        up.add_metric([n.name], 1.0 if n.state == "up" else 0.0)
        beat.add_metric([n.name], float(n.last_heartbeat or 0.0))
        for state in ("free", "in_use"):
            gpus.add_metric([n.name, state], counts.get((n.name, state), 0))
    yield from (up, beat, gpus, util)


def _pause_histogram(jobs: list[Job]) -> Iterator[Metric]:
    """Every finished group change's pause (the job masters' records), by kind:
    rebuilt from the store at each scrape, so it survives restarts and replicas."""
    by_kind: dict[str, list[float]] = {}
    for j in jobs:
        for ch in (j.progress or {}).get("changes") or ():
            if isinstance(ch, dict) and isinstance(ch.get("pause_s"), (int, float)):
                by_kind.setdefault(str(ch.get("kind", "?")), []).append(float(ch["pause_s"]))
    h = HistogramMetricFamily("tidal_rescale_pause_seconds", "Training pause of each group change (rescale)",
                              labels=["kind"])
    for kind, pauses in sorted(by_kind.items()):
        buckets = [(_le(b), sum(1 for x in pauses if x <= b)) for b in PAUSE_BUCKETS]
        h.add_metric([kind], buckets + [("+Inf", len(pauses))], sum_value=sum(pauses))
    yield h


def _le(b: float) -> str:
    return repr(float(b))


def _job_families(s: Any, jobs: list[Job]) -> Iterator[Metric]:
    """Per-job series of ``jobs`` (those the caller may name)."""
    labels = ["job", "tenant"]
    info = GaugeMetricFamily("tidal_job_info", "A job: 1, with its name and state", labels=[*labels, "name", "state"])
    gpus = GaugeMetricFamily("tidal_job_gpus", "GPUs the job holds", labels=labels)
    steps = CounterMetricFamily("tidal_job_steps", "Training steps the job committed", labels=labels)
    step_s = GaugeMetricFamily("tidal_job_step_duration_seconds", "The job's latest step time", labels=labels)
    rescales = CounterMetricFamily("tidal_job_rescales", "Group changes the job went through", labels=labels)
    gpu_s = CounterMetricFamily("tidal_job_gpu_seconds", "GPU time the job attained", labels=labels)
    deadline = GaugeMetricFamily("tidal_job_deadline_timestamp_seconds", "The job's deadline (Unix time)",
                                 labels=labels)
    held: dict[str, int] = dict(s.execute(select(GPU.job_id, func.count()).where(GPU.job_id.is_not(None))
                                          .group_by(GPU.job_id)).all())
    for j in jobs:
        lv = [j.id, j.user]
        progress = j.progress or {}
        info.add_metric([*lv, j.name, j.state], 1.0)
        gpus.add_metric(lv, held.get(j.id, 0))
        steps.add_metric(lv, float(progress.get("step") or 0))
        step_s.add_metric(lv, float(progress.get("step_time_s") or 0.0))
        rescales.add_metric(lv, len(progress.get("changes") or ()))
        gpu_s.add_metric(lv, float(j.attained or 0.0))
        dl = ((j.spec or {}).get("jobspec") or {}).get("deadline")
        if dl is not None:
            deadline.add_metric(lv, float(dl))
    yield from (info, gpus, steps, step_s, rescales, gpu_s, deadline)
