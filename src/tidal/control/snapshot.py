"""Build the policy's Snapshot from the store, and map plans back to GPU ids.

The live cluster calls exactly the policies the simulator runs. Up nodes form
the topology tree (ElasticFlow §4.3): grouped by their ``switch`` label
(``tidal agent --label switch=NAME``) when every switch has as many up nodes,
else under one switch; in registration order within a switch. Policy GPU
index ``i`` maps to the store's cluster-wide GPU id through :class:`GpuMap`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from tidal.core.job import JobSpec, JobState
from tidal.core.overhead import OverheadModel
from tidal.core.profile import ModelCurve, ThroughputProfile, load_profiles
from tidal.core.topology import Cluster, describe
from tidal.core.topology import Node as TreeNode
from tidal.control.db import GPU, Job, Node, ThroughputRow
from tidal.scheduler.api import JobView, Snapshot
from tidal.scheduler.goodput import REPORT_TAG


ACTIVE = ("submitted", "pending", "running", "resizing")

#: Used for jobs whose model has no measured profile: near-linear to 8 GPUs.
GENERIC = ModelCurve(counts=(1, 2, 4, 8, 16), values=(1.0, 1.95, 3.8, 7.2, 12.0))


@dataclass(frozen=True)
class GpuMap:
    to_gid: tuple[int, ...]  # policy index -> store gid

    def gid(self, i: int) -> int:
        return self.to_gid[i]

    def index(self) -> dict[int, int]:
        return {g: i for i, g in enumerate(self.to_gid)}


def profiles_from_store(s: Session) -> ThroughputProfile:
    """The shipped profiles with the store's measured rows over them: untyped
    rows replace a model's curve; rows measured on one GPU type make that
    type's profile (``ThroughputProfile.by_type``): the measured counts as
    measured, the others from the default curve scaled by the measured ratio
    (:func:`_typed_curve`). A model measured on some types only is scheduled
    elsewhere with the slowest measured type's curve."""
    base = load_profiles()
    curves = {m: dict(c) for m, c in base.curves.items()}
    by: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
    for r in s.scalars(select(ThroughputRow)).all():
        by.setdefault((r.gpu_type or "", r.model, r.batch), []).append((r.gpus, r.value))
    typed_pts: dict[str, dict[str, dict[int, list[tuple[int, float]]]]] = {}
    for (gtype, model, batch), pts in sorted(by.items()):
        pts.sort()
        if gtype:
            typed_pts.setdefault(gtype, {}).setdefault(model, {})[batch] = pts
        else:
            curves.setdefault(model, {})[batch] = ModelCurve(tuple(p[0] for p in pts), tuple(p[1] for p in pts))
    typed = {t: {m: {b: _typed_curve(pts, curves.get(m, {}).get(b)) for b, pts in per.items()}
                 for m, per in models.items()} for t, models in typed_pts.items()}
    for model in {m for c in typed.values() for m in c} - set(curves):
        curves[model] = dict(min((c[model] for c in typed.values() if model in c),
                                 key=lambda per_batch: max(max(cv.values) for cv in per_batch.values())))
    by_type = {t: ThroughputProfile(c, base.cross_node_penalty, source=f"store:{t}") for t, c in typed.items()}
    return ThroughputProfile(curves, base.cross_node_penalty, source="store", by_type=by_type)


def _typed_curve(pts: list[tuple[int, float]], default: ModelCurve | None) -> ModelCurve:
    """One type's curve from its measured ``(count, iterations/s)`` points: at
    the measured counts as measured; at the default curve's other counts, the
    default scaled by the median measured/default ratio (a T4 measured at 1
    and 2 GPUs is assumed to scale like the model's default curve)."""
    measured = dict(pts)
    if default is None:
        return ModelCurve(tuple(measured), tuple(measured.values()))
    ratios = sorted(v / default.at(n) for n, v in measured.items() if default.at(n) > 0)
    r = ratios[len(ratios) // 2] if ratios else 1.0
    counts = sorted(set(default.counts) | set(measured))
    vals = [measured.get(n, default.at(n) * r) for n in counts]
    keep = [(n, v) for n, v in zip(counts, vals) if v > 0]
    return ModelCurve(tuple(n for n, _ in keep), tuple(v for _, v in keep))


def job_spec(j: Job) -> JobSpec:
    d = dict(j.spec["jobspec"])
    for key in ("allowed_gpus", "gpu_types", "exclude_gpu_types"):
        if d.get(key) is not None:
            d[key] = tuple(d[key])
    return JobSpec(**d)


def profile_model(spec: JobSpec, profiles: ThroughputProfile) -> JobSpec:
    """Schedule a job whose model has no profile with the generic curve."""
    if spec.model in profiles.curves:
        return spec
    from dataclasses import replace

    return replace(spec, model="generic")


def topology(nodes: Sequence[Node]) -> tuple[list[Node], list[int]]:
    """The up nodes in tree order, grouped by their ``switch`` label (switches
    in label order, nodes in their order within one), and each one's switch
    index. Nodes of any size and switches of any width keep every GPU."""
    groups: dict[str, list[Node]] = {}
    for n in nodes:
        groups.setdefault(str((n.labels or {}).get("switch", "")), []).append(n)
    ordered = [(i, n) for i, k in enumerate(sorted(groups)) for n in groups[k]]
    return [n for _, n in ordered], [i for i, _ in ordered]


def build_snapshot(s: Session, now: float, overheads: OverheadModel) -> tuple[Snapshot, GpuMap, dict[str, Job]]:
    """The policy's view of the store at ``now`` (jobs in a live state, each
    with the GPUs it holds and the global batch a policy chose for it), the
    map from policy GPU indices to store GPU ids, and the job rows by id."""
    nodes, switch_of = topology(s.scalars(select(Node).where(Node.state == "up").order_by(Node.ordinal)).all())
    gids: list[int] = []
    tree: list[TreeNode] = []
    for n, sw in zip(nodes, switch_of):
        node_gpus = s.scalars(select(GPU.gid).where(GPU.node == n.name).order_by(GPU.index)).all()
        if node_gpus:
            gids.extend(node_gpus)
            tree.append(TreeNode(len(node_gpus), str((n.labels or {}).get("gpu-type", "")), sw))
    cluster = Cluster(tuple(tree), name="live-" + describe(tree)) if tree else Cluster.uniform(1, 1, 1, "live-empty")
    away = tuple(TreeNode(n.num_gpus, str((n.labels or {}).get("gpu-type", "")), 0)
                 for n in s.scalars(select(Node).where(Node.state != "up")) if n.num_gpus)
    gmap = GpuMap(tuple(gids))
    index = gmap.index()
    profiles = profiles_from_store(s)
    profiles.curves.setdefault("generic", {})
    jobs = s.scalars(select(Job).where(Job.state.in_(ACTIVE)).order_by(Job.submit_time, Job.id)).all()
    holders: dict[str, list[int]] = {}
    for g in s.scalars(select(GPU).where(GPU.job_id.is_not(None))).all():
        holders.setdefault(g.job_id, []).append(g.gid)
    views = []
    by_id = {}
    for j in jobs:
        spec = profile_model(job_spec(j), profiles)
        if spec.model == "generic":
            for b in {spec.batch_size, int(j.batch or 0)} - {0}:  # the spec's and the policy's global batch
                profiles.curves["generic"].setdefault(b, GENERIC)
        held = tuple(sorted(index[g] for g in holders.get(j.id, []) if g in index))
        state = JobState(j.state)
        tags = dict(j.tags or {})
        reported = (j.progress or {}).get("goodput")
        if isinstance(reported, dict) and reported:  # the job's own numbers (noise scale...): read-only for policies
            tags[REPORT_TAG] = dict(reported)
        views.append(JobView(spec, state, held, j.done, j.attained, j.executed, j.waiting_since, j.admitted,
                             tags, int(j.batch or 0)))
        by_id[j.id] = j
    snap = Snapshot(now=now, cluster=cluster, jobs=tuple(views), profiles=profiles, overheads=overheads, away=away)
    return snap, gmap, by_id
