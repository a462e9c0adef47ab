"""Goodput jobs in the simulator: the Pollux study's model of training progress.

A Pollux/Sia workload's job (:mod:`tidal.sim.sia`, :mod:`tidal.sim.traces`)
becomes a *goodput job* (:func:`goodput_jobs`): its progress counts steps at
its application's initial batch ``M0`` (the unit of the Pollux data's
``progress`` column) and it completes when that reaches the end of training,
the last row of the ``M0`` validation run (:class:`NoiseCurve`). While it
runs at global batch ``M`` on ``n`` GPUs over ``k`` nodes it progresses at

    THROUGHPUT(k, n, M) / M0 * E(M),  E(M) = (phi + M0) / (phi + M)

with the step time of :mod:`tidal.core.steptime` fitted to the data and
``phi`` the noise scale of a run at that batch at the job's progress
(:meth:`NoiseCurve.phi`). ``phi`` changes as the job trains, so the engine
re-rates every running goodput job at each scheduling round
(:func:`refresh_rates`; piecewise constant in between) and keeps a round every
slot while one runs. A fixed-batch policy's job keeps the workload's
``batch_size``; an adaptive policy (``pollux``) sets a batch per allocation
with ``Plan.batch``.

:func:`goodput_inputs` builds the profile and the jobs from a Pollux/Sia
traces folder; reading the validation files is the only I/O here.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from tidal.core.errors import InputError
from tidal.core.job import JobSpec
from tidal.core.overhead import OverheadModel
from tidal.core.profile import ThroughputProfile
from tidal.core.topology import Cluster
from tidal.scheduler.goodput import (
    GOODPUT_META,
    GOODPUT_UNIT,
    AppModel,
    GoodputModel,
    GoodputProfile,
    NoiseCurve,
    with_goodput,
)

if TYPE_CHECKING:
    from tidal.sim.sia import SiaData

log = logging.getLogger(__name__)

#: seconds a re-allocated job makes no progress (Pollux's simulator charges a
#: fixed checkpoint-restart delay per re-allocation; Pollux §4.2 and Fig. 8
#: put a restart at tens of seconds)
POLLUX_RESTART_S = 30.0
#: seconds between re-ratings of goodput jobs when the engine has no slot
GOODPUT_REFRESH_S = 60.0
_VALIDATION = re.compile(r"^validation-(\d+)\.csv$")
_COLUMNS = ("progress", "grad_sqr", "grad_var")


def _column(rows: list[dict[str, str]], col: str, path: Path) -> list[float]:
    out = []
    for line, row in enumerate(rows, 2):
        try:
            x = float(row[col])
        except KeyError:
            raise InputError(f"missing column {col!r}", source=str(path), line=1, field=col) from None
        except (TypeError, ValueError):
            raise InputError(f"not a number: {row[col]!r}", source=str(path), line=line, field=col) from None
        if math.isnan(x) or x < 0:
            raise InputError(f"must be a number >= 0, got {row[col]!r}", source=str(path), line=line, field=col)
        out.append(x)
    return out


@lru_cache(maxsize=64)
def read_noise_curve(app_dir: Path) -> NoiseCurve:
    """The noise curve of the application in ``app_dir`` from its
    ``validation-<B>.csv`` files (columns ``progress,grad_sqr,grad_var`` read
    by name); ``M0`` is the smallest ``B``."""
    runs: dict[int, tuple[list[float], list[float], list[float]]] = {}
    for path in sorted(app_dir.glob("validation-*.csv")):
        m = _VALIDATION.match(path.name)
        if not m:
            continue
        try:
            with path.open(newline="", encoding="utf-8-sig") as fh:
                rows = list(csv.DictReader(fh))
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            raise InputError(f"cannot read: {getattr(exc, 'strerror', None) or exc}", source=str(path)) from None
        if rows:
            cols = [_column(rows, c, path) for c in _COLUMNS]
            runs[int(m.group(1))] = (cols[0], cols[1], cols[2])
    if not runs:
        raise InputError("no validation-<batch>.csv with rows: the goodput model needs the noise scale",
                         source=str(app_dir))
    return NoiseCurve.from_runs(app_dir.name, runs)


def _data_type(data: "SiaData", app: str, cluster: Cluster) -> str:
    """The measurements to read for ``app``: the untyped (Pollux) ones, else
    those of the cluster's most common GPU type that was measured, else the
    app's first measured type."""
    have = data.data_types(app)
    if not have:
        raise InputError(f"no measurements of {app!r}", source=str(data.root / app))
    counts: dict[str, int] = {}
    for node in cluster.nodes:
        counts[node.gpu_type] = counts.get(node.gpu_type, 0) + node.gpus
    for gtype in sorted(counts, key=lambda t: (-counts[t], t)):
        found = data.resolve(app, gtype) if gtype else None
        if found is not None:
            return found
    return have[0]


def build_model(data: "SiaData", cluster: Cluster, apps: Iterable[str]) -> GoodputModel:
    """The goodput model of ``apps`` on ``cluster``: each app's fitted step
    time (one measured GPU type, :func:`_data_type`), its smallest and
    largest measured local batch and its noise curve."""
    from tidal.core.steptime import step_time
    from tidal.sim.sia import read_rows

    models: dict[str, AppModel] = {}
    for app in sorted(set(apps)):
        dtype = _data_type(data, app, cluster)
        params = data.params(app, dtype)
        suffix = f"-{dtype}" if dtype else ""
        paths = [data.root / app / f"{kind}{suffix}.csv" for kind in ("placements", "scalability")]
        rows = [r for p in paths if p.exists() for r in read_rows(p)]
        min_local = min((r.local_bsz for r in rows if r.local_bsz > 0), default=1.0)

        def step(nodes: int, n: int, local: float, _p: Any = params) -> float:
            return step_time(_p, nodes, n, local)

        models[app] = AppModel(read_noise_curve((data.root / app).resolve()), step, params.max_local_bsz, min_local)
    return GoodputModel(models, cluster.max_gpus_per_node)


def goodput_jobs(jobs: Sequence[JobSpec], model: GoodputModel) -> list[JobSpec]:
    """``jobs`` as goodput jobs: ``iterations`` = the progress that ends
    training (steps at M0), marked in ``meta``; batch, GPUs and times kept."""
    out = []
    for j in jobs:
        meta = tuple((k, v) for k, v in j.meta if k != GOODPUT_META) + ((GOODPUT_META, GOODPUT_UNIT),)
        out.append(dataclasses.replace(j, iterations=model.end(j.model), meta=meta))
    return out


def goodput_inputs(jobs: Sequence[JobSpec], profile: ThroughputProfile, data: "SiaData",
                   cluster: Cluster) -> tuple[GoodputProfile, list[JobSpec]]:
    """The profile (``profile`` plus the goodput model) and the goodput jobs
    of a Pollux/Sia workload on ``cluster``."""
    model = build_model(data, cluster, {j.model for j in jobs})
    return with_goodput(profile, model), goodput_jobs(jobs, model)


def load_goodput_workload(path: str | Path, cluster: Cluster, data_dir: str | Path | None = None,
                          limit: int | None = None) -> tuple[GoodputProfile, list[JobSpec]]:
    """A Pollux/Sia workload CSV as goodput jobs with their profile: the
    workload and the step-time profiles read by :mod:`tidal.sim.traces` and
    :mod:`tidal.sim.sia` (``data_dir``: the traces folder, default the one
    above the workload), the goodput model built here."""
    from tidal.sim.sia import data_for, workload_profiles
    from tidal.sim.traces import load_trace

    data = data_for(Path(path), data_dir)
    trace = load_trace(path, "pollux", limit=limit, data_dir=data.root)
    return goodput_inputs(trace.jobs, workload_profiles(trace.jobs, cluster, data), data, cluster)


def pollux_overheads(restart_s: float = POLLUX_RESTART_S) -> OverheadModel:
    """Pollux's simulator's cost of a re-allocation: the job makes no progress
    for ``restart_s`` after every change of its GPUs (checkpoint and restart),
    its first start included."""
    return OverheadModel(mode="stop-resume", stop_resume_s=restart_s, launch_s=restart_s)


# -- the engine's side ----------------------------------------------------------


def init_jobs(sim: Any) -> bool:
    """Set each goodput job's one-GPU rate (cluster efficiency's unit) to its
    goodput on one GPU at M0 when it starts; return whether any job is one."""
    owns = getattr(sim.profiles, "owns", None)
    if owns is None:
        return False
    found = False
    for job in sim.jobs.values():
        if owns(job.spec):
            found = True
            m0 = sim.profiles.goodput.app(job.spec.model).curve.m0
            job.single_rate = sim.profiles.job_rate(job.spec, 1, m0, 0.0) or 1.0
    return found


def refresh_rates(sim: Any, now: float) -> bool:
    """Re-rate every running goodput job of simulator ``sim`` at its progress
    now (its noise scale moved); the rows must be advanced to ``now``.
    Returns whether any goodput job runs."""
    owns = sim.profiles.owns
    rows, tags = sim.cache.rows, sim.cache.tags
    found = False
    for jid in sorted(sim.running):
        job = sim.running[jid]
        if not owns(job.spec):
            continue
        found = True
        rows.flush(job)
        sim.progress.advance(job, now)
        start, old, idle = job.segments[-1]
        new = sim._rate(job, job.gpus)
        if new == old:
            continue
        job.segments[-1] = (max(start, now), new, idle)
        sim._schedule_completion(job)
        rows.load(job, tags[jid])
    return found


def goodput_tick(sim: Any, now: float) -> None:
    """End of a scheduling round of ``sim``: re-rate its running goodput jobs
    (:func:`refresh_rates`) and, while any runs, ask for a round one slot on."""
    if refresh_rates(sim, now):
        sim._request_round(now + (sim.slot or GOODPUT_REFRESH_S))
