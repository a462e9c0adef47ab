"""Throughput profiles: iterations/s by (model, global batch, GPU count).

Rules for counts that were not measured (documented in docs/simulator.md):
- between two measured counts: linear interpolation in the GPU count;
- above the largest measured count: the value at the largest measured count
  (never extrapolate upward — extra GPUs are assumed to add nothing);
- an empty cell means "not measured"; a zero means "does not run" and caps the
  job's usable GPU count below it;
- a global batch size that was not measured: the nearest measured batch size,
  scaled by ``measured_batch / batch`` (iterations of a larger batch take
  proportionally longer at equal samples/s).

A job spread over more nodes than it needs runs at ``cross_node_penalty`` of
the profiled speed (profiles were measured with consolidated placement).
"""

from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterable

from tidal.core.errors import InputError


@dataclass(frozen=True)
class ModelCurve:
    """Measured iterations/s of one model at one global batch size."""

    counts: tuple[int, ...]  # measured GPU counts, ascending, throughput > 0
    values: tuple[float, ...]
    unsupported_from: int | None = None  # first count that "does not run"

    def at(self, n: float) -> float:
        if n <= 0:
            return 0.0
        if self.unsupported_from is not None and n >= self.unsupported_from:
            return 0.0
        counts, values = self.counts, self.values
        if n <= counts[0]:
            # below the smallest measured count: proportional scaling down
            return values[0] * n / counts[0]
        if n >= counts[-1]:
            return values[-1]
        i = bisect.bisect_left(counts, n)
        if counts[i] == n:
            return values[i]
        c0, c1, v0, v1 = counts[i - 1], counts[i], values[i - 1], values[i]
        return v0 + (v1 - v0) * (n - c0) / (c1 - c0)


@dataclass(frozen=True)
class ThroughputProfile:
    """Profiles of many models. ``throughput(model, batch, n)`` in iterations/s."""

    curves: dict[str, dict[int, ModelCurve]]
    cross_node_penalty: float = 0.9
    source: str = ""
    _cache: dict = field(default_factory=dict, compare=False, repr=False)
    _memo: dict = field(default_factory=dict, compare=False, repr=False)  # throughput() results
    by_type: dict[str, "ThroughputProfile"] = field(default_factory=dict, compare=False)  # GPU type -> profile

    def typed(self, gpu_type: str, model: str) -> "ThroughputProfile":
        """The profile of ``model`` on GPUs of ``gpu_type``: that type's if it
        has the model, else this (default) one."""
        sub = self.by_type.get(gpu_type) if gpu_type else None
        return sub if sub is not None and model in sub.curves else self

    def throughput_on(self, model: str, batch: int, n: float, spread: bool, gpu_types: Iterable[str]) -> float:
        """Iterations/s on ``n`` GPUs of the given types: a data-parallel job
        steps at the pace of its slowest GPUs, so the least of the types'
        throughputs at ``n`` (Sia, SOSP'23, and Gavel, OSDI'20, model mixed
        placements the same way where not measured)."""
        if not self.by_type:
            return self.throughput(model, batch, n, spread)
        return min(self.typed(t, model).throughput(model, batch, n, spread) for t in set(gpu_types) or {""})

    @property
    def models(self) -> list[str]:
        return sorted(self.curves)

    def batch_sizes(self, model: str) -> list[int]:
        return sorted(self._model(model))

    def _model(self, model: str) -> dict[int, ModelCurve]:
        try:
            return self.curves[model]
        except KeyError:
            raise InputError(
                f"unknown model {model!r}; profiled models: {', '.join(self.models)}",
                field="model",
            ) from None

    def _curve(self, model: str, batch: int) -> tuple[ModelCurve, float]:
        key = (model, batch)
        hit = self._cache.get(key)
        if hit is None:
            per_batch = self._model(model)
            if batch in per_batch:
                hit = (per_batch[batch], 1.0)
            else:
                nearest = min(per_batch, key=lambda b: (abs(math.log(b / batch)), b))
                hit = (per_batch[nearest], nearest / batch)
            self._cache[key] = hit
        return hit

    def throughput(self, model: str, batch: int, n: float, spread: bool = False) -> float:
        """Iterations/s at ``n`` GPUs; ``spread`` applies the cross-node penalty."""
        key = (model, batch, n, spread)
        hit = self._memo.get(key)
        if hit is None:
            curve, scale = self._curve(model, batch)
            value = curve.at(n) * scale
            hit = self._memo[key] = value * self.cross_node_penalty if spread else value
        return hit

    def max_useful(self, model: str, batch: int, cap: int) -> int:
        """The smallest GPU count <= ``cap`` that reaches the best throughput
        among the counts a job may use (profiled counts and the cap itself)."""
        curve, _ = self._curve(model, batch)
        best_n, best_v = 0, 0.0
        for n in sorted({c for c in curve.counts if c <= cap} | {cap}):
            v = curve.at(n)
            if v > best_v * (1 + 1e-9):
                best_n, best_v = n, v
        return best_n

    def profiled_counts(self, model: str, batch: int) -> tuple[int, ...]:
        return self._curve(model, batch)[0].counts


def _parse_profile_csv(path: Path) -> dict[int, ModelCurve]:
    out: dict[int, ModelCurve] = {}
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        try:
            header = next(reader)
        except StopIteration:
            raise InputError("empty file", source=str(path), line=1) from None
        if not header or header[0].strip() != "global_batch_size":
            raise InputError(
                "first column must be 'global_batch_size'", source=str(path), line=1, field=header[0] if header else None
            )
        try:
            gpu_counts = [int(h) for h in header[1:]]
        except ValueError as exc:
            raise InputError(f"GPU count columns must be integers ({exc})", source=str(path), line=1) from None
        for lineno, row in enumerate(reader, start=2):
            if not row or not "".join(row).strip():
                continue
            try:
                batch = int(row[0])
            except ValueError:
                raise InputError(
                    f"not an integer: {row[0]!r}", source=str(path), line=lineno, field="global_batch_size"
                ) from None
            counts, values, unsupported = [], [], None
            for col, n in enumerate(gpu_counts, start=1):
                cell = row[col].strip() if col < len(row) else ""
                if cell == "":
                    continue
                try:
                    v = float(cell)
                except ValueError:
                    raise InputError(
                        f"not a number: {cell!r}", source=str(path), line=lineno, field=str(n)
                    ) from None
                if v < 0 or math.isnan(v):
                    raise InputError(f"must be >= 0, got {cell}", source=str(path), line=lineno, field=str(n))
                if v == 0:
                    unsupported = n if unsupported is None else min(unsupported, n)
                    continue
                counts.append(n)
                values.append(v)
            if not counts:
                raise InputError("no measured GPU count", source=str(path), line=lineno)
            out[batch] = ModelCurve(tuple(counts), tuple(values), unsupported)
    if not out:
        raise InputError("no data rows", source=str(path), line=2)
    return out


def load_profiles(directory: str | Path | None = None, cross_node_penalty: float = 0.9) -> ThroughputProfile:
    """Load every ``<model>.csv`` of a profile directory (default: the A100
    profiles shipped inside the package), and every ``<gpu type>/<model>.csv``
    below it as that GPU type's profiles (:meth:`ThroughputProfile.typed`)."""
    if directory is None:
        return _default_profiles(cross_node_penalty)
    path = Path(directory)
    if not path.is_dir():
        raise InputError("profile directory does not exist" if not path.exists() else
                         "not a directory: give the profile directory (one <model>.csv per model)", source=str(path))
    files = sorted(path.glob("*.csv"))
    typed = {d.name: load_profiles(d, cross_node_penalty) for d in sorted(path.iterdir())
             if d.is_dir() and any(d.glob("*.csv"))}
    if not files and not typed:
        raise InputError("no <model>.csv files in profile directory (nor <gpu type>/<model>.csv)", source=str(path))
    if not files:  # per type only: untyped nodes run at the shipped (A100) profiles
        default = _default_profiles(cross_node_penalty)
        return ThroughputProfile(dict(default.curves), cross_node_penalty, source=str(path), by_type=typed)
    curves = {f.stem: _parse_profile_csv(f) for f in files}
    return ThroughputProfile(curves, cross_node_penalty, source=str(path), by_type=typed)


@lru_cache(maxsize=4)
def _default_profiles(cross_node_penalty: float) -> ThroughputProfile:
    root = resources.files("tidal") / "data" / "profiles" / "a100"
    with resources.as_file(root) as p:
        return load_profiles(p, cross_node_penalty)
