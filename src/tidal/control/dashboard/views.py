"""What the dashboard shows, as JSON: built from the public API's own route
functions (so a tenant sees exactly what ``/v1/...`` shows it) plus the
fields the API does not expose yet (throughput, GPU range, predicted finish,
the admission decision, an auto-sized job's sizing, the rescale timeline)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any, Iterable

from sqlalchemy import select

from tidal.control.api import cluster as cluster_api
from tidal.control.api import jobs as jobs_api
from tidal.control.coordinator import Coordinator
from tidal.control.credentials import Principal
from tidal.control.db import Job, Store
from tidal.control.promstats import DecisionLog
from tidal.control.snapshot import job_spec
from tidal.control.spawner import worker_resources
from tidal.core.errors import InputError

#: the tail of a job's logs the job page shows (characters per process)
LOG_TAIL_CHARS = 4000
#: the decisions the scheduler view lists (rows: identical consecutive ones folded into one)
DECISIONS_SHOWN = 40
#: the newest decisions folded into those rows
DECISIONS_FOLDED = 200


def actions(p: Principal, user: str, state: str) -> dict[str, bool]:
    """What ``p`` may do to a job of ``user`` in ``state``, by the rules of
    ``POST /v1/jobs/{id}/scale`` and ``/cancel`` (the page hides the rest)."""
    mine = p.admin or user == p.name
    return {"scale": mine and state in jobs_api.PINNABLE, "cancel": mine and state not in jobs_api.FINISHED}


def gpu_range(j: Job, total: int) -> tuple[int, int]:
    """(min, max) GPUs the job may run at on a cluster of ``total``: an
    auto-sized job's plan once it has one, the size it measures before (what
    :func:`tidal.control.autoconf.apply_autoconf` gives the policy), else its
    spec's."""
    st = j.autoconf or {}
    if st.get("stage") == "planned" and st.get("plan"):
        return int(st["plan"]["min"]), int(st["plan"]["max"])
    if st.get("stage") == "sampling" and st.get("target"):
        return int(st["target"]), int(st["target"])  # the size being measured
    try:
        spec = job_spec(j)
    except (InputError, KeyError, TypeError, ValueError):
        return 0, 0
    return spec.lo, spec.hi(max(total, spec.lo))


def sizing(j: Job) -> dict[str, Any] | None:
    """An auto-sized job's sizing (docs/autoconf.md): its stage, the sizes
    measured or to measure, the plan (GPUs, range, memory limit, reason) and
    the per-worker memory limit new workers get; None for a job sized by
    its spec."""
    st = j.autoconf
    if not st:
        return None
    plan = st.get("plan") if st.get("stage") == "planned" else None
    return {"stage": st.get("stage"), "target": st.get("target"), "queue": list(st.get("queue") or ()),
            "measured": sorted({int(p[0]) for p in st.get("samples") or ()}),
            "plan": {k: plan.get(k) for k in ("gpus", "min", "max", "memory", "reason")} if plan else None,
            "memory": worker_resources(j).get("memory")}


def job_extra(j: Job, total: int, now: float) -> dict[str, Any]:
    """The job's fields beyond the API's listing: GPU range, throughput,
    absolute deadline and predicted finish, and the admission decision."""
    progress = j.progress or {}
    jobspec = (j.spec or {}).get("jobspec") or {}
    lo, hi = gpu_range(j, total)
    step_s = float(progress.get("step_time_s") or 0.0)
    batch = int(j.batch or jobspec.get("batch_size") or 0)
    stalled = jobs_api.stalled_s(j, now)
    live = j.state in ("running", "resizing") and step_s > 0 and not stalled
    iters = jobspec.get("iterations") or 0
    step = int(progress.get("step") or 0)
    finish = now + max(0, iters - step) * step_s if live and iters else None
    tags = {k: v for k, v in (j.tags or {}).items() if not k.startswith("_")}
    return {
        "min_gpus": lo, "max_gpus": hi, "steps_per_s": 1.0 / step_s if live else 0.0,
        "samples_per_s": batch / step_s if live else 0.0, "batch": batch,
        "deadline_at": jobspec.get("deadline"), "predicted_finish": finish, "stalled_s": stalled,
        "sizing": sizing(j),
        "admission": {"admitted": bool(j.admitted), "drop_reason": j.drop_reason or "",
                      "class": tags.get("ef_class"), "share": tags.get("ef_share"),
                      "plan": tags.get("ef_plan"), "tags": tags},
    }


class History:
    """Each job's recent throughput samples, taken whenever a dashboard
    snapshot is built (at most one per job per ``every_s``), bounded."""

    def __init__(self, per_job: int = 600, jobs: int = 500, every_s: float = 1.0) -> None:
        self._data: OrderedDict[str, deque[tuple[float, float, int]]] = OrderedDict()
        self.per_job, self.jobs, self.every_s = per_job, jobs, every_s
        self._lock = threading.Lock()

    def add(self, rows: Iterable[dict[str, Any]], now: float) -> None:
        with self._lock:
            for r in rows:
                if r["state"] not in ("running", "resizing"):
                    continue
                d = self._data.setdefault(r["id"], deque(maxlen=self.per_job))
                self._data.move_to_end(r["id"])
                if not d or now - d[-1][0] >= self.every_s:
                    d.append((now, float(r["samples_per_s"]), len(r["gpus"])))
            while len(self._data) > self.jobs:
                self._data.popitem(last=False)

    def of(self, job_id: str) -> list[list[float]]:
        with self._lock:
            return [list(x) for x in self._data.get(job_id, ())]


def jobs_view(store: Store, p: Principal, total: int, now: float) -> list[dict[str, Any]]:
    """The jobs ``p`` may see (``GET /v1/jobs``'s answer), each with :func:`job_extra`."""
    rows = jobs_api.list_jobs(p, store)
    with store.session(write=False) as s:
        by_id = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_([r["id"] for r in rows])))}
        for r in rows:
            j = by_id.get(r["id"])
            if j is not None:
                r.update(job_extra(j, total, now), actions=actions(p, j.user, j.state))
    return rows


def scheduler_view(log: DecisionLog | None, p: Principal, visible: set[str]) -> dict[str, Any]:
    """Recent decisions (None: the coordinator records none); a tenant sees
    its own jobs in them by id, the others counted."""
    if log is None:
        return {"recorded": False, "decisions": [], "rows": []}
    out = []
    for d in log.recent(DECISIONS_FOLDED):
        if not p.admin:
            hidden = {*d["allocation"], *d["drop"], *d["admit"], *d["changes"]} - visible
            d = {**d, "admit": [j for j in d["admit"] if j in visible],
                 "drop": {j: r for j, r in d["drop"].items() if j in visible},
                 "allocation": {j: n for j, n in d["allocation"].items() if j in visible},
                 "changes": {j: c for j, c in d["changes"].items() if j in visible}, "other_jobs": len(hidden)}
        out.append(d)
    return {"recorded": True, "decisions": out[:DECISIONS_SHOWN], "rows": fold(out)[:DECISIONS_SHOWN]}


#: what makes two decisions the same row of the scheduler view (not their time or latency)
SAME_DECISION = ("jobs", "admit", "drop", "allocation", "changes", "other_jobs")


def fold(decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive identical decisions (newest first) as one row: the newest
    one with ``count``, ``first_time`` (the oldest's time) and the highest
    latency among them as ``latency_max_s``."""
    rows: list[dict[str, Any]] = []
    for d in decisions:
        last = rows[-1] if rows else None
        if last is not None and all(last.get(k) == d.get(k) for k in SAME_DECISION):
            last.update(count=last["count"] + 1, first_time=d["time"],
                        latency_max_s=max(last["latency_max_s"], d["latency_s"]))
        else:
            rows.append({**d, "count": 1, "first_time": d["time"], "latency_max_s": d["latency_s"]})
    return rows


def overview(store: Store, coord: Coordinator, p: Principal, decisions: DecisionLog | None,
             history: History) -> dict[str, Any]:
    """The cluster, the jobs and the scheduler as ``p`` may see them."""
    now = time.time()
    cl = cluster_api.cluster(p, store, coord)
    total = sum(len(n["gpus"]) for n in cl["nodes"])
    rows = jobs_view(store, p, total, now)
    history.add(rows, now)
    return {"time": now, "me": me(p), "policy": cl["policy"], "rounds": cl["rounds"], "nodes": cl["nodes"],
            "jobs": rows, "scheduler": scheduler_view(decisions, p, {r["id"] for r in rows})}


def me(p: Principal) -> dict[str, Any]:
    return {"name": p.name, "role": p.role, "admin": p.admin}


def log_tail(d: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """The last ``chars`` of each process's log in ``d``, each line prefixed
    with its process name (as ``GET /v1/jobs/{id}/logs`` shows them)."""
    if not d.is_dir():
        return ""
    parts = []
    for f in sorted(d.glob("*.log")):
        with f.open("rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - chars))
            text = fh.read().decode(errors="replace")
        lines = text.splitlines()[1:] if size > chars else text.splitlines()  # drop a cut first line
        parts.extend(f"[{f.stem}] {line}" for line in lines)
    return "\n".join(parts)
