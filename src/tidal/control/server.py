"""``tidal server``: the control plane's REST API (FastAPI, OpenAPI docs at
``/docs``) over the store, with the scheduler loop running beside it.

Users authenticate with a bearer token and see and change only their own jobs
(another user's job is a 404); the admin token may do everything, including
cluster operations; agents and job masters use the agent token. A bad request
gets a 4xx naming the field; the service never crashes on one.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, Field
from sqlalchemy import func, select, update

from tidal.control.coordinator import Coordinator
from tidal.control.db import GPU, Event, Job, Node, Store, Process
from tidal.control.spec import JobSubmission

log = logging.getLogger(__name__)

NODE_TIMEOUT_S = 10.0
MAX_LOG_CHUNK = 256 * 1024


class Principal(BaseModel):
    name: str
    admin: bool
    agent: bool = False


class ScaleRequest(BaseModel):
    gpus: int = Field(..., ge=1)


class RegisterRequest(BaseModel):
    name: str = Field(..., min_length=1, max_length=128)
    num_gpus: int = Field(..., ge=1, le=1024)
    virtual: bool = False
    address: str = "127.0.0.1"


class ProcReport(BaseModel):
    id: int
    state: str
    pid: int = 0
    exit_code: int | None = None
    log: str = ""


class HeartbeatRequest(BaseModel):
    procs: list[ProcReport] = Field(default_factory=list)
    utils: dict[int, float] = Field(default_factory=dict)


class SpawnRequest(BaseModel):
    ids: list[str]
    gpus: list[int]


def create_app(
    store: Store,
    *,
    policy: str = "edf",
    admin_token: str | None = None,
    agent_token: str | None = None,
    tick_s: float = 2.0,
    home: Path | None = None,
    server_url: str = "",
    start_loop: bool = True,
) -> FastAPI:
    home = Path(home or os.environ.get("TIDAL_HOME", Path.home() / ".tidal"))
    logs_dir = home / "logs"
    admin_token = admin_token or secrets.token_urlsafe(24)
    agent_token = agent_token or admin_token
    store.add_user("admin", admin=True, token=admin_token)
    if agent_token != admin_token:
        store.add_user("agent", admin=True, token=agent_token)
    coord = Coordinator(store, policy, server_url=server_url, agent_token=agent_token, tick_s=tick_s)
    hb_clock = {"t": time.time()}  # when this server last took a heartbeat (node-down judgement)
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        if start_loop:
            coord.start()
        try:
            yield
        finally:
            coord.stop()

    app = FastAPI(title="Tidal control plane", version="0.1.0", lifespan=lifespan,
                  description="Submit elastic training jobs; the scheduler reshapes them.")
    app.state.store, app.state.coordinator = store, coord
    lock = threading.Lock()
    _reset_after_restart(store)

    @app.exception_handler(Exception)
    async def _any_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(status_code=500, content={"detail": f"internal error: {type(exc).__name__}"})

    def principal(request: Request) -> Principal:
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("bearer "):
            raise HTTPException(401, "missing bearer token")
        user = store.user_for_token(auth.split(" ", 1)[1].strip())
        if user is None:
            raise HTTPException(401, "unknown token")
        return Principal(name=user.name, admin=user.is_admin, agent=user.is_admin)

    def admin(p: Principal = Depends(principal)) -> Principal:
        if not p.admin:
            raise HTTPException(403, "admin token required")
        return p

    def own_job(s, job_id: str, p: Principal) -> Job:
        j = s.get(Job, job_id)
        if j is None or (not p.admin and j.user != p.name):
            raise HTTPException(404, f"no job {job_id}")
        return j

    # -- users ------------------------------------------------------------------
    @app.post("/v1/users/{name}", tags=["admin"])
    def add_user(name: str, admin_flag: bool = False, p: Principal = Depends(admin)) -> dict[str, str]:
        return {"name": name, "token": store.add_user(name, admin=admin_flag)}

    # -- jobs ---------------------------------------------------------------------
    @app.post("/v1/jobs", status_code=201, tags=["jobs"])
    def submit(sub: JobSubmission, p: Principal = Depends(principal)) -> dict[str, Any]:
        now = time.time()
        job_id = f"{sub.name}-{uuid.uuid4().hex[:6]}"
        spec = sub.to_jobspec(job_id, now, p.name)
        total = _total_gpus(store)
        if total and spec.lo > total:
            raise HTTPException(422, detail=[{"loc": ["body", "gpus"], "msg": f"needs {spec.lo} GPUs, cluster has {total}",
                                              "type": "value_error"}])
        from dataclasses import asdict

        with store.session() as s:
            s.add(Job(id=job_id, user=p.name, name=sub.name, state="submitted", submit_time=now,
                      spec={"submission": sub.model_dump(), "jobspec": asdict(spec)}, waiting_since=now))
            store.log(s, "job.submitted", job_id, user=p.name)
        coord.wake()
        return {"id": job_id, "state": "submitted"}

    @app.get("/v1/jobs", tags=["jobs"])
    def list_jobs(p: Principal = Depends(principal)) -> list[dict[str, Any]]:
        with store.session() as s:
            q = select(Job).order_by(Job.submit_time)
            if not p.admin:
                q = q.where(Job.user == p.name)
            return [_job_json(s, store, j) for j in s.scalars(q)]

    @app.get("/v1/jobs/{job_id}", tags=["jobs"])
    def get_job(job_id: str, p: Principal = Depends(principal)) -> dict[str, Any]:
        with store.session() as s:
            j = own_job(s, job_id, p)
            out = _job_json(s, store, j, detail=True)
            out["events"] = [
                {"time": e.time, "kind": e.kind, "gpu": e.gpu, **(e.detail or {})}
                for e in s.scalars(select(Event).where(Event.job_id == job_id).order_by(Event.id))
            ]
            return out

    @app.post("/v1/jobs/{job_id}/scale", tags=["jobs"])
    def scale(job_id: str, req: ScaleRequest, p: Principal = Depends(principal)) -> dict[str, Any]:
        with store.session() as s:
            j = own_job(s, job_id, p)
            if j.state not in ("submitted", "pending", "running", "resizing"):
                raise HTTPException(409, f"job {job_id} is {j.state}")
            j.spec = {**j.spec, "pinned": req.gpus}
            store.log(s, "job.pinned", job_id, gpus=req.gpus, by=p.name)
        coord.wake()
        return {"id": job_id, "pinned": req.gpus}

    @app.post("/v1/jobs/{job_id}/cancel", tags=["jobs"])
    def cancel(job_id: str, p: Principal = Depends(principal)) -> dict[str, Any]:
        with store.session() as s:
            j = own_job(s, job_id, p)
            if j.state in ("completed", "failed", "cancelled", "dropped"):
                return {"id": job_id, "state": j.state}
            j.state = "cancelling" if store.job_gpus(s, job_id) or j.master_url else "cancelled"
            if j.state == "cancelled":
                j.end_time = time.time()
            store.log(s, "job.cancel", job_id, by=p.name)
            state = j.state
        coord.wake()
        return {"id": job_id, "state": state}

    @app.get("/v1/jobs/{job_id}/logs", response_class=PlainTextResponse, tags=["jobs"])
    def logs(job_id: str, worker: str | None = None, offset: int = 0, p: Principal = Depends(principal)) -> str:
        with store.session() as s:
            own_job(s, job_id, p)
        d = logs_dir / job_id
        if not d.exists():
            return ""
        files = sorted(d.glob("*.log")) if worker is None else [d / f"{worker}.log"]
        parts = []
        for f in files:
            if f.exists():
                text = f.read_text(errors="replace")
                parts.append(text if worker else "".join(f"[{f.stem}] {line}\n" for line in text.splitlines()))
        out = "".join(parts)
        return out[offset:]

    # -- cluster --------------------------------------------------------------------
    @app.get("/v1/cluster", tags=["cluster"])
    def cluster(p: Principal = Depends(principal)) -> dict[str, Any]:
        with store.session() as s:
            nodes = []
            for n in s.scalars(select(Node).order_by(Node.ordinal)):
                gpus = s.scalars(select(GPU).where(GPU.node == n.name).order_by(GPU.index)).all()
                nodes.append({"name": n.name, "state": n.state, "virtual": n.virtual, "num_gpus": n.num_gpus,
                              "last_heartbeat": n.last_heartbeat,
                              "gpus": [{"gid": g.gid, "index": g.index, "state": g.state,
                                        "job": g.job_id if (p.admin or _owner(s, g.job_id) == p.name) else ("busy" if g.job_id else None),
                                        "util": g.util} for g in gpus]})
            counts = dict(s.execute(select(Job.state, func.count()).group_by(Job.state)).all())
            return {"nodes": nodes, "jobs": counts, "policy": coord.policy.name, "rounds": coord.rounds}

    @app.get("/v1/events", tags=["cluster"])
    def events(since: int = 0, p: Principal = Depends(admin)) -> list[dict[str, Any]]:
        with store.session() as s:
            return [{"id": e.id, "time": e.time, "kind": e.kind, "job": e.job_id, "node": e.node, "gpu": e.gpu,
                     **(e.detail or {})} for e in s.scalars(select(Event).where(Event.id > since).order_by(Event.id))]

    @app.get("/healthz", tags=["cluster"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, tags=["cluster"])
    def metrics() -> str:
        from prometheus_client import CollectorRegistry, Gauge, generate_latest

        reg = CollectorRegistry()
        g_jobs = Gauge("tidal_jobs", "jobs by state", ["state"], registry=reg)
        g_gpus = Gauge("tidal_gpus", "GPUs by state", ["state"], registry=reg)
        with store.session() as s:
            for state, n in s.execute(select(Job.state, func.count()).group_by(Job.state)).all():
                g_jobs.labels(state).set(n)
            for state, n in s.execute(select(GPU.state, func.count()).group_by(GPU.state)).all():
                g_gpus.labels(state).set(n)
        Gauge("tidal_scheduler_rounds", "scheduling rounds", registry=reg).set(coord.rounds)
        return generate_latest(reg).decode()

    # -- agents and job masters (agent token) ------------------------------------
    @app.post("/internal/agents/register", tags=["internal"])
    def register(req: RegisterRequest, p: Principal = Depends(admin)) -> dict[str, Any]:
        with lock, store.session() as s:
            n = s.get(Node, req.name)
            if n is None:
                ordinal = (s.scalar(select(func.max(Node.ordinal))) or 0) + 1
                n = Node(name=req.name, ordinal=ordinal, address=req.address, num_gpus=req.num_gpus,
                         virtual=req.virtual, state="up", last_heartbeat=time.time())
                s.add(n)
                base = (s.scalar(select(func.max(GPU.gid))) or -1) + 1
                for i in range(req.num_gpus):
                    s.add(GPU(gid=base + i, node=req.name, index=i))
                store.log(s, "node.join", node=req.name, gpus=req.num_gpus, virtual=req.virtual)
            else:
                if n.num_gpus != req.num_gpus:
                    raise HTTPException(409, f"node {req.name} registered before with {n.num_gpus} GPUs")
                n.state, n.last_heartbeat, n.address = "up", time.time(), req.address
                store.log(s, "node.rejoin", node=req.name)
        coord.wake()
        return {"ok": True, "name": req.name}

    @app.post("/internal/agents/{name}/heartbeat", tags=["internal"])
    def heartbeat(name: str, req: HeartbeatRequest, p: Principal = Depends(admin)) -> dict[str, Any]:
        finished = False
        with store.session() as s:
            n = s.get(Node, name)
            if n is None:
                raise HTTPException(404, f"node {name} is not registered")
            if n.state != "up":
                store.log(s, "node.up", node=name)
            n.state, n.last_heartbeat = "up", time.time()
            for rep in req.procs:
                w = s.get(Process, rep.id)
                if w is None or w.node != name:
                    continue
                if rep.log:
                    _append_log(logs_dir, w.job_id, w.name, rep.log[-MAX_LOG_CHUNK:])
                if w.state == "lost" and rep.state == "running":
                    continue  # its node was down and it was given up: it is being stopped, not resumed
                if w.state != rep.state:
                    store.log(s, f"proc.{rep.state}", w.job_id, node=name, gpu=w.gpu, proc=w.name,
                              pid=rep.pid, exit_code=rep.exit_code)
                    finished |= rep.state in ("exited", "failed")
                w.state, w.pid, w.exit_code = rep.state, rep.pid, rep.exit_code
            for gi, u in req.utils.items():
                g = s.scalar(select(GPU).where(GPU.node == name, GPU.index == int(gi)))
                if g is not None:
                    g.util = float(u)
            # nodes that stopped heart-beating are down; their processes are lost
            # (the jobs' survivors re-form without them, issue 5). Judged only
            # while this server itself keeps taking heartbeats: after a stall of
            # its own, every node looks late
            now = time.time()
            gap, hb_clock["t"] = now - hb_clock["t"], now
            late = [] if gap > NODE_TIMEOUT_S / 2 else s.scalars(
                select(Node).where(Node.state == "up", Node.last_heartbeat < now - NODE_TIMEOUT_S)).all()
            if gap > NODE_TIMEOUT_S / 2:
                s.execute(update(Node).where(Node.state == "up").values(last_heartbeat=now))
            for other in late:
                other.state = "down"
                store.log(s, "node.down", node=other.name)
                _lose_node_procs(s, store, other.name)
                finished = True
            desired = s.scalars(select(Process).where(Process.node == name,
                                                     Process.state.in_(("pending", "running", "lost")))).all()
            gpu_index = {g.gid: g.index for g in s.scalars(select(GPU).where(GPU.node == name))}
            out = [{"id": w.id, "job": w.job_id, "name": w.name, "kind": w.kind, "argv": w.argv, "cwd": w.cwd,
                    "env": {**(w.env or {}), **({"CUDA_VISIBLE_DEVICES": str(gpu_index[w.gpu])} if w.gpu is not None else {})},
                    "desired": w.desired, "gated": w.gated} for w in desired]
        if finished:
            coord.wake()
        return {"workers": out}

    @app.post("/internal/jobs/{job_id}/kill", tags=["internal"])
    def kill_worker(job_id: str, body: dict[str, Any], p: Principal = Depends(admin)) -> dict[str, Any]:
        """The job master found a worker hung: its agent stops it (SIGTERM,
        then SIGKILL after 10 s)."""
        with store.session() as s:
            ws = s.scalars(select(Process).where(Process.job_id == job_id, Process.name == str(body.get("name", "")),
                                                Process.state.in_(("pending", "running")))).all()
            for w in ws:
                w.desired = "stop"
                store.log(s, "worker.kill", job_id, node=w.node, gpu=w.gpu, worker=w.name, reason="hung")
        return {"ok": bool(ws)}

    def any_job(s, job_id: str) -> Job:
        j = s.get(Job, job_id)
        if j is None:
            raise HTTPException(404, f"no job {job_id}")
        return j

    @app.post("/internal/jobs/{job_id}/master", tags=["internal"])
    def master_up(job_id: str, body: dict[str, Any], p: Principal = Depends(admin)) -> dict[str, Any]:
        with store.session() as s:
            j = any_job(s, job_id)
            j.master_url = str(body.get("url", ""))
            store.log(s, "job.master", job_id, url=j.master_url)
        return {"ok": True}

    @app.post("/internal/jobs/{job_id}/status", tags=["internal"])
    def job_status(job_id: str, body: dict[str, Any], p: Principal = Depends(admin)) -> dict[str, Any]:
        with store.session() as s:
            j = any_job(s, job_id)
            j.progress = body
            j.done = float(body.get("step", j.done))
        return {"ok": True}

    @app.post("/internal/jobs/{job_id}/spawn", tags=["internal"])
    def spawn(job_id: str, req: SpawnRequest, p: Principal = Depends(admin)) -> dict[str, Any]:
        if len(req.ids) != len(req.gpus):
            return {"ok": False, "error": "ids and gpus differ in length"}
        with store.session() as s:
            j = s.get(Job, job_id)
            if j is None:
                return {"ok": False, "error": f"no job {job_id}"}
            sub = j.spec.get("submission", {})
            for wid, gid in zip(req.ids, req.gpus):
                g = s.get(GPU, gid)
                if g is None or (g.job_id != job_id and g.reserved_for != job_id):
                    return {"ok": False, "error": f"GPU {gid} is neither assigned nor reserved to {job_id}"}
            for wid, gid in zip(req.ids, req.gpus):
                g = s.get(GPU, gid)
                gated = g.job_id != job_id  # reserved: warm up now, train once the GPU is ours
                if not gated:
                    g.worker = wid
                # the job's checkpoints (suspend/resume, consistent recovery) live in one directory
                # per job; on several machines it must be shared storage (or set it in the job's env)
                env = {"TIDAL_MASTER_URL": j.master_url, "TIDAL_WORKER_ID": wid, "GLOO_SOCKET_IFNAME": "lo",
                       "OMP_NUM_THREADS": "1", "TIDAL_CHECKPOINT_DIR": str(home / "checkpoints" / job_id),
                       **sub.get("env", {})}
                import sys

                s.add(Process(job_id=job_id, name=wid, kind="worker", node=g.node, gpu=gid, env=env,
                             argv=[sys.executable, "-u", sub["script"], *sub.get("args", [])],
                             cwd=sub.get("workdir", ""), created=time.time(), gated=gated))
                store.log(s, "worker.spawn", job_id, node=g.node, gpu=gid, worker=wid, gated=gated)
        return {"ok": True}

    return app


def _owner(s, job_id: str | None) -> str | None:
    if job_id is None:
        return None
    j = s.get(Job, job_id)
    return j.user if j else None


def _total_gpus(store: Store) -> int:
    with store.session() as s:
        return int(s.scalar(select(func.count()).select_from(GPU)) or 0)


def _append_log(root: Path, job_id: str, name: str, text: str) -> None:
    d = root / job_id
    d.mkdir(parents=True, exist_ok=True)
    with (d / f"{name}.log").open("a") as fh:
        fh.write(text)


def _job_json(s, store: Store, j: Job, detail: bool = False) -> dict[str, Any]:
    sub = j.spec.get("submission", {})
    out = {
        "id": j.id, "user": j.user, "name": j.name, "state": j.state, "submit_time": j.submit_time,
        "start_time": j.start_time, "end_time": j.end_time, "gpus": store.job_gpus(s, j.id),
        "target": j.target, "step": (j.progress or {}).get("step", 0),
        "iterations": j.spec.get("jobspec", {}).get("iterations"), "world_size": (j.progress or {}).get("world_size", 0),
        "rescales": j.rescales, "drop_reason": j.drop_reason, "pinned": j.spec.get("pinned"),
        "deadline": j.spec.get("jobspec", {}).get("deadline"),
    }
    if detail:
        out.update(spec=sub, progress=j.progress, master_url=j.master_url, exit_info=j.exit_info)
        out["processes"] = [
            {"name": w.name, "kind": w.kind, "node": w.node, "gpu": w.gpu, "state": w.state, "pid": w.pid,
             "exit_code": w.exit_code}
            for w in s.scalars(select(Process).where(Process.job_id == j.id).order_by(Process.id))
        ]
    return out


def _lose_node_procs(s, store: Store, node: str) -> None:
    """A node went down: its live processes are marked lost and to be stopped
    should it come back. Their GPUs stay with their jobs (they are out of the
    topology anyway) until the node reports the processes gone, so a GPU is
    never handed out while an old process may still run on it."""
    for w in s.scalars(select(Process).where(Process.node == node, Process.state.in_(("pending", "running")))):
        w.state, w.desired = "lost", "stop"
        store.log(s, "proc.lost", w.job_id, node=node, gpu=w.gpu, proc=w.name)


def _reset_after_restart(store: Store) -> None:
    """A restarted server resumes from the store: jobs mid-change go back to
    running (the job master finishes or rejects the change on its own)."""
    with store.session() as s:
        for j in s.scalars(select(Job).where(Job.state == "resizing")):
            j.state = "running"
        # the server was away, not the nodes: their heartbeat clocks start now
        # (otherwise the first agent back would have all the others declared down)
        for n in s.scalars(select(Node).where(Node.state == "up")):
            n.last_heartbeat = time.time()
        store.log(s, "server.start")


def serve(
    host: str = "127.0.0.1",
    port: int = 8470,
    db_url: str | None = None,
    policy: str = "edf",
    admin_token: str | None = None,
    tick_s: float = 2.0,
    home: Path | None = None,
) -> None:
    import uvicorn

    home = Path(home or os.environ.get("TIDAL_HOME", Path.home() / ".tidal"))
    home.mkdir(parents=True, exist_ok=True)
    store = Store(db_url or f"sqlite:///{home / 'tidal.db'}")
    token_file = home / "admin.token"
    if admin_token is None:
        admin_token = token_file.read_text().strip() if token_file.exists() else secrets.token_urlsafe(24)
    token_file.write_text(admin_token)
    token_file.chmod(0o600)
    url = f"http://{host}:{port}"
    app = create_app(store, policy=policy, admin_token=admin_token, tick_s=tick_s, home=home, server_url=url)
    uvicorn.run(app, host=host, port=port, log_level="warning")
