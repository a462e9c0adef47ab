"""The control plane's spawner (``agents``): a job's workers are rows of the
process table, which the node agents reconcile against (SideCar §III-B).

The coordinator is the one owner of spawning: it decides each worker's id,
node and GPU when it assigns (or reserves) the GPUs and writes the rows through
:class:`AgentSpawner`, inside its own transaction. A worker on a GPU that is
only reserved for the job (early initialisation, SideCar §III-C) is *gated*:
it warms up and waits until the GPU is the job's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from tidal import settings
from tidal.control.db import GPU, Job, Process, Store
from tidal.control.spec import Resources
from tidal.runtime.spawner import WorkerLaunch, register_spawner

LIVE = ("pending", "running")


def worker_env(job: Job, worker_id: str, home: Path) -> dict[str, str]:
    """A worker's environment: where its master is, its id, the job's
    checkpoint directory (suspend/resume and consistent recovery; on several
    machines it must be shared storage, or set in the job's own env), the
    job's termination condition (the spec's ``iterations``: training ends at
    that step whatever the script's loop says; with ``epochs`` the script's
    ``job.epochs(N)`` ends it), then the job's own variables."""
    sub: dict[str, Any] = job.spec.get("submission", {})
    resume = (job.tags or {}).get("_resume_step")
    iterations = sub.get("iterations")
    return {
        settings.MASTER_URL.name: job.master_url,
        settings.WORKER_ID.name: worker_id,
        "OMP_NUM_THREADS": "1",
        settings.CHECKPOINT_DIR.name: str(home / "checkpoints" / job.id),
        **({settings.RESUME_STEP.name: str(int(resume))} if resume is not None else {}),
        **({settings.MAX_STEPS.name: str(int(iterations))} if iterations else {}),
        **sub.get("env", {}),
    }


def worker_resources(job: Job) -> dict[str, Any]:
    """A new worker's limits (``{"memory": bytes, "cpus": n}``): the spec's
    ``resources``, with the memory limit as raised after out-of-memory kills
    (``tags["_memory"]``, docs/resources.md)."""
    res = (job.spec.get("submission") or {}).get("resources") or {}
    out = Resources(**res).limits() if res else {}
    raised = (job.tags or {}).get("_memory")
    if raised:
        out["memory"] = int(raised)
    return out


@register_spawner("agents")
class AgentSpawner:
    """One job's workers as process rows, written in the session ``s`` (the
    caller's transaction). ``WorkerLaunch.host`` is a node name and
    ``device`` the GPU's index on it; both are required."""

    def __init__(self, s: Session, job: Job, *, home: Path | None = None) -> None:
        self.s, self.job = s, job
        self.home = Path(home) if home is not None else settings.home()

    def _gpu(self, x: WorkerLaunch) -> GPU:
        g = self.s.scalar(select(GPU).where(GPU.node == x.host, GPU.index == x.device))
        if g is None:
            raise ValueError(f"worker {x.worker_id}: no GPU {x.device} on node {x.host!r}")
        if g.job_id != self.job.id and g.reserved_for != self.job.id:
            raise ValueError(f"worker {x.worker_id}: GPU {g.gid} is neither assigned nor reserved to {self.job.id}")
        return g

    def spawn(self, launches: Sequence[WorkerLaunch]) -> None:
        """Write a row per worker (all or none: a GPU that is not the job's raises first)."""
        placed = [(x, self._gpu(x)) for x in launches]
        sub: dict[str, Any] = self.job.spec.get("submission", {})
        argv = [sys.executable, "-u", sub["script"], *sub.get("args", [])]
        resources = worker_resources(self.job)
        for x, g in placed:
            gated = g.job_id != self.job.id  # reserved: warm up now, train once the GPU is the job's
            self.s.add(Process(job_id=self.job.id, name=x.worker_id, kind="worker", node=g.node, gpu=g.gid,
                               env=worker_env(self.job, x.worker_id, self.home), argv=argv,
                               cwd=sub.get("workdir", ""), gated=gated, resources=dict(resources)))
            Store.log(self.s, "worker.spawn", self.job.id, node=g.node, gpu=g.gid, worker=x.worker_id, gated=gated,
                      **({"resources": resources} if resources else {}))

    def kill(self, worker_id: str) -> None:
        """Its agent stops it (SIGTERM, then SIGKILL after 10 s)."""
        for p in self._rows(Process.name == worker_id, Process.state.in_(LIVE)):
            p.desired = "stop"

    def exit_codes(self) -> dict[str, int | None]:
        """Exit code of each worker row (None while it runs, or while its node
        is lost and nobody knows)."""
        return {p.name: p.exit_code if p.state in ("exited", "failed") else None for p in self._rows()}

    def _rows(self, *where: Any) -> list[Process]:
        q = select(Process).where(Process.job_id == self.job.id, Process.kind == "worker", *where)
        return list(self.s.scalars(q.order_by(Process.id)))


def launches_on(s: Session, worker_ids: Sequence[str], gids: Sequence[int]) -> list[WorkerLaunch]:
    """A launch per worker id on the GPU of the same position (cluster-wide ids)."""
    gpus = {g.gid: g for g in s.scalars(select(GPU).where(GPU.gid.in_(list(gids))))}
    return [WorkerLaunch(w, host=gpus[g].node, device=gpus[g].index) for w, g in zip(worker_ids, gids)]
