"""``/v1/jobs``: submit, list, show, pin (``tidal scale``), cancel, logs."""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tidal.control.api.deps import CoordinatorDep, LogsDirDep, StoreDep, UserDep, own_job
from tidal.control.db import GPU, Event, Job, Process, Store
from tidal.control.snapshot import job_spec
from tidal.control.spec import JobSubmission

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

FINISHED = ("completed", "failed", "cancelled", "dropped")
PINNABLE = ("submitted", "pending", "running", "resizing")


class ScaleRequest(BaseModel):
    gpus: int = Field(..., ge=1)


@router.post("", status_code=201)
def submit(sub: JobSubmission, p: UserDep, store: StoreDep, coord: CoordinatorDep) -> dict[str, Any]:
    now = time.time()
    job_id = f"{sub.name}-{uuid.uuid4().hex[:6]}"
    spec = sub.to_jobspec(job_id, now, p.name)
    total = _total_gpus(store)
    need = max(spec.lo, spec.requested_gpus or 0)
    if total and need > total:
        raise HTTPException(422, detail=[{"loc": ["body", "gpus"], "msg": f"asks for {need} GPUs, cluster has {total}",
                                          "type": "value_error"}])
    with store.session() as s:
        s.add(Job(id=job_id, user=p.name, name=sub.name, state="submitted", submit_time=now,
                  spec={"submission": sub.model_dump(), "jobspec": asdict(spec)}, waiting_since=now))
        store.log(s, "job.submitted", job_id, user=p.name)
    coord.wake()
    return {"id": job_id, "state": "submitted"}


@router.get("")
def list_jobs(p: UserDep, store: StoreDep) -> list[dict[str, Any]]:
    with store.session() as s:
        q = select(Job).order_by(Job.submit_time)
        if not p.admin:
            q = q.where(Job.user == p.name)
        return [job_json(s, store, j) for j in s.scalars(q)]


@router.get("/{job_id}")
def get_job(job_id: str, p: UserDep, store: StoreDep) -> dict[str, Any]:
    with store.session() as s:
        out = job_json(s, store, own_job(s, job_id, p), detail=True)
        out["events"] = [
            {"time": e.time, "kind": e.kind, "gpu": e.gpu, **(e.detail or {})}
            for e in s.scalars(select(Event).where(Event.job_id == job_id).order_by(Event.id))
        ]
        return out


@router.post("/{job_id}/scale")
def scale(job_id: str, req: ScaleRequest, p: UserDep, store: StoreDep, coord: CoordinatorDep) -> dict[str, Any]:
    """Pin the job at ``gpus`` GPUs: the policy uses that count from now on."""
    total = _total_gpus(store)
    with store.session() as s:
        j = own_job(s, job_id, p)
        if j.state not in PINNABLE:
            raise HTTPException(409, f"job {job_id} is {j.state}")
        over = bool(total) and req.gpus > total  # no node registered yet: only the job's own range counts
        if over or not job_spec(j).can_run_at(req.gpus):
            why = f"the cluster has {total} GPUs" if over else "the job cannot run at that size"
            raise HTTPException(422, detail=[{"loc": ["body", "gpus"], "msg": f"{req.gpus} GPUs: {why}",
                                              "type": "value_error"}])
        j.spec = {**j.spec, "pinned": req.gpus}
        store.log(s, "job.pinned", job_id, gpus=req.gpus, by=p.name)
    coord.wake()
    return {"id": job_id, "pinned": req.gpus}


@router.post("/{job_id}/cancel")
def cancel(job_id: str, p: UserDep, store: StoreDep, coord: CoordinatorDep) -> dict[str, Any]:
    """A job with GPUs or a master is cancelling (the coordinator stops it); otherwise cancelled at once."""
    with store.session() as s:
        j = own_job(s, job_id, p)
        if j.state in FINISHED:
            return {"id": job_id, "state": j.state}
        j.state = "cancelling" if store.job_gpus(s, job_id) or j.master_url else "cancelled"
        if j.state == "cancelled":
            j.end_time = time.time()
        store.log(s, "job.cancel", job_id, by=p.name)
        state = j.state
    coord.wake()
    return {"id": job_id, "state": state}


@router.get("/{job_id}/logs", response_class=PlainTextResponse)
def logs(job_id: str, p: UserDep, store: StoreDep, logs_dir: LogsDirDep, worker: str | None = None,
         offset: int = 0) -> str:
    """Every process's output, each line prefixed with its name (or one
    process's, as it is), from character ``offset`` on."""
    with store.session() as s:
        own_job(s, job_id, p)
    return read_logs(logs_dir / job_id, worker)[offset:]


def read_logs(d: Path, worker: str | None) -> str:
    if not d.exists():
        return ""
    files = sorted(d.glob("*.log")) if worker is None else [d / f"{worker}.log"]
    parts = []
    for f in files:
        if f.exists():
            text = f.read_text(errors="replace")
            parts.append(text if worker else "".join(f"[{f.stem}] {line}\n" for line in text.splitlines()))
    return "".join(parts)


def _total_gpus(store: Store) -> int:
    with store.session() as s:
        return int(s.scalar(select(func.count()).select_from(GPU)) or 0)


def job_json(s: Session, store: Store, j: Job, detail: bool = False) -> dict[str, Any]:
    """A job as the API shows it; ``detail`` adds its spec, progress and processes."""
    progress = j.progress or {}
    jobspec = j.spec.get("jobspec", {})
    out = {
        "id": j.id, "user": j.user, "name": j.name, "state": j.state, "submit_time": j.submit_time,
        "start_time": j.start_time, "end_time": j.end_time, "gpus": store.job_gpus(s, j.id),
        "target": j.target, "step": progress.get("step", 0),
        "iterations": jobspec.get("iterations"), "world_size": progress.get("world_size", 0),
        "rescales": j.rescales, "drop_reason": j.drop_reason, "pinned": j.spec.get("pinned"),
        "deadline": jobspec.get("deadline"),
    }
    if detail:
        out.update(spec=j.spec.get("submission", {}), progress=j.progress, master_url=j.master_url,
                   exit_info=j.exit_info)
        out["processes"] = [
            {"name": w.name, "kind": w.kind, "node": w.node, "gpu": w.gpu, "state": w.state, "pid": w.pid,
             "exit_code": w.exit_code}
            for w in s.scalars(select(Process).where(Process.job_id == j.id).order_by(Process.id))
        ]
    return out
