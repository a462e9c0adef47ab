"""``/v1/jobs``: submit, list, show, pin (``tidal scale``), cancel, logs.

A submission may carry an ``Idempotency-Key`` header (or the equivalent
``idempotency_key`` query parameter): the same key from the same user again
(a client's retry) answers 200 with the job the first one created, never a
second job; with a different body it is refused (422). A unique index on
(user, key) settles concurrent duplicates. Logs are addressed
by process name (``master``, ``w3``), never by a path.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tidal import settings
from tidal.control.autoconf import new_state
from tidal.control.api.deps import CoordinatorDep, JobId, LogsDirDep, StoreDep, UserDep, own_job
from tidal.control.db import GPU, Event, Job, Node, Process, Store
from tidal.control.jobrules import check_env, check_paths
from tidal.control.phases import stall_reason, stalled_for
from tidal.control.snapshot import job_spec
from tidal.control.spawner import worker_resources
from tidal.control.spec import JobSubmission
from tidal.core.job import JobSpec
from tidal.scheduler.constraints import type_phrase

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

FINISHED = ("completed", "failed", "cancelled", "dropped")
PINNABLE = ("submitted", "pending", "running", "resizing")


#: a job id as submit makes them (the name's characters, "-", six hex digits); anything else is a
#: 422 before the store sees it (PostgreSQL refuses text with NUL in it)


class ScaleRequest(BaseModel):
    gpus: int = Field(..., ge=0, description="pin the job at this many GPUs; 0 releases the pin")


KEY_HEADER = "Idempotency-Key"
KEY_PATTERN = r"^[!-~](?:[ -~]*[!-~])?$"  # printable ASCII, no space at either end
KEY_DOC = ("1-128 printable ASCII characters chosen by the client for one submission: a retry with the same key "
           "returns the job the first attempt created (200) instead of creating another")


def idempotency_key(
    header: Annotated[str | None, Header(alias=KEY_HEADER, min_length=1, max_length=128, pattern=KEY_PATTERN,
                                         description=KEY_DOC)] = None,
    query: Annotated[str | None, Query(alias="idempotency_key", min_length=1, max_length=128, pattern=KEY_PATTERN,
                                       description=f"the {KEY_HEADER} for clients that cannot set a header")] = None,
) -> str | None:
    """The submission's key, from the header or the query (422 if they differ)."""
    if header is not None and query is not None and header != query:
        raise HTTPException(422, detail=[{"loc": ["header", KEY_HEADER], "type": "value_error",
                                          "msg": "differs from the idempotency_key query parameter"}])
    return header if header is not None else query


IdempotencyKey = Annotated[str | None, Depends(idempotency_key)]
ID_TRIES = 32  # fresh tries when a random job id, or the next slot (a concurrent submission), is taken


@router.post("", status_code=201, responses={200: {"description": "an earlier submission with this "
                                                                  "Idempotency-Key: its job"}})
def submit(sub: JobSubmission, p: UserDep, store: StoreDep, coord: CoordinatorDep, response: Response,
           key: IdempotencyKey) -> dict[str, Any]:
    """Create a job (201), or with a known ``Idempotency-Key`` return its job (200)."""
    body = json.loads(json.dumps(sub.model_dump()))  # as the store gives it back
    earlier = _replay(store, p.name, key, body)
    if earlier is not None:
        response.status_code = 200
        return earlier
    check_env(sub.env)  # what the job may ask of the hosts (docs/security.md)
    check_paths(sub.script, sub.workdir, p.name, p.admin)
    now = time.time()
    spec = sub.to_jobspec(sub.name, now, p.name)
    total = _total_gpus(store)
    # a count must fit as asked; a range or a set needs only its smallest size (it runs at what fits)
    ranged = spec.max_gpus is not None or spec.allowed_gpus is not None
    need = spec.lo if ranged else max(spec.lo, spec.requested_gpus or 0)
    if total and need > total:
        raise HTTPException(422, detail=[{"loc": ["body", "gpus"], "msg": f"asks for {need} GPUs, cluster has {total}",
                                          "type": "value_error"}])
    problem = _type_problem(store, spec, need)
    if problem:
        raise HTTPException(422, detail=[{"loc": ["body", "gpu_types"], "msg": problem, "type": "value_error"}])
    for _ in range(ID_TRIES):
        job_id = f"{sub.name}-{uuid.uuid4().hex[:6]}"
        spec = replace(spec, job_id=job_id)
        try:
            with store.session() as s:
                # the next slot; two submissions that read the same one at once: the unique index refuses one
                slot = int(s.scalar(select(func.max(Job.slot))) or 0) + 1
                s.add(Job(id=job_id, user=p.name, name=sub.name, state="submitted", submit_time=now, slot=slot,
                          spec={"submission": body, "jobspec": asdict(spec)}, waiting_since=now,
                          idempotency_key=key, autoconf=new_state() if sub.auto else None))
                store.log(s, "job.submitted", job_id, user=p.name)
        except IntegrityError:  # the key's job was created meanwhile, or the random id is taken
            earlier = _replay(store, p.name, key, body)
            if earlier is not None:
                response.status_code = 200
                return earlier
            continue
        coord.wake()
        return {"id": job_id, "state": "submitted"}
    raise RuntimeError(f"no free job id or slot for {sub.name!r} after {ID_TRIES} tries")


def _replay(store: Store, user: str, key: str | None, body: dict[str, Any]) -> dict[str, Any] | None:
    """The answer for ``user``'s job submitted with ``key`` (None: no such job);
    422 if that job was submitted with another body."""
    if key is None:
        return None
    with store.session(write=False) as s:
        j = s.scalar(select(Job).where(Job.user == user, Job.idempotency_key == key))
        if j is None:
            return None
        if (j.spec or {}).get("submission") != body:
            raise HTTPException(422, detail=[{
                "loc": ["header", KEY_HEADER],
                "msg": f"this {KEY_HEADER} was used for another submission (job {j.id}); use a new key",
                "type": "idempotency_key_reused"}])
        return {"id": j.id, "state": j.state}


@router.get("")
def list_jobs(p: UserDep, store: StoreDep) -> list[dict[str, Any]]:
    with store.session(write=False) as s:
        q = select(Job).order_by(Job.submit_time)
        if not p.admin:
            q = q.where(Job.user == p.name)
        return [job_json(s, store, j) for j in s.scalars(q)]


@router.get("/{job_id}")
def get_job(job_id: JobId, p: UserDep, store: StoreDep) -> dict[str, Any]:
    with store.session(write=False) as s:
        out = job_json(s, store, own_job(s, job_id, p), detail=True)
        out["events"] = [
            {"time": e.time, "kind": e.kind, "gpu": e.gpu, **(e.detail or {})}
            for e in s.scalars(select(Event).where(Event.job_id == job_id).order_by(Event.id))
        ]
        return out


@router.post("/{job_id}/scale")
def scale(job_id: JobId, req: ScaleRequest, p: UserDep, store: StoreDep, coord: CoordinatorDep) -> dict[str, Any]:
    """Pin the job at ``gpus`` GPUs until released (``gpus`` 0): the policy
    sizes it at that count and never suspends it while it holds GPUs (as
    ``kubectl scale`` holds a replica count)."""
    total = _total_gpus(store)
    with store.session() as s:
        j = own_job(s, job_id, p)
        if j.state not in PINNABLE:
            raise HTTPException(409, f"job {job_id} is {j.state}")
        if req.gpus == 0:
            j.spec = {k: v for k, v in j.spec.items() if k != "pinned"}
            store.log(s, "job.unpinned", job_id, by=p.name)
            coord.wake()
            return {"id": job_id, "pinned": None}
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
def cancel(job_id: JobId, p: UserDep, store: StoreDep, coord: CoordinatorDep) -> dict[str, Any]:
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


PROCESS_NAME = re.compile(r"^(master|w[0-9]{1,9})$")  # the names the coordinator gives
SAFE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$")  # a file name, never a path


@router.get("/{job_id}/logs", response_class=PlainTextResponse)
def logs(job_id: JobId, p: UserDep, store: StoreDep, logs_dir: LogsDirDep,
         worker: Annotated[str | None, Query(max_length=64, description="a process of the job: master, w0, ...")]
         = None, offset: Annotated[int, Query(ge=0)] = 0) -> str:
    """Every process's output, each line prefixed with its name (or one
    process's, as it is), from character ``offset`` on. ``worker`` names a
    process of this job (422 for anything else, before any file is read)."""
    with store.session(write=False) as s:
        own_job(s, job_id, p)
        if worker is not None and not _is_process_of(s, job_id, worker):
            raise HTTPException(422, detail=[{"loc": ["query", "worker"], "type": "value_error",
                                              "msg": "not a process of this job (master, w0, w1, ...)"}])
    return read_logs(logs_dir / job_id, worker)[offset:]


def _is_process_of(s: Session, job_id: str, name: str) -> bool:
    """``name`` is a plain process name the job has, or may have had, a log under."""
    if not SAFE_NAME.match(name):
        return False
    return bool(PROCESS_NAME.match(name)) or name in set(
        s.scalars(select(Process.name).where(Process.job_id == job_id)))


def read_logs(d: Path, worker: str | None) -> str:
    """The logs in ``d``; ``worker`` must be a checked process name."""
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
    with store.session(write=False) as s:
        return int(s.scalar(select(func.count()).select_from(GPU)) or 0)


def _type_problem(store: Store, spec: JobSpec, need: int) -> str | None:
    """Why a job's GPU types can never hold ``need`` GPUs on the registered
    nodes (up or down; None when it can, or no node is registered yet)."""
    if not spec.constrained:
        return None
    with store.session(write=False) as s:
        nodes = [(str((n.labels or {}).get("gpu-type", "")), n.num_gpus) for n in s.scalars(select(Node))]
    if not nodes:
        return None
    have = sum(k for t, k in nodes if spec.allows_type(t))
    if have >= need:
        return None
    types = ", ".join(dict.fromkeys(t or "untyped" for t, _ in nodes))
    return f"asks for {need} GPUs {type_phrase(spec)}, the cluster has {have} (its types: {types})"


def _resources(j: Job) -> dict[str, Any]:
    """The job's per-worker limits now (memory in bytes, as raised after
    out-of-memory kills) and how many such kills raised it."""
    return {**worker_resources(j), "ooms": int((j.tags or {}).get("_ooms", 0))}


def job_reason(j: Job, now: float) -> str:
    """Why the job is where it is, as the liveness contract says it
    (docs/control.md, "Liveness"): the failure reason of an ended job, a
    restart's cause, or a worker being replaced after an error; "" when
    nothing is to be said."""
    if j.state in ("failed", "cancelled", "completed", "dropped"):
        return j.exit_info or j.drop_reason or ""
    tags = j.tags or {}
    if j.state == "restarting" or (j.state == "pending" and (j.progress or {}).get("state") == "restarting"):
        return str(tags.get("_reason") or "")
    if j.state == "pending" and tags.get("_waiting"):  # no free GPU of its types (tidal.scheduler.constraints)
        return str(tags["_waiting"])
    idle = stalled_s(j, now)
    if idle:
        return stall_reason(idle, settings.STALL_TIMEOUT_S.get())
    crash = tags.get("_crash") or {}
    wait = float(tags.get("_backoff_until") or 0.0) - now
    if crash and wait > 0:
        return (f"a worker exited with an error ({crash.get('count')} in a row): {crash.get('line')}; "
                f"replaced in {wait:.0f} s")
    return ""


def stalled_s(j: Job, now: float) -> float:
    """How long the running job has committed no step, once that is past
    the stall time-out the coordinator restarts a job after
    (:func:`tidal.control.phases.stalled_for`); 0: it is not stalled."""
    progress = j.progress or {}
    if j.state not in ("running", "resizing") or progress.get("state") not in ("running", "changing"):
        return 0.0
    return round(stalled_for(float(progress.get("step_at") or 0.0), now, settings.STALL_TIMEOUT_S.get()), 1)


def job_json(s: Session, store: Store, j: Job, detail: bool = False) -> dict[str, Any]:
    """A job as the API shows it; ``detail`` adds its spec, progress and processes."""
    progress = j.progress or {}
    jobspec = j.spec.get("jobspec", {})
    now = time.time()
    out = {
        "id": j.id, "user": j.user, "name": j.name, "state": j.state, "submit_time": j.submit_time,
        "start_time": j.start_time, "end_time": j.end_time, "gpus": store.job_gpus(s, j.id),
        "target": j.target, "step": progress.get("step", 0),
        "iterations": jobspec.get("iterations"), "world_size": progress.get("world_size", 0),
        "rescales": j.rescales, "drop_reason": j.drop_reason, "pinned": j.spec.get("pinned"),
        "deadline": jobspec.get("deadline"), "reason": job_reason(j, now), "stalled_s": stalled_s(j, now),
        "gpu_types": jobspec.get("gpu_types"), "exclude_gpu_types": list(jobspec.get("exclude_gpu_types") or ()),
    }
    if detail:
        out.update(spec=j.spec.get("submission", {}), progress=j.progress, master_url=j.master_url,
                   exit_info=j.exit_info, resources=_resources(j), autoconf=j.autoconf)
        out["processes"] = [
            {"name": w.name, "kind": w.kind, "node": w.node, "gpu": w.gpu, "state": w.state, "pid": w.pid,
             "exit_code": w.exit_code, "resources": dict(w.resources or {}), "error": w.error or ""}
            for w in s.scalars(select(Process).where(Process.job_id == j.id).order_by(Process.id))
        ]
    return out
