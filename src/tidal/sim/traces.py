"""Trace loaders for the simulator: real cluster traces and a synthetic workload.

Formats (detected from the header by :func:`detect_format`):

``itp``
    ElasticFlow's Microsoft ITP traces, header
    ``job_id,submission_time,num_iteration,model_name,deadline,batch_size,num_gpu,duration``.
    ``iterations = num_iteration``, ``deadline = deadline`` (absolute seconds).
``philly-ef``
    ElasticFlow's Philly cluster 103959 with deadlines, header
    ``job_id,submit_time,real_iteration,model_name,ddl,batch_size,num_gpu,real_duration,duration,iteration``.
    ``iterations = iteration``, ``deadline = ddl``.
``philly``
    The preprocessed Microsoft Philly trace (Pollux artifact), header
    ``timestamp,duration,num_gpus,gpu_time,cluster``. It has no model, batch size
    or deadline, so they are synthesised with ``numpy.random.default_rng(seed)``:

    * ``submit_time`` = seconds since the earliest timestamp in the file;
      ``job_id`` = ``p<row>`` (0-based index of the data row in the file);
    * the model is drawn uniformly among the profiled models that run at the
      job's GPU count (``throughput > 0`` at ``num_gpus`` for at least one batch
      size), then the global batch size uniformly among that model's profiled
      batch sizes that run at that count;
    * ``iterations = duration * throughput(model, batch, num_gpus)``: the job
      takes exactly its original duration at its original GPU count on a
      consolidated placement. A zero duration is valid data and becomes one
      iteration (counted in ``Trace.summary()["zero_duration"]``);
    * no deadline; jobs are sorted by submit time, ties by row index.

    Two uniform draws per data row are taken in file order (model, then batch),
    so the assignment depends only on the seed, the file and the profiles.
``pollux``
    The Pollux (OSDI'21) and Sia (SOSP'23) workloads, header
    ``name,time,application,num_replicas,batch_size``: ``job_id = name``,
    ``submit_time = time``, ``model = application``, ``batch_size``,
    ``requested_gpus = num_replicas``; ``iterations`` = the steps the
    application needs at that batch in the measured data of the workload's
    ``traces/`` folder (:mod:`tidal.sim.sia`). Jobs are elastic from 1 GPU
    with no upper bound (a policy caps them where more GPUs stop helping);
    with ``elastic=False`` they run at ``num_replicas``.

Every format may add the columns ``gpu_types`` and ``exclude_gpu_types``
(GPU type names separated by ``;``; empty: no constraint), the job's
``JobSpec.gpu_types`` / ``exclude_gpu_types``.

ITP and philly-ef jobs keep the trace's order and absolute times. Every job keeps
its original ``duration`` (and Philly's ``cluster``) in ``JobSpec.meta``.

Bad input raises :class:`~tidal.core.errors.InputError` naming the file, the
1-based line (the header is line 1), the column and the reason; no row is ever
skipped silently (only trailing blank lines are ignored).
"""

from __future__ import annotations

import csv
import logging
import re
import math
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from tidal.core.errors import InputError
from tidal.core.job import JobSpec
from tidal.core.profile import ThroughputProfile, load_profiles

if TYPE_CHECKING:
    from tidal.sim.sia import SiaData

log = logging.getLogger(__name__)

#: Columns each format needs (other columns are allowed and ignored or kept as meta).
REQUIRED: dict[str, tuple[str, ...]] = {
    "itp": ("job_id", "submission_time", "num_iteration", "model_name", "deadline", "batch_size", "num_gpu"),
    "philly-ef": ("job_id", "submit_time", "model_name", "ddl", "batch_size", "num_gpu", "iteration"),
    "philly": ("timestamp", "duration", "num_gpus"),
    "pollux": ("name", "time", "application", "num_replicas", "batch_size"),
}
#: Columns that identify a format even when a required column is missing.
_SIGNATURE: dict[str, tuple[str, ...]] = {
    "itp": ("submission_time", "num_iteration"),
    "philly-ef": ("ddl", "real_iteration"),
    "philly": ("timestamp", "num_gpus"),
    "pollux": ("application", "num_replicas"),
}

#: Synthetic workload: GPU requests and their (unnormalised) probabilities.
POISSON_GPU_CHOICES: tuple[tuple[int, float], ...] = ((1, 0.5), (2, 0.25), (4, 0.15), (8, 0.1))
POISSON_MIN_DURATION_S = 600.0
POISSON_MAX_DURATION_S = 8 * 3600.0


@dataclass(frozen=True)
class Trace:
    """A workload: jobs in submission order plus where they came from."""

    jobs: tuple[JobSpec, ...]
    source: str  # path or "poisson(...)"
    fmt: str  # "itp" | "philly-ef" | "philly" | "pollux" | "poisson"

    def __post_init__(self) -> None:
        if not isinstance(self.jobs, tuple):
            object.__setattr__(self, "jobs", tuple(self.jobs))

    def __len__(self) -> int:
        return len(self.jobs)

    def summary(self) -> dict:
        """Counts and spans: jobs, first_submit, last_submit, span_s, models,
        gpu_request_hist, with_deadline, total_iterations, zero_duration."""
        jobs = self.jobs
        submits = [j.submit_time for j in jobs]
        first = min(submits) if submits else None
        last = max(submits) if submits else None
        models = Counter(j.model for j in jobs)
        gpus = Counter(j.requested_gpus for j in jobs)
        return {
            "jobs": len(jobs),
            "first_submit": first,
            "last_submit": last,
            "span_s": (last - first) if submits else 0.0,
            "models": dict(sorted(models.items())),
            "gpu_request_hist": dict(sorted(gpus.items())),
            "with_deadline": sum(1 for j in jobs if j.deadline is not None),
            "total_iterations": float(sum(j.iterations for j in jobs)),
            "zero_duration": sum(1 for j in jobs if _meta_duration(j) == 0.0),
        }

    def describe(self) -> str:
        """One or two human-readable lines built from :meth:`summary`."""
        s = self.summary()
        name = Path(self.source).name if self.fmt != "poisson" else self.source
        if not s["jobs"]:
            return f"{name} ({self.fmt}): no jobs"
        hist = s["gpu_request_hist"]
        single = hist.get(1, 0) / s["jobs"]
        line1 = (
            f"{name} ({self.fmt}): {s['jobs']} jobs over {_human_span(s['span_s'])}, "
            f"{len(s['models'])} models, {s['with_deadline']} with deadlines"
        )
        line2 = (
            f"GPU requests {min(hist)}-{max(hist)} ({single:.0%} single-GPU), "
            f"{s['total_iterations']:.3g} iterations in total"
        )
        if s["zero_duration"]:
            line2 += f", {s['zero_duration']} zero-duration jobs"
        return f"{line1}\n{line2}"


def _meta_duration(job: JobSpec) -> float | None:
    """The original duration kept in ``job.meta`` (None if the trace had none)."""
    for key, value in job.meta:
        if key == "duration":
            return float(value)
    return None


def _human_span(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min"


# -- reading ----------------------------------------------------------------


def _open(path: Path):
    try:
        return path.open(newline="", encoding="utf-8-sig")
    except FileNotFoundError:
        shipped = ", ".join(shipped_traces())
        raise InputError(f"trace file does not exist (shipped traces, usable by name: {shipped})",
                         source=str(path)) from None
    except IsADirectoryError:
        raise InputError("trace path is a directory, not a file", source=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot read trace file: {exc.strerror or exc}", source=str(path)) from None


def _read_header(path: Path) -> list[str]:
    with _open(path) as fh:
        try:
            header = next(csv.reader(fh))
        except StopIteration:
            raise InputError("empty file (no header)", source=str(path), line=1) from None
        except (csv.Error, UnicodeDecodeError) as exc:
            raise InputError(f"not a readable CSV file: {exc}", source=str(path), line=1) from None
    return [h.strip() for h in header]


def detect_format(path: str | Path) -> str:
    """Return ``"itp"``, ``"philly-ef"``, ``"philly"`` or ``"pollux"`` from the header columns."""
    path = Path(path)
    header = _read_header(path)
    return _format_of(header, path)


def _format_of(header: Sequence[str], path: Path) -> str:
    cols = set(header)
    full = [f for f, req in REQUIRED.items() if cols.issuperset(req)]
    if len(full) == 1:
        return full[0]
    if len(full) > 1:
        raise InputError(f"ambiguous trace header {','.join(header)!r} matches formats {full}", source=str(path), line=1)
    partial = [f for f, sig in _SIGNATURE.items() if cols.intersection(sig)]
    if len(partial) == 1:
        return partial[0]  # the loader reports the missing column
    known = "; ".join(f"{f}: {','.join(req)}" for f, req in REQUIRED.items())
    raise InputError(
        f"unknown trace format, header is {','.join(header)!r}; expected columns for {known}",
        source=str(path),
        line=1,
    )


def _rows(path: Path, fmt: str) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield ``(line, {column: stripped cell})`` for each data row, checking the
    header and the column count; trailing blank lines are ignored."""
    with _open(path) as fh:
        reader = csv.reader(fh)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise InputError("empty file (no header)", source=str(path), line=1) from None
        except (csv.Error, UnicodeDecodeError) as exc:
            raise InputError(f"not a readable CSV file: {exc}", source=str(path), line=1) from None
        for col in REQUIRED[fmt]:
            if col not in header:
                raise InputError(
                    f"missing column {col!r} in header (format {fmt} needs {','.join(REQUIRED[fmt])})",
                    source=str(path),
                    line=1,
                    field=col,
                )
        dupes = [c for c, k in Counter(header).items() if k > 1]
        if dupes:
            raise InputError(f"duplicate column {dupes[0]!r} in header", source=str(path), line=1, field=dupes[0])
        width = len(header)
        blank_at: int | None = None
        n = 0
        try:
            for row in reader:
                line = reader.line_num
                if not row or not any(c.strip() for c in row):
                    if blank_at is None:
                        blank_at = line
                    continue
                if blank_at is not None:
                    raise InputError(
                        f"blank line before more data (next data row at line {line})",
                        source=str(path),
                        line=blank_at,
                    )
                if len(row) != width:
                    short = len(row) < width
                    raise InputError(
                        f"{len(row)} fields but the header has {width}",
                        source=str(path),
                        line=line,
                        field=header[len(row)] if short else None,
                    )
                n += 1
                yield line, {h: c.strip() for h, c in zip(header, row)}
        except (csv.Error, UnicodeDecodeError) as exc:
            raise InputError(f"malformed CSV: {exc}", source=str(path), line=reader.line_num) from None
        if n == 0:
            raise InputError("no data rows (header only)", source=str(path), line=2)


class _Row:
    """Typed access to one row's cells with errors that name file, line and field."""

    __slots__ = ("path", "line", "cells")

    def __init__(self, path: str, line: int, cells: dict[str, str]) -> None:
        self.path, self.line, self.cells = path, line, cells

    def error(self, field: str | None, reason: str) -> InputError:
        return InputError(reason, source=self.path, line=self.line, field=field)

    def text(self, field: str) -> str:
        value = self.cells[field]
        if value == "":
            raise self.error(field, "empty value")
        return value

    def number(self, field: str) -> float:
        raw = self.text(field)
        try:
            value = float(raw)
        except ValueError:
            raise self.error(field, f"not a number: {raw!r}") from None
        if not math.isfinite(value):
            raise self.error(field, f"not a finite number: {raw!r}")
        return value

    def integer(self, field: str) -> int:
        value = self.number(field)
        if value != int(value):
            raise self.error(field, f"not an integer: {self.cells[field]!r}")
        return int(value)

    def time(self, field: str) -> float:
        value = self.number(field)
        if value < 0:
            raise self.error(field, f"negative time: {self.cells[field]}")
        return value


def _model_name(row: _Row, field: str, profiles: ThroughputProfile) -> str:
    model = row.text(field)
    if model not in profiles.curves:
        raise row.error(field, f"unknown model {model!r}; known models: {', '.join(profiles.models)}")
    return model


def _job(row: _Row, **kwargs) -> JobSpec:
    for col in TYPE_COLUMNS:  # optional in every format: GPU-type constraints, names separated by ';'
        raw = row.cells.get(col, "")
        if raw.strip():
            names = [t.strip() for t in raw.split(";")]
            if not all(_TYPE_NAME.fullmatch(t) for t in names):
                raise row.error(col, f"not a list of GPU type names separated by ';': {raw!r}")
            kwargs[col] = tuple(names)
    try:
        return JobSpec(**kwargs)
    except InputError as exc:  # JobSpec's own checks: add file and line
        raise row.error(exc.field, exc.reason) from None


#: Optional columns of any format: the GPU types a job may run on / must not.
TYPE_COLUMNS = ("gpu_types", "exclude_gpu_types")
_TYPE_NAME = re.compile(r"[A-Za-z][\w.-]{0,62}")


# -- per-format parsers -----------------------------------------------------

_COLUMNS = {
    # fmt: (submit, iterations, deadline, duration)
    "itp": ("submission_time", "num_iteration", "deadline", "duration"),
    "philly-ef": ("submit_time", "iteration", "ddl", "duration"),
}


def _load_with_deadlines(path: Path, fmt: str, profiles: ThroughputProfile, elastic: bool) -> list[JobSpec]:
    c_submit, c_iter, c_ddl, c_dur = _COLUMNS[fmt]
    src = str(path)
    jobs: list[JobSpec] = []
    seen: dict[str, int] = {}
    for line, cells in _rows(path, fmt):
        row = _Row(src, line, cells)
        job_id = row.text("job_id")
        if job_id in seen:
            raise row.error("job_id", f"duplicate job id {job_id!r} (first at line {seen[job_id]}, again at line {line})")
        seen[job_id] = line
        submit = row.time(c_submit)
        iterations = row.number(c_iter)
        if iterations <= 0:
            raise row.error(c_iter, f"must be > 0, got {cells[c_iter]}")
        model = _model_name(row, "model_name", profiles)
        deadline = row.time(c_ddl)
        if deadline < submit:
            raise row.error(c_ddl, f"deadline {cells[c_ddl]} is before submit time {cells[c_submit]}")
        batch = row.integer("batch_size")
        if batch <= 0:
            raise row.error("batch_size", f"must be > 0, got {cells['batch_size']}")
        gpus = row.integer("num_gpu")
        if gpus < 1:
            raise row.error("num_gpu", f"must be >= 1, got {cells['num_gpu']}")
        meta: tuple[tuple[str, str], ...] = ()
        if cells.get(c_dur):
            row.time(c_dur)  # validated, kept as given
            meta = (("duration", cells[c_dur]),)
        jobs.append(
            _job(
                row,
                job_id=job_id,
                submit_time=submit,
                model=model,
                batch_size=batch,
                iterations=iterations,
                requested_gpus=gpus,
                deadline=deadline,
                elastic=elastic,
                meta=meta,
            )
        )
    return jobs


class _Assigner:
    """Chooses (model, batch) for a GPU count from two uniform draws, caching
    the candidates and throughputs per count."""

    def __init__(self, profiles: ThroughputProfile, models: Sequence[str] | None = None) -> None:
        self.profiles = profiles
        self.models = list(models) if models is not None else profiles.models
        self._cands: dict[int, list[tuple[str, list[tuple[int, float]]]]] = {}

    def candidates(self, n: int) -> list[tuple[str, list[tuple[int, float]]]]:
        hit = self._cands.get(n)
        if hit is None:
            hit = []
            for m in self.models:
                batches = [(b, self.profiles.throughput(m, b, n)) for b in self.profiles.batch_sizes(m)]
                batches = [(b, t) for b, t in batches if t > 0]
                if batches:
                    hit.append((m, batches))
            self._cands[n] = hit
        return hit

    def pick(self, n: int, u_model: float, u_batch: float) -> tuple[str, int, float] | None:
        cands = self.candidates(n)
        if not cands:
            return None
        model, batches = cands[min(int(u_model * len(cands)), len(cands) - 1)]
        batch, tput = batches[min(int(u_batch * len(batches)), len(batches) - 1)]
        return model, batch, tput


_ts_parse: Callable[[str], datetime] = datetime.fromisoformat


def _load_philly(path: Path, profiles: ThroughputProfile, seed: int, elastic: bool) -> list[JobSpec]:
    src = str(path)
    parsed: list[tuple[datetime, float, int, int, str, str]] = []  # ts, duration, gpus, line, raw dur, cluster
    for line, cells in _rows(path, "philly"):
        row = _Row(src, line, cells)
        raw_ts = row.text("timestamp")
        try:
            ts = _ts_parse(raw_ts)
        except ValueError:
            raise row.error("timestamp", f"not a timestamp like 2017-10-09 07:01:55: {raw_ts!r}") from None
        if ts.tzinfo is not None:
            raise row.error("timestamp", f"expected a local time without time zone: {raw_ts!r}")
        duration = row.time("duration")
        gpus = row.integer("num_gpus")
        if gpus < 1:
            raise row.error("num_gpus", f"must be >= 1, got {cells['num_gpus']}")
        parsed.append((ts, duration, gpus, line, cells["duration"], cells.get("cluster", "")))

    origin = min(p[0] for p in parsed)
    draws = np.random.default_rng(seed).random((len(parsed), 2)).tolist()
    assign = _Assigner(profiles)
    jobs: list[JobSpec] = []
    for i, ((ts, duration, gpus, line, raw_dur, cluster), (u_m, u_b)) in enumerate(zip(parsed, draws)):
        picked = assign.pick(gpus, u_m, u_b)
        if picked is None:
            raise InputError(
                f"no profiled model runs at {gpus} GPUs", source=src, line=line, field="num_gpus"
            )
        model, batch, tput = picked
        iterations = duration * tput if duration > 0 else 1.0
        meta: tuple[tuple[str, str], ...] = (("duration", "0" if duration == 0 else raw_dur),)
        if cluster:
            meta += (("cluster", cluster),)
        jobs.append(
            JobSpec(
                job_id=f"p{i}",
                submit_time=(ts - origin).total_seconds(),
                model=model,
                batch_size=batch,
                iterations=iterations,
                requested_gpus=gpus,
                elastic=elastic,
                meta=meta,
            )
        )
    order = sorted(range(len(jobs)), key=lambda k: (jobs[k].submit_time, k))
    return [jobs[k] for k in order]


def _load_pollux(path: Path, data: "SiaData", elastic: bool) -> list[JobSpec]:
    src = str(path)
    apps = set(data.apps)
    jobs: list[JobSpec] = []
    seen: dict[str, int] = {}
    for line, cells in _rows(path, "pollux"):
        row = _Row(src, line, cells)
        job_id = row.text("name")
        if job_id in seen:
            raise row.error("name", f"duplicate job name {job_id!r} (first at line {seen[job_id]}, again at line {line})")
        seen[job_id] = line
        app = row.text("application")
        if app not in apps:
            raise row.error("application", f"unknown application {app!r}: no measurements of it in {data.root} "
                                           f"(known: {', '.join(sorted(apps))})")
        gpus = row.integer("num_replicas")
        if gpus < 1:
            raise row.error("num_replicas", f"must be >= 1, got {cells['num_replicas']}")
        batch = row.integer("batch_size")
        if batch < 1:
            raise row.error("batch_size", f"must be >= 1, got {cells['batch_size']}")
        jobs.append(_job(row, job_id=job_id, submit_time=row.time("time"), model=app, batch_size=batch,
                         iterations=data.iterations(app, batch), requested_gpus=gpus, elastic=elastic,
                         min_gpus=1 if elastic else None))
    return jobs


# -- public API -------------------------------------------------------------


SHIPPED = Path(__file__).resolve().parent.parent / "data" / "traces"


def shipped_traces() -> dict[str, Path]:
    """The traces shipped in the package, by name (data/traces/PROVENANCE.md)."""
    return {p.stem: p for p in sorted(SHIPPED.glob("*/*.csv"))}


def resolve_trace(path: str | Path) -> Path:
    """``path`` itself when it exists (or looks like a path), else the shipped
    trace of that name (``cluster10`` or ``cluster10.csv``)."""
    p = Path(path)
    if p.exists() or len(p.parts) > 1:
        return p
    return shipped_traces().get(p.name.removesuffix(".csv"), p)


def load_trace(
    path: str | Path,
    fmt: str = "auto",
    *,
    seed: int = 0,
    limit: int | None = None,
    profiles: ThroughputProfile | None = None,
    elastic: bool = True,
    data_dir: str | Path | None = None,
) -> Trace:
    """Load a trace file. ``fmt="auto"`` detects the format from the header;
    ``seed`` drives the Philly model assignment; ``limit`` keeps the first N
    jobs by submit time (trace order is kept among them). ``path`` may also
    name a trace shipped with Tidal (``cluster10``, ``195job``). A Pollux/Sia
    workload reads its applications' data from ``data_dir`` (default: the
    ``traces/`` folder above the file, :func:`tidal.sim.sia.data_for`)."""
    path = resolve_trace(path)
    if fmt not in ("auto", *REQUIRED):
        raise InputError(f"unknown trace format {fmt!r}; use auto, {', '.join(REQUIRED)}", field="fmt")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InputError(f"must be a positive integer, got {limit!r}", field="limit")
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "pollux":
        from tidal.sim.sia import data_for

        jobs = _load_pollux(path, data_for(path, data_dir), elastic)
    elif fmt == "philly":
        jobs = _load_philly(path, profiles if profiles is not None else load_profiles(), seed, elastic)
    else:
        jobs = _load_with_deadlines(path, fmt, profiles if profiles is not None else load_profiles(), elastic)
    if limit is not None and limit < len(jobs):
        keep = sorted(sorted(range(len(jobs)), key=lambda k: (jobs[k].submit_time, k))[:limit])
        jobs = [jobs[k] for k in keep]
    trace = Trace(tuple(jobs), str(path), fmt)
    log.info("loaded %s trace %s: %d jobs", fmt, path, len(jobs))
    return trace


def poisson_jobs(
    n: int,
    *,
    rate_per_hour: float,
    seed: int = 0,
    models: Sequence[str] | None = None,
    profiles: ThroughputProfile | None = None,
    deadline_factor: float | None = None,
    max_gpus: int = 8,
    elastic: bool = True,
) -> Trace:
    """A synthetic workload of ``n`` jobs with Poisson arrivals.

    Inter-arrival times are exponential with mean ``3600 / rate_per_hour`` s
    (the first job arrives one gap after t=0). Each job requests 1, 2, 4 or 8
    GPUs (at most ``max_gpus``) with probabilities 0.5/0.25/0.15/0.1
    renormalised; its model is uniform among ``models`` (default: all profiled)
    that run at that count, its batch size uniform among the model's profiled
    sizes that run there; its duration at the requested count is log-uniform in
    [10 min, 8 h] and ``iterations = duration * throughput``. With
    ``deadline_factor`` the deadline is ``submit + deadline_factor * duration``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InputError(f"must be a positive integer, got {n!r}", field="n")
    if not (isinstance(rate_per_hour, (int, float)) and math.isfinite(rate_per_hour) and rate_per_hour > 0):
        raise InputError(f"must be a positive number, got {rate_per_hour!r}", field="rate_per_hour")
    if isinstance(max_gpus, bool) or not isinstance(max_gpus, int) or max_gpus < 1:
        raise InputError(f"must be an integer >= 1, got {max_gpus!r}", field="max_gpus")
    if deadline_factor is not None and not (math.isfinite(deadline_factor) and deadline_factor > 0):
        raise InputError(f"must be a positive number, got {deadline_factor!r}", field="deadline_factor")
    profiles = profiles if profiles is not None else load_profiles()
    if models is not None:
        models = list(models)
        if not models:
            raise InputError("must name at least one model", field="models")
        for m in models:
            if m not in profiles.curves:
                raise InputError(f"unknown model {m!r}; known models: {', '.join(profiles.models)}", field="models")
    assign = _Assigner(profiles, models)
    choices = [(g, p) for g, p in POISSON_GPU_CHOICES if g <= max_gpus]
    counts = np.array([g for g, _ in choices])
    probs = np.array([p for _, p in choices])
    probs = probs / probs.sum()

    rng = np.random.default_rng(seed)
    gaps = rng.exponential(3600.0 / rate_per_hour, size=n)
    submits = np.cumsum(gaps).tolist()
    gpus = rng.choice(counts, size=n, p=probs).tolist()
    u = rng.random((n, 2)).tolist()
    durations = np.exp(
        rng.uniform(math.log(POISSON_MIN_DURATION_S), math.log(POISSON_MAX_DURATION_S), size=n)
    ).tolist()

    jobs: list[JobSpec] = []
    for i in range(n):
        g = int(gpus[i])
        picked = assign.pick(g, u[i][0], u[i][1])
        if picked is None:
            raise InputError(f"no requested model runs at {g} GPUs", field="models")
        model, batch, tput = picked
        submit, duration = submits[i], durations[i]
        jobs.append(
            JobSpec(
                job_id=f"s{i}",
                submit_time=submit,
                model=model,
                batch_size=batch,
                iterations=duration * tput,
                requested_gpus=g,
                deadline=submit + deadline_factor * duration if deadline_factor is not None else None,
                elastic=elastic,
                meta=(("duration", repr(duration)),),
            )
        )
    source = f"poisson(n={n}, rate_per_hour={rate_per_hour:g}, seed={seed}"
    if deadline_factor is not None:
        source += f", deadline_factor={deadline_factor:g}"
    source += ")"
    return Trace(tuple(jobs), source, "poisson")
