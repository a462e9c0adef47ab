"""The Pollux (OSDI'21) and Sia (SOSP'23) measured data as simulator inputs.

A data folder (``sia/traces/`` or ``pollux/traces/``) holds one folder per
application with

* ``placements-<type>.csv`` (``placement,local_bsz,step_time,sync_time``, in
  any column order; ``placement`` lists GPUs per node, ``"44"`` = 2 nodes x 4)
  and ``scalability-<type>.csv`` (``num_nodes,num_replicas,...`` instead of
  ``placement``): measured step times per GPU type. Pollux's folder has the
  untyped ``placements.csv``/``scalability.csv`` (one GPU type, which its
  README does not name): that is the default profile, used on every node.
  Where typed files exist the untyped ones are ignored (Sia's are a copy of
  its ``aws`` files).
* ``validation-<B>.csv``: training at global batch ``B``; the last row's
  ``iteration`` is the number of steps the job needs at ``B``.

Every (application, GPU type) is fitted once to the step-time model of
:mod:`tidal.core.steptime` (cached), and :func:`build_profiles` turns the
fitted models into a :class:`~tidal.core.profile.ThroughputProfile` with one
sub-profile per GPU type of a cluster. GPU type names: the data's ``aws`` is
``T4``, ``azure`` ``V100``, ``dgx-ext`` (or ``dgx`` where it is missing)
``A100``, ``quad`` ``RTX6000``, ``rtx`` ``RTX2080Ti``; the data's names work
in a cluster spec too (case does not matter).
"""

from __future__ import annotations

import bisect
import csv
import logging
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

from tidal.core.errors import InputError
from tidal.core.profile import ModelCurve, ThroughputProfile
from tidal.core.steptime import StepRow, StepTimeParams, fit, step_time
from tidal.core.topology import Cluster

log = logging.getLogger(__name__)

#: GPU type names of the data's machines (Sia, SOSP'23, §6: its clusters).
TYPE_NAMES: dict[str, str] = {"aws": "T4", "azure": "V100", "dgx-ext": "A100", "dgx": "A100",
                              "quad": "RTX6000", "rtx": "RTX2080Ti"}
#: the data type read for a GPU type name, most preferred first
_PREFERENCE: dict[str, tuple[str, ...]] = {"t4": ("aws",), "v100": ("azure",), "a100": ("dgx-ext", "dgx"),
                                          "rtx6000": ("quad",), "rtx2080ti": ("rtx",)}
DEFAULT = ""  # the data type of untyped files (Pollux's)
#: counts listed one by one in a profile curve; above, about 10% apart
DENSE_COUNTS = 64
_TYPED = re.compile(r"^(placements|scalability)-(.+)\.csv$")


def _data_type(path: Path) -> str | None:
    """The data type a measurement file is for ("" for untyped), or None."""
    if path.name in ("placements.csv", "scalability.csv"):
        return DEFAULT
    m = _TYPED.match(path.name)
    return m.group(2) if m else None


def is_data_dir(path: Path) -> bool:
    """Whether ``path`` is a Pollux/Sia traces folder (an app folder with a
    ``placements*.csv``)."""
    return path.is_dir() and any(path.glob("*/placements*.csv"))


def find_data_dir(workload: Path) -> Path | None:
    """The traces folder of a workload file: the nearest ``traces/`` of an
    enclosing folder (``sia/workloads/saturn/x.csv`` -> ``sia/traces``,
    ``pollux/workloads/x.csv`` -> ``pollux/traces``)."""
    for parent in workload.resolve().parents:
        cand = parent / "traces"
        if is_data_dir(cand):
            return cand
    return None


def data_for(workload: Path, given: str | Path | None = None) -> "SiaData":
    """The data folder of a Pollux/Sia workload: ``given`` (``--profiles``)
    when it is one, else the ``traces/`` folder above the workload."""
    if given is not None:
        if not is_data_dir(Path(given)):
            raise InputError("a Pollux/Sia workload needs the measured data: a traces folder with "
                             "<app>/placements*.csv (or leave --profiles out to use the traces/ folder above the "
                             "workload)", source=str(given), field="profiles")
        return SiaData(Path(given))
    found = find_data_dir(workload)
    if found is None:
        raise InputError("a Pollux/Sia workload, but no traces/ folder with <app>/placements*.csv above it; "
                         "give the data folder with --profiles", source=str(workload))
    return SiaData(found)


def _read(path: Path) -> list[dict[str, str]]:
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            return [{k.strip(): (v or "").strip() for k, v in r.items() if k} for r in csv.DictReader(fh)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise InputError(f"cannot read: {getattr(exc, 'strerror', None) or exc}", source=str(path)) from None


def _num(row: dict[str, str], col: str, path: Path, line: int) -> float:
    try:
        value = float(row[col])
    except KeyError:
        raise InputError(f"missing column {col!r}", source=str(path), line=1, field=col) from None
    except ValueError:
        raise InputError(f"not a number: {row[col]!r}", source=str(path), line=line, field=col) from None
    if not math.isfinite(value) or value < 0:
        raise InputError(f"must be a finite number >= 0, got {row[col]!r}", source=str(path), line=line, field=col)
    return value


def read_rows(path: Path) -> list[StepRow]:
    """The measurements of a ``placements*.csv`` or ``scalability*.csv`` file,
    columns read by name. Where a file's sync time exceeds its step time on
    some row (Sia's hybrid-parallel ``gpt_pmp``), its ``step_time`` is the
    compute part and the step is their sum; elsewhere it is the whole step."""
    out: list[tuple[int, int, float, float, float]] = []
    for line, row in enumerate(_read(path), 2):
        if "placement" in row:
            place = row["placement"]
            if not place.isdigit() or "0" in place:
                raise InputError(f"not a placement (GPUs per node, like 44): {place!r}",
                                 source=str(path), line=line, field="placement")
            nodes, replicas = len(place), sum(int(c) for c in place)
        else:
            nodes, replicas = int(_num(row, "num_nodes", path, line)), int(_num(row, "num_replicas", path, line))
        out.append((nodes, replicas, _num(row, "local_bsz", path, line), _num(row, "step_time", path, line),
                    _num(row, "sync_time", path, line)))
    compute_only = any(sync > step for _, _, _, step, sync in out)
    return [StepRow(n, k, m, step + sync if compute_only else step, sync) for n, k, m, step, sync in out]


@lru_cache(maxsize=512)
def fitted(data_dir: Path, app: str, data_type: str) -> StepTimeParams:
    """The step-time model of ``app`` on ``data_type`` fitted to all its
    placement and scalability rows (cached per folder, app and type)."""
    suffix = f"-{data_type}" if data_type else ""
    rows: list[StepRow] = []
    for kind in ("placements", "scalability"):
        path = data_dir / app / f"{kind}{suffix}.csv"
        if path.exists():
            rows += read_rows(path)
    if not rows:
        raise InputError(f"no measurements of {app!r} on {data_type or 'the default type'}",
                         source=str(data_dir / app))
    params = fit(rows)
    log.debug("fitted %s on %s: %s", app, data_type or "default", params)
    return params


@dataclass(frozen=True)
class SiaData:
    """A Pollux/Sia traces folder."""

    root: Path

    @property
    def apps(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and any(p.glob("placements*.csv")))

    def data_types(self, app: str) -> list[str]:
        """The data types measured for ``app`` (``[""]`` for Pollux's untyped files)."""
        found = {_data_type(p) for p in (self.root / app).glob("placements*.csv")}
        typed = sorted(t for t in found if t)
        return typed or ([DEFAULT] if DEFAULT in found else [])

    def resolve(self, app: str, gpu_type: str) -> str | None:
        """The data type to read for a cluster's GPU type name (None: not measured)."""
        have = self.data_types(app)
        if have == [DEFAULT]:
            return DEFAULT
        key = gpu_type.lower()
        for cand in _PREFERENCE.get(key, ()) + tuple(t for t in have if t.lower() == key):
            if cand in have:
                return cand
        return None

    def params(self, app: str, data_type: str) -> StepTimeParams:
        return fitted(self.root.resolve(), app, data_type)

    def validation_steps(self, app: str) -> dict[int, float]:
        """Global batch -> steps to train at it (last ``iteration`` of
        ``validation-<B>.csv``)."""
        out: dict[int, float] = {}
        for path in (self.root / app).glob("validation-*.csv"):
            batch = path.stem.removeprefix("validation-")
            rows = _read(path)
            if not batch.isdigit() or not rows:
                continue
            out[int(batch)] = _num(rows[-1], "iteration", path, len(rows) + 1)
        return dict(sorted(out.items()))

    def iterations(self, app: str, batch: int) -> float:
        """Steps needed at global batch ``batch``: measured, else interpolated
        linearly in (log B, log steps) between the neighbouring measured
        batches; below the smallest, the same samples (steps x B/batch); above
        the largest, its steps (no further gain)."""
        return interpolate_steps(_steps(self.root.resolve(), app), batch)


@lru_cache(maxsize=64)
def _steps(root: Path, app: str) -> tuple[tuple[int, float], ...]:
    steps = SiaData(root).validation_steps(app)
    if not steps:
        raise InputError(f"no validation-<batch>.csv for {app!r}", source=str(root / app))
    return tuple(steps.items())


def interpolate_steps(points: Sequence[tuple[int, float]], batch: float) -> float:
    """See :meth:`SiaData.iterations`; ``points`` ascending by batch."""
    batches = [b for b, _ in points]
    if batch <= batches[0]:
        return points[0][1] * batches[0] / batch
    if batch >= batches[-1]:
        return points[-1][1]
    i = bisect.bisect_left(batches, batch)
    (b0, s0), (b1, s1) = points[i - 1], points[i]
    if b1 == batch:
        return s1
    w = math.log(batch / b0) / math.log(b1 / b0)
    return math.exp(math.log(s0) + w * (math.log(s1) - math.log(s0)))


# -- profiles ------------------------------------------------------------------


def profile_counts(total: int) -> list[int]:
    """GPU counts a curve lists: 1..64 one by one, then about 10% apart, and ``total``."""
    counts = list(range(1, min(total, DENSE_COUNTS) + 1))
    while counts[-1] < total:
        counts.append(min(total, max(counts[-1] + 1, int(counts[-1] * 1.1))))
    return counts


def curve(params: StepTimeParams, batch: int, gpus_per_node: int, counts: Sequence[int]) -> ModelCurve:
    """Iterations/s at each count on a consolidated placement
    (``ceil(n / gpus_per_node)`` nodes). A count at which each GPU would get
    fewer samples than the smallest measured local batch (or than one) does
    not run: the model is not extrapolated there."""
    most = max(1, int(batch // max(params.min_local_bsz, 1.0)))
    ns, values = [], []
    for n in counts:
        if n > most:
            break
        ns.append(n)
        values.append(1.0 / step_time(params, -(-n // gpus_per_node), n, batch / n))
    if not ns:  # even one GPU gets less than the smallest measured local batch: it runs on one
        ns, values = [1], [1.0 / step_time(params, 1, 1, batch)]
    return ModelCurve(tuple(ns), tuple(values), max(most, ns[-1]) + 1 if max(most, ns[-1]) < counts[-1] else None)


def _slowest(curves: Sequence[ModelCurve]) -> ModelCurve:
    """Point-wise the least of curves built on the same count list (each
    lists a prefix of it): up to the shortest one, which also ends them."""
    first = min(curves, key=lambda c: (len(c.counts), c.unsupported_from or math.inf))
    values = tuple(min(c.values[i] for c in curves) for i in range(len(first.counts)))
    return ModelCurve(first.counts, values, first.unsupported_from)


def workload_profiles(jobs: Iterable, cluster: Cluster, data: "SiaData") -> ThroughputProfile:
    """:func:`build_profiles` for the (model, batch) pairs of ``jobs``."""
    return build_profiles(data, {(j.model, j.batch_size) for j in jobs}, cluster)


def _type_node_sizes(cluster: Cluster) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for node in cluster.nodes:
        sizes[node.gpu_type] = max(sizes.get(node.gpu_type, 0), node.gpus)
    return sizes


def build_profiles(data: SiaData, pairs: Iterable[tuple[str, int]], cluster: Cluster) -> ThroughputProfile:
    """Throughput profiles of the (app, global batch) pairs on ``cluster``.

    Each GPU type of the cluster gets a sub-profile from its fitted model, at
    every count up to the cluster's size (a mixed placement runs at the
    slowest type's throughput at its full count), on that type's node size.
    The default profile (untyped nodes, types without data, and policies
    that are not type-aware) is point-wise the slowest of the cluster's
    measured types, or of all the app's measured types when the cluster has
    none. With Pollux's untyped data every node runs at its one profile.
    """
    counts = profile_counts(cluster.num_gpus)
    sizes = _type_node_sizes(cluster)
    by_type: dict[str, dict[str, dict[int, ModelCurve]]] = {t: {} for t in sizes if t}
    default: dict[str, dict[int, ModelCurve]] = {}
    missing: set[str] = set()
    for app, batch in sorted(set(pairs)):
        per_type: dict[str, ModelCurve] = {}
        for gtype, gpn in sizes.items():
            dtype = data.resolve(app, gtype) if gtype else None
            if dtype is None:
                missing.add(gtype or "untyped")
                continue
            per_type[gtype] = curve(data.params(app, dtype), batch, gpn, counts)
        if per_type and data.data_types(app) != [DEFAULT]:
            for gtype, c in per_type.items():
                by_type[gtype].setdefault(app, {})[batch] = c
            default.setdefault(app, {})[batch] = _slowest(list(per_type.values()))
        else:
            gpn = max(sizes.values())
            default.setdefault(app, {})[batch] = _slowest(
                [curve(data.params(app, t), batch, gpn, counts) for t in data.data_types(app)])
    if missing - {"untyped"}:
        log.warning("no measurements in %s for GPU type(s) %s: such nodes run at the slowest measured type's "
                    "pace", data.root, ", ".join(sorted(missing - {"untyped"})))
    subs = {t: ThroughputProfile(c, cross_node_penalty=1.0, source=f"{data.root} ({t})")
            for t, c in by_type.items() if c}
    return ThroughputProfile(default, cross_node_penalty=1.0, source=str(data.root), by_type=subs)
