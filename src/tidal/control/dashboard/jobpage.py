"""The job page's data: ``GET /v1/jobs/{id}`` (events, processes) plus the
rescale timeline with each pause and its reason, the throughput curve, the
admission decision, the log tail and what the caller may do."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from tidal.control.api import jobs as jobs_api
from tidal.control.credentials import Principal
from tidal.control.dashboard.views import History, actions, job_extra, log_tail
from tidal.control.db import GPU, Job, Store

#: events that explain a recovery (a worker lost or killed)
LOSS_EVENTS = ("job.worker_lost", "worker.kill", "proc.failed", "proc.lost")
#: a recovery's control-plane event may be logged a little after the master re-formed the group
LOSS_LAG_S = 10.0


def change_reason(ch: dict[str, Any], events: list[dict[str, Any]], since: float, policy: str) -> str:
    """Why a group change happened, from the job's events between the
    previous change and this one."""
    t = float(ch.get("switched_at") or 0.0)
    kind = str(ch.get("kind", ""))
    window = [e for e in events if since <= e["time"] <= t]
    if kind == "recover":
        lost = [e for e in events if since <= e["time"] <= t + LOSS_LAG_S and e["kind"] in LOSS_EVENTS]
        if not lost:
            return "a worker was lost"
        e = lost[0]
        who = e.get("worker") or e.get("proc") or "a worker"
        code = f", exit code {e['exit_code']}" if e.get("exit_code") is not None else ""
        return f"{who} lost ({e['kind']}{code})" + (f": {e['reason']}" if e.get("reason") else "")
    if kind == "suspend":
        return f"preempted: the {policy} plan gave the job no GPU"
    if kind == "reshare":
        return "batch shares rebalanced between the workers (a straggler)"
    pins = [e for e in window if e["kind"] == "job.pinned"]
    if pins:
        return f"pinned at {pins[-1].get('gpus')} GPUs by {pins[-1].get('by', '?')}"
    return f"the {policy} plan: {ch.get('from_size')} → {ch.get('to_size')} GPUs"


def timeline(changes: list[dict[str, Any]], events: list[dict[str, Any]], policy: str,
             start: float | None) -> dict[str, Any]:
    """The job's GPU count over time (from the audit trail's assigns and
    releases) and its group changes, each with its pause and reason."""
    held: set[int] = set()
    sizes: list[list[float]] = []
    for e in events:
        if e["kind"] == "gpu.assign" and e.get("gpu") is not None:
            held.add(int(e["gpu"]))
        elif e["kind"] == "gpu.release" and e.get("gpu") is not None:
            held.discard(int(e["gpu"]))
        else:
            continue
        sizes.append([e["time"], len(held)])
    rows, since = [], float(start or 0.0)
    for ch in changes:
        if not isinstance(ch, dict):
            continue
        rows.append({"kind": ch.get("kind"), "from_size": ch.get("from_size"), "to_size": ch.get("to_size"),
                     "requested_at": ch.get("requested_at"), "switched_at": ch.get("switched_at"),
                     "switch_step": ch.get("switch_step"), "pause_s": float(ch.get("pause_s") or 0.0),
                     "reason": change_reason(ch, events, since, policy)})
        since = float(ch.get("switched_at") or since)
    return {"sizes": sizes, "changes": rows}


def segments(changes: list[dict[str, Any]], start: float | None, end: float, step: int,
             batch: int) -> list[list[float]]:
    """Average throughput (samples/s) between consecutive group changes:
    [t_from, t_to, samples_per_s], from the steps the changes switched at."""
    if start is None:
        return []
    marks = [(float(start), 0)]
    for ch in changes:
        if isinstance(ch, dict) and ch.get("switched_at") and ch.get("switch_step") is not None:
            marks.append((float(ch["switched_at"]), int(ch["switch_step"])))
    marks.append((end, step))
    out = []
    for (t0, s0), (t1, s1) in zip(marks, marks[1:]):
        if t1 - t0 > 0.5 and s1 >= s0:
            out.append([t0, t1, (s1 - s0) * max(batch, 1) / (t1 - t0)])
    return out


def job_detail(store: Store, p: Principal, job_id: str, logs_dir: Path, policy: str,
               history: History) -> dict[str, Any]:
    """The job page's data (404 for a job ``p`` may not see, as on the API)."""
    now = time.time()
    d = jobs_api.get_job(job_id, p, store)  # the API's permission check
    with store.session(write=False) as s:
        j = s.get(Job, job_id)
        total = int(s.scalar(select(func.count()).select_from(GPU)) or 0)
        if j is None:
            return d
        extra = job_extra(j, total, now)
        changes = list((j.progress or {}).get("changes") or ())
    end = d["end_time"] or now
    d.update(extra, actions=actions(p, d["user"], d["state"]),
             timeline=timeline(changes, d["events"], policy, d["start_time"]),
             throughput={"live": history.of(job_id),
                         "segments": segments(changes, d["start_time"], end, int(d["step"] or 0), extra["batch"])},
             logs=log_tail(logs_dir / job_id))
    d["events"] = d["events"][-200:]
    d.pop("spec", None)  # the submission's arguments and environment stay on the API
    return d
