"""``/internal``: agents register and heart-beat (the SideCar agent, §III-B);
job masters report their address and progress and ask for hung workers to be
stopped. Every route needs the agent (or admin) token."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, Field, field_validator
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from tidal import settings
from tidal.control.api.deps import AgentDep, CoordinatorDep, JobCredDep, JobId, LogsDirDep, NodeDep, NodeName, StoreDep
from tidal.control.coordinator import register_watch
from tidal.control.credentials import Credentials
from tidal.control.db import GPU, Job, MasterState, Node, Process, Store
from tidal.control.observe import incarnation, job_procs
from tidal.net import LOOPBACK

router = APIRouter(prefix="/internal", tags=["internal"])

NODE_TIMEOUT_S = 10.0  # a silent node takes no new work after this long (its processes go on)
WATCHED = ("up", "unreachable")  # node states judged for silence
MAX_LOG_CHUNK = 256 * 1024
MAX_ERROR = 2000  # characters of a process's error kept (its agent cuts it to as many)


def storable(text: str) -> str:
    """``text`` as the store and a UTF-8 file take it: a lone surrogate
    becomes ``\\udcXX`` and a NUL ``\\x00`` (PostgreSQL refuses it)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


class RegisterRequest(BaseModel):
    name: str = Field(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    num_gpus: int = Field(..., ge=1, le=1024)
    virtual: bool = False
    address: str = Field(LOOPBACK, max_length=256)
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    memory: int = Field(0, ge=0, le=2**62, description="the node's memory in bytes (0: unknown)")

    @field_validator("labels")
    @classmethod
    def _short_labels(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not 0 < len(k) <= 63 or len(val) > 128:
                raise ValueError(f"label {k[:70]!r}: keys take 1-63 characters, values at most 128")
        return v


class OomReport(BaseModel):
    """A process the agent saw end because it ran out of its memory limit."""

    limit: int = Field(0, ge=0, le=2**62)  # bytes
    peak: int = Field(0, ge=0, le=2**62)  # the highest use seen, bytes
    backend: str = Field("", max_length=16)  # cgroup2 | cgroup1 | watchdog


class ProcReport(BaseModel):
    id: int
    state: Literal["running", "exited", "failed"]  # as the agent saw it (the server may judge it lost)
    pid: int = 0
    exit_code: int | None = None
    log: str = ""
    oom: OomReport | None = None
    # why it ended when its exit code does not say, e.g. "launch failed: [Errno 13] Permission denied: ..."
    error: str = Field("", description=f"one line, cut to {MAX_ERROR} characters")

    @field_validator("log")
    @classmethod
    def _storable_log(cls, v: str) -> str:
        return v.encode("utf-8", "backslashreplace").decode("utf-8")

    @field_validator("error")
    @classmethod
    def _short_error(cls, v: str) -> str:
        return storable(v[:MAX_ERROR])[:MAX_ERROR]


class HeartbeatRequest(BaseModel):
    procs: list[ProcReport] = Field(default_factory=list)
    utils: dict[int, float] = Field(default_factory=dict)


@dataclass
class HeartbeatClock:
    """When this server last took a heartbeat. Nodes are judged down only
    while the server itself keeps taking heartbeats: after a stall of its own
    (or a restart), every node looks late."""

    last: float

    def stalled(self, now: float) -> bool:
        """Whether the server went more than half the node time-out without a heartbeat; ``now`` is the new last."""
        gap, self.last = now - self.last, now
        return gap > NODE_TIMEOUT_S / 2


# -- agents ------------------------------------------------------------------------------
@router.post("/agents/register")
def register(req: RegisterRequest, request: Request, store: StoreDep, coord: CoordinatorDep,
             _: AgentDep) -> dict[str, Any]:
    """A node joins with its GPUs, or rejoins (with the same number of GPUs, else 409)."""
    now = time.time()
    with request.app.state.register_lock, store.session() as s:
        n = s.get(Node, req.name)
        if n is None:
            _add_node(s, store, req, now)
        else:
            if n.num_gpus != req.num_gpus:
                raise HTTPException(409, f"node {req.name} registered before with {n.num_gpus} GPUs")
            n.state, n.last_heartbeat, n.address, n.labels = "up", now, req.address, dict(req.labels)
            n.memory = req.memory
            store.log(s, "node.rejoin", node=req.name)
    coord.wake()
    # the node's own credential: its heartbeats, nothing else
    return {"ok": True, "name": req.name, "token": request.app.state.credentials.node_token(req.name)}


def _add_node(s: Session, store: Store, req: RegisterRequest, now: float) -> None:
    ordinal = (s.scalar(select(func.max(Node.ordinal))) or 0) + 1
    s.add(Node(name=req.name, ordinal=ordinal, address=req.address, num_gpus=req.num_gpus,
               virtual=req.virtual, state="up", last_heartbeat=now, labels=dict(req.labels), memory=req.memory))
    base = (s.scalar(select(func.max(GPU.gid))) or -1) + 1
    for i in range(req.num_gpus):
        s.add(GPU(gid=base + i, node=req.name, index=i))
    store.log(s, "node.join", node=req.name, gpus=req.num_gpus, virtual=req.virtual)


@router.post("/agents/{name}/heartbeat")
def heartbeat(name: NodeName, req: HeartbeatRequest, request: Request, store: StoreDep, coord: CoordinatorDep,
              logs_dir: LogsDirDep, _: NodeDep) -> dict[str, Any]:
    """The agent's processes' states, output and GPU utilisation in; the
    processes this node should run (or stop) out. Also judges which other
    nodes went silent."""
    now = time.time()
    with store.session() as s:
        n = s.get(Node, name)
        if n is None:
            raise HTTPException(404, f"node {name} is not registered")
        if n.state != "up":
            store.log(s, "node.up", node=name)
        n.state, n.last_heartbeat = "up", now
        finished = _apply_reports(s, store, name, req.procs, logs_dir)
        _apply_utils(s, name, req.utils)
        finished |= _judge_silent_nodes(s, store, request.app.state.heartbeat_clock, now)
        wanted = _wanted_processes(s, name, request.app.state.credentials)
        masters = _master_urls(s, {w["job"] for w in wanted})
    if finished:
        coord.wake()
    return {"workers": wanted, "masters": masters}


def _apply_reports(s: Session, store: Store, node: str, reports: list[ProcReport], logs_dir: Path) -> bool:
    """Record the agent's reports; True when a process finished."""
    finished = False
    for rep in reports:
        w = s.get(Process, rep.id)
        if w is None or w.node != node:
            continue
        if rep.log:
            _append_log(logs_dir / w.job_id, w.name, rep.log[-MAX_LOG_CHUNK:])
        if w.state == "lost" and rep.state == "running":
            continue  # its node was down and it was given up: it is being stopped, not resumed
        state, code = rep.state, rep.exit_code
        if state == "failed" and code is None and not rep.error:
            if w.state in ("exited", "failed"):
                continue  # a restarted agent's repeat of an exit already recorded
            state, code = _unknown_exit(s, w)
        if rep.error:  # e.g. its launch failed: the coordinator fails the job with it
            w.error = rep.error
        if w.state != state:
            store.log(s, f"proc.{state}", w.job_id, node=node, gpu=w.gpu, proc=w.name, pid=rep.pid, exit_code=code,
                      **({"error": rep.error} if rep.error else {}))
            if state == "failed" and rep.oom is not None and w.kind == "worker":
                _record_oom(s, store, w, rep.oom)
            finished |= state in ("exited", "failed", "lost")
        w.state, w.pid, w.exit_code = state, rep.pid, code
    return finished


def _record_oom(s: Session, store: Store, w: Process, oom: OomReport) -> None:
    """The worker ran out of memory: a ``worker.oom`` event, and the report
    on its row, where the coordinator finds it (its limit is then raised,
    docs/resources.md)."""
    w.resources = {**(w.resources or {}), "oom": oom.model_dump()}
    store.log(s, "worker.oom", w.job_id, node=w.node, gpu=w.gpu, worker=w.name, limit=oom.limit, peak=oom.peak,
              backend=oom.backend, limit_mib=oom.limit >> 20, peak_mib=oom.peak >> 20)


def _unknown_exit(s: Session, w: Process) -> tuple[str, int | None]:
    """The state of a process that ended while its agent was down (the
    restarted agent adopted it, or found it gone, and cannot know its exit
    code). A worker failed (like a killed one: the survivors re-form, its GPU
    is freed). The job's current master, still wanted, is lost: the
    coordinator restarts it like a master lost with its host; unless its job
    reported it finished: then the master exited as it does then (0)."""
    if w.kind != "master":
        return "failed", None
    if w.state == "lost":
        return "lost", None  # given up with its node already
    j = s.get(Job, w.job_id)
    if j is not None and (j.progress or {}).get("state") == "finished":
        return "exited", 0
    latest = s.scalar(select(func.max(Process.id)).where(Process.job_id == w.job_id, Process.kind == "master"))
    if w.desired == "run" and latest == w.id:
        w.desired = "stop"  # never launched again: another master row replaces it
        return "lost", None
    return "failed", None


def _append_log(d: Path, name: str, text: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    with (d / f"{name}.log").open("a") as fh:
        fh.write(text)


def _apply_utils(s: Session, node: str, utils: dict[int, float]) -> None:
    for index, util in utils.items():
        g = s.scalar(select(GPU).where(GPU.node == node, GPU.index == int(index)))
        if g is not None:
            g.util = float(util)


def _judge_silent_nodes(s: Session, store: Store, clock: HeartbeatClock, now: float) -> bool:
    """Nodes that stopped heart-beating: after :data:`NODE_TIMEOUT_S` a node
    is ``unreachable`` (out of the topology: it takes no new work, its
    processes keep running); after the grace period (``TIDAL_NODE_GRACE_S``)
    it is down and its processes lost (the jobs' survivors re-form without
    them, a lost master moves). An agent back within the grace keeps its
    jobs. True when a node changed. After a stall of the server's own, every
    node's clock restarts instead. Heartbeats and the coordinator's watch
    (:class:`SilentNodeWatch`) both judge; each change is a conditional UPDATE."""
    if clock.stalled(now):
        s.execute(update(Node).where(Node.state.in_(WATCHED)).values(last_heartbeat=now))
        return False
    changed = False
    cutoff = now - NODE_TIMEOUT_S
    for name in s.scalars(select(Node.name).where(Node.state == "up", Node.last_heartbeat < cutoff)).all():
        res = s.execute(update(Node).where(Node.name == name, Node.state == "up", Node.last_heartbeat < cutoff)
                        .values(state="unreachable").execution_options(synchronize_session=False))
        if res.rowcount == 1:
            store.log(s, "node.unreachable", node=name)
            changed = True
    changed |= _lose_silent_masters(s, store, now)
    cutoff = now - max(NODE_TIMEOUT_S, settings.NODE_GRACE_S.get())
    for name in s.scalars(select(Node.name).where(Node.state.in_(WATCHED), Node.last_heartbeat < cutoff)).all():
        res = s.execute(update(Node).where(Node.name == name, Node.state.in_(WATCHED), Node.last_heartbeat < cutoff)
                        .values(state="down").execution_options(synchronize_session=False))
        if res.rowcount != 1:
            continue  # it beat meanwhile, or another judge took it down
        store.log(s, "node.down", node=name)
        _lose_node_procs(s, store, name)
        changed = True
    return changed


class SilentNodeWatch:
    """The coordinator's judge of silent nodes (run every
    :data:`~tidal.control.coordinator.WATCH_S`): heartbeats judge only the
    other nodes, so without it a cluster whose every agent died (one node,
    say) would never see it. Its clock is its own and ticks with the watch:
    a gap in it is a stall of the server itself."""

    def __init__(self) -> None:
        self.clock = HeartbeatClock(time.time())

    def __call__(self, store: Store, now: float) -> bool:
        with store.session() as s:
            return _judge_silent_nodes(s, store, self.clock, now)


register_watch(SilentNodeWatch)


def _lose_silent_masters(s: Session, store: Store, now: float) -> bool:
    """A job master on an unreachable node that has not reported for
    :data:`NODE_TIMEOUT_S` either is taken for lost with its host, before the
    node's grace period ends: the coordinator moves it to another host of the
    job (its workers there re-form without the silent ones), and the old one,
    should it come back, is fenced (409) and exits. A master whose agent only
    is away keeps reporting and keeps its job."""
    cutoff = now - NODE_TIMEOUT_S
    lost = False
    rows = s.execute(select(Process, Job.progress).join(Job, Job.id == Process.job_id)
                     .join(Node, Node.name == Process.node)
                     .where(Node.state == "unreachable", Process.kind == "master", Process.state == "running")).all()
    for m, progress in rows:
        if float((progress or {}).get("reported_at") or now) < cutoff:
            m.state, m.desired = "lost", "stop"
            store.log(s, "proc.lost", m.job_id, node=m.node, proc=m.name, reason="the master and its node are silent")
            lost = True
    return lost


def _lose_node_procs(s: Session, store: Store, node: str) -> None:
    """A node went down: its live processes are marked lost and to be stopped
    should it come back. Their GPUs stay with their jobs (they are out of the
    topology anyway) until the node reports the processes gone, so a GPU is
    never handed out while an old process may still run on it."""
    for w in s.scalars(select(Process).where(Process.node == node, Process.state.in_(("pending", "running")))):
        w.state, w.desired = "lost", "stop"
        store.log(s, "proc.lost", w.job_id, node=node, gpu=w.gpu, proc=w.name)


def _wanted_processes(s: Session, node: str, creds: Credentials) -> list[dict[str, Any]]:
    """What the node should run or stop, each process on its GPU
    (``CUDA_VISIBLE_DEVICES``) with its job's credential (``$TIDAL_JOB_TOKEN``,
    derived here, never stored)."""
    procs = s.scalars(select(Process).where(Process.node == node,
                                            Process.state.in_(("pending", "running", "lost")))).all()
    gpu_index = {g.gid: g.index for g in s.scalars(select(GPU).where(GPU.node == node))}
    slots = dict(s.execute(select(Job.id, Job.slot).where(Job.id.in_({w.job_id for w in procs}))).all())
    return [{"id": w.id, "job": w.job_id, "slot": slots.get(w.job_id), "name": w.name, "kind": w.kind,
             "argv": w.argv, "cwd": w.cwd,
             "env": {**(w.env or {}), settings.JOB_TOKEN.name: creds.job_token(w.job_id),
                     **({"CUDA_VISIBLE_DEVICES": str(gpu_index[w.gpu])} if w.gpu is not None else {})},
             "desired": w.desired, "gated": w.gated, "resources": dict(w.resources or {}), "state": w.state}
            for w in procs]


def _master_urls(s: Session, jobs: set[str]) -> dict[str, str]:
    """Where each of these jobs' master is now (the agent tells its workers:
    a master restarted on another host is found there)."""
    if not jobs:
        return {}
    return {j.id: j.master_url for j in s.scalars(select(Job).where(Job.id.in_(sorted(jobs)))) if j.master_url}


# -- job masters ---------------------------------------------------------------------------
def _any_job(s: Session, job_id: str) -> Job:
    j = s.get(Job, job_id)
    if j is None:
        raise HTTPException(404, f"no job {job_id}")
    return j


@router.post("/jobs/{job_id}/kill")
def kill_worker(job_id: JobId, body: dict[str, Any], store: StoreDep, _: JobCredDep) -> dict[str, Any]:
    """The job master found a worker hung: its agent stops it (SIGTERM,
    then SIGKILL after 10 s)."""
    with store.session() as s:
        ws = s.scalars(select(Process).where(Process.job_id == job_id, Process.name == str(body.get("name", "")),
                                             Process.state.in_(("pending", "running")))).all()
        for w in ws:
            w.desired = "stop"
            store.log(s, "worker.kill", job_id, node=w.node, gpu=w.gpu, worker=w.name, reason="hung")
    return {"ok": bool(ws)}


def _plain_json(body: Any, where: str) -> None:
    """A body the store can keep as JSON (PostgreSQL refuses NaN and infinities): else 422."""
    try:
        json.dumps(body, allow_nan=False)
    except ValueError as e:
        raise HTTPException(422, detail=[{"loc": ["body", where], "msg": f"not plain JSON: {e}",
                                          "type": "value_error"}]) from None


def _fence(s: Session, job_id: str, body: dict[str, Any]) -> None:
    """A report from a master on another node than the job's current master
    (a master whose host was cut off and that was restarted elsewhere) is
    refused with 409: that master stops."""
    node = str(body.get("node") or "")
    current = s.scalar(select(Process.node).where(Process.job_id == job_id, Process.kind == "master")
                       .order_by(Process.id.desc()).limit(1))
    if node and current is not None and node != current:
        raise HTTPException(409, f"job {job_id}'s master runs on {current} now, not on {node}")


@router.post("/jobs/{job_id}/master")
def master_up(job_id: JobId, body: dict[str, Any], store: StoreDep, coord: CoordinatorDep,
              _: JobCredDep) -> dict[str, Any]:
    """The job's master is up at ``url`` (the coordinator writes its workers' rows now)."""
    with store.session() as s:
        j = _any_job(s, job_id)
        _fence(s, job_id, body)
        j.master_url = str(body.get("url", ""))
        store.log(s, "job.master", job_id, url=j.master_url)
    coord.wake()
    return {"ok": True}


#: a master's states in which its job trains (the step clock runs)
FORMED = ("running", "changing")


def _is_step(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v < 2**63


@router.post("/jobs/{job_id}/status")
def job_status(job_id: JobId, body: dict[str, Any], store: StoreDep, _: JobCredDep) -> dict[str, Any]:
    """The job master's latest status (progress, step), stored as reported,
    except that the step never goes back: a report below the stored step
    (a master that moved to another host and has not caught up) keeps it."""
    _plain_json(body, "status")
    if not _is_step(body.get("step", 0)):
        raise HTTPException(422, detail=[{"loc": ["body", "step"], "msg": "a step count (0 or more)",
                                          "type": "value_error"}])
    with store.session() as s:
        j = _any_job(s, job_id)
        _fence(s, job_id, body)
        progress = {k: v for k, v in body.items() if k not in ("node", "step_at", "reported_at")}
        prev = j.progress or {}
        stored = prev.get("step")
        if _is_step(stored) and ("step" not in progress or progress["step"] < stored):
            progress["step"] = stored
        # when the step last advanced (server time; the stall judge reads it): a job that just
        # formed, or resumed, starts its clock now
        moved = not _is_step(stored) or progress.get("step", 0) > stored or prev.get("state") not in FORMED
        progress["step_at"] = time.time() if moved or not prev.get("step_at") else prev["step_at"]
        progress["reported_at"] = time.time()  # a master silent with its node is taken for lost
        j.progress = progress
        j.done = float(progress.get("step", j.done))  # checked above
        ended = _ended_workers(s, j)
    return {"ok": True, "ended": ended}


def _ended_workers(s: Session, j: Job) -> dict[str, int]:
    """The job's current workers that ended with an error or a signal, or
    were lost with their node (-9), as its master learns them: it drops one
    that died before registering at once instead of waiting for it."""
    _, _, current = incarnation(job_procs(s, j.id))
    return {p.name: (p.exit_code if p.exit_code not in (None, 0) else -9) for p in current
            if p.kind == "worker" and (p.state == "lost" or p.state == "failed" and p.exit_code != 0)}


class MasterStateBody(BaseModel):
    seq: int = Field(..., ge=0)
    doc: dict[str, Any]
    node: str = ""


@router.post("/jobs/{job_id}/master-state")
def save_master_state(job_id: JobId, body: MasterStateBody, store: StoreDep, _: JobCredDep) -> dict[str, Any]:
    """The job master's latest snapshot; an older one (lower ``seq``) than
    the stored one is ignored."""
    _plain_json(body.doc, "doc")
    with store.session() as s:
        _any_job(s, job_id)
        _fence(s, job_id, {"node": body.node})
        row = s.get(MasterState, job_id)
        doc = json.dumps(body.doc)
        if row is None:
            s.add(MasterState(job_id=job_id, seq=body.seq, doc=doc, updated=time.time()))
        elif body.seq > row.seq:
            row.seq, row.doc, row.updated = body.seq, doc, time.time()
    return {"ok": True}


@router.get("/jobs/{job_id}/master-state")
def load_master_state(job_id: JobId, store: StoreDep, _: JobCredDep) -> dict[str, Any]:
    """The newest snapshot a master of this job saved (404: none)."""
    with store.session() as s:
        row = s.get(MasterState, job_id)
        if row is None:
            raise HTTPException(404, f"no master state for job {job_id}")
        return {"seq": row.seq, "doc": json.loads(row.doc), "updated": row.updated}
