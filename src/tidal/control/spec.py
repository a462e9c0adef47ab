"""Job specs for the live cluster: YAML file or CLI flags, validated with
pydantic so that an error names the field.

GPU request forms (SideCar's "optional numbers of GPUs", ElasticFlow's
serverless jobs), read by :func:`parse_gpu_request` alone:
  gpus: 4            a count: rigid (always 4 GPUs), unless ``elastic: true``
                     (then 4 is preferred) or ``min_gpus``/``max_gpus`` bound it
  gpus: "2-8"        an elastic range
  gpus: [1, 2, 4]    an allowed set (as text, e.g. on the command line: "1,2,4")
  (none) + deadline  serverless: the scheduler picks the count

Per-worker limits (docs/resources.md), enforced by the agents:
  resources: {memory: 2Gi, cpus: 1.5}

What can never start is refused here, naming the field (:func:`launchable`):
a NUL byte or a lone surrogate (not UTF-8) in ``script``, ``args``,
``workdir`` or ``env``; a control character (below 0x20, or 0x7f) in the
``script`` or ``workdir`` path; one argument or ``KEY=value`` longer than
Linux's per-string exec limit (:data:`MAX_ARG_BYTES`); all of them together
over a share of the exec limit (:func:`exec_budget`); an env key that is no
name (empty, or with ``=``).

GPU types (a node selector and an anti-affinity, as Kubernetes' nodeSelector
or Slurm's ``--constraint``; names as the agents report them, e.g. ``A100``):
  gpu_types: A100           run only on GPUs of this type (``gpu_type`` is the same key)
  gpu_types: [A100, V100]   ... or of one of these
  exclude_gpu_types: [T4]   never on these

Auto-configuration (DLRover's premise: users size jobs badly; docs/autoconf.md):
  resources: auto    or no GPU count at all: the control plane sizes the job
                     (:mod:`tidal.control.autoconf`); ``{auto: true, cpus: 1}``
                     keeps a CPU limit of one's own
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from tidal.core.errors import InputError
from tidal.core.job import JobSpec

MAX_GPUS = 100_000  # a bound on every GPU count a spec may ask for (the cluster's size is checked later)

#: the longest argument or ``KEY=value`` string Linux's exec takes, in bytes without its terminating
#: NUL (MAX_ARG_STRLEN: 32 pages of 4 KiB); a longer one fails with E2BIG on every host
MAX_ARG_BYTES = 32 * 4096 - 1
#: the share of the exec limit (arguments and environment together) a job's script, arguments and
#: environment may take; the rest is for the interpreter, the agent's and the control plane's variables
EXEC_SHARE = 0.25
_EXEC_LIMIT = 2 * 2**20  # Linux's usual limit (a quarter of an 8 MiB stack), when sysconf does not say
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def exec_budget() -> int:
    """Bytes a job's own script, arguments and environment may take at exec
    (pointers included): :data:`EXEC_SHARE` of ``sysconf(SC_ARG_MAX)``, at
    most of Linux's usual 2 MiB (the agents' hosts may have no more)."""
    try:
        limit = os.sysconf("SC_ARG_MAX")
    except (ValueError, OSError):
        limit = -1
    return int(EXEC_SHARE * (min(limit, _EXEC_LIMIT) if limit > 0 else _EXEC_LIMIT))


def launchable(text: str, what: str, *, path: bool = False) -> int:
    """The bytes ``text`` takes at exec; raises ``ValueError`` naming ``what``
    when no host can start a process with it: a NUL byte, a lone surrogate,
    more than :data:`MAX_ARG_BYTES`, or in a ``path`` a control character.
    The text itself is never echoed (it may be 200 KiB long)."""
    if "\x00" in text:
        raise ValueError(f"{what}: holds a NUL byte (at character {text.index(chr(0))}), which exec cannot pass")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ValueError(f"{what}: holds a lone surrogate ({ascii(text[e.start])} at character {e.start}), "
                         "which is not valid UTF-8") from None
    if size > MAX_ARG_BYTES:
        raise ValueError(f"{what}: {size} bytes, over the {MAX_ARG_BYTES} an exec takes in one string "
                         "(MAX_ARG_STRLEN); pass large data in a file")
    bad = _CONTROL.search(text) if path else None
    if bad is not None:
        raise ValueError(f"{what}: holds a control character ({ascii(bad.group())} at character {bad.start()}); "
                         "a path may not")
    return size

GpuValue = int | str | list[int] | None

_GPU_TYPE = re.compile(r"^[A-Za-z][\w.-]*$")  # as a node's GPU type (tidal.core.topology)
MAX_GPU_TYPES = 64


def gpu_type_list(value: Any) -> tuple[str, ...]:
    """GPU type names from one name, a comma-separated text or a list;
    raises ``ValueError`` on an empty or malformed name."""
    if isinstance(value, str):
        value = value.split(",") if value.strip() else [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError("give a GPU type name like A100, or a list of them")
    if len(value) > MAX_GPU_TYPES:
        raise ValueError(f"at most {MAX_GPU_TYPES} GPU types")
    out = []
    for v in value:
        name = v.strip() if isinstance(v, str) else v
        if not isinstance(name, str) or not name:
            raise ValueError("an empty GPU type name")
        if not _GPU_TYPE.match(name) or len(name) > 64:
            raise ValueError(f"{name[:40]!r} is not a GPU type name (a letter, then letters, digits, '_', '.', '-')")
        out.append(name)
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class GpuRequest:
    """A parsed GPU request: ``lo``-``hi`` for a range, ``allowed`` for a set,
    ``requested`` the preferred count (0: none given, the scheduler picks)."""

    lo: int | None = None
    hi: int | None = None
    allowed: tuple[int, ...] | None = None
    requested: int = 0

    @property
    def flexible(self) -> bool:
        """The request itself leaves the count open (a range, a set, or none)."""
        return self.requested == 0 or self.lo is not None or self.allowed is not None

    def value(self) -> GpuValue:
        """The request in its canonical JSON form (4, "2-8", [1, 2, 4] or None)."""
        if self.lo is not None:
            return f"{self.lo}-{self.hi}"
        if self.allowed is not None:
            return list(self.allowed)
        return self.requested or None


def parse_gpu_request(value: Any) -> GpuRequest:
    """Read a GPU request: None, a count, a range ("2-8"), a set ([1, 2, 4]),
    or the text of any of them ("4", "2-8", "1,2,4"). Raises ``ValueError``
    saying what is wrong."""
    if value is None:
        return GpuRequest()
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit() or (text.startswith("-") and text[1:].isdigit()):
            value = int(text)  # a negative count is refused below as such, not as a bad range
        elif "," in text:
            parts = [p.strip() for p in text.split(",")]
            if not all(p.isdigit() for p in parts):
                raise ValueError("an allowed set must look like '1,2,4'")
            value = [int(p) for p in parts]
        else:
            return _parse_range(text)
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise ValueError("give a count, a range like '2-8' or a set like [1, 2, 4]")
    if isinstance(value, int):
        if value < 1:
            raise ValueError("must be >= 1")
        if value > MAX_GPUS:
            raise ValueError(f"must be <= {MAX_GPUS}")
        return GpuRequest(requested=value)
    if not value or any(isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= MAX_GPUS for x in value):
        raise ValueError(f"an allowed set must be a non-empty list of counts >= 1 (and <= {MAX_GPUS})")
    allowed = tuple(sorted(set(value)))
    return GpuRequest(allowed=allowed, requested=allowed[-1])


def _parse_range(text: str) -> GpuRequest:
    parts = text.split("-")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError("a range must look like '2-8'")
    lo, hi = (int(p) for p in parts)
    if not 1 <= lo <= hi <= MAX_GPUS:
        raise ValueError(f"range needs 1 <= low <= high <= {MAX_GPUS}")
    return GpuRequest(lo=lo, hi=hi, requested=hi)


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_MEMORY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]i?)?[bB]?\s*$")
MIN_MEMORY = 32 * 2**20  # below this not even the interpreter starts
MAX_MEMORY = 2**50


def parse_memory(value: Any) -> int:
    """Bytes from a memory size: a count of bytes, or text like ``2Gi``,
    ``512Mi``, ``1.5G`` (binary ``Ki Mi Gi Ti``, decimal ``k M G T``).
    Raises ``ValueError`` saying what is wrong."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError("give a size like 2Gi, 512Mi or 4G (or a number of bytes)")
    if isinstance(value, int):
        n = value
    else:
        m = _MEMORY.match(value)
        if m is None:
            raise ValueError(f"{value[:40]!r} is not a size like 2Gi, 512Mi or 4G")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if not MIN_MEMORY <= n <= MAX_MEMORY:
        raise ValueError(f"must be between 32Mi and 1Pi per worker, not {n} bytes")
    return n


class Resources(BaseModel):
    """What each worker of the job may use (the agents enforce it)."""

    model_config = ConfigDict(extra="forbid")

    memory: int | str | None = Field(default=None, description="per worker: 2Gi, 512Mi, 4G or bytes")
    cpus: float | None = Field(default=None, gt=0, le=1024, allow_inf_nan=False,
                               description="per worker, fractions allowed (1.5)")
    auto: bool = Field(default=False, description="size the job automatically (docs/autoconf.md)")

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: Any) -> int | str | None:
        if v is not None:
            parse_memory(v)
        return v

    def limits(self) -> dict[str, Any]:
        """``{"memory": bytes, "cpus": n}``, only what is set."""
        out: dict[str, Any] = {}
        if self.memory is not None:
            out["memory"] = parse_memory(self.memory)
        if self.cpus is not None:
            out["cpus"] = float(self.cpus)
        return out


class JobSubmission(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")
    script: str = Field(..., min_length=1, description="training script (path on the agents' machines)")
    args: list[str] = Field(default_factory=list)
    workdir: str = ""
    env: dict[str, str] = Field(default_factory=dict)
    gpus: int | str | list[int] | None = None
    min_gpus: int | None = Field(default=None, ge=1, le=MAX_GPUS)
    max_gpus: int | None = Field(default=None, ge=1, le=MAX_GPUS)
    elastic: bool | None = Field(default=None, description="may be rescaled: true by default for a range, a set "
                                                            "or no count; a plain count is rigid unless true")
    global_batch_size: int = Field(default=32, ge=1, le=10**9)
    iterations: int | None = Field(default=None, ge=1, le=10**12)
    epochs: float | None = Field(default=None, gt=0, le=10**6, allow_inf_nan=False)
    dataset_size: int | None = Field(default=None, ge=1, le=10**13)
    deadline: float | None = Field(default=None, gt=0, le=10 * 365 * 86400, allow_inf_nan=False,
                                   description="seconds after submission (at most ten years)")
    priority: int = Field(default=0, ge=-10**6, le=10**6)
    model: str = Field(default="generic", description="throughput profile to schedule with")
    resources: Resources | None = Field(default=None, description="per-worker memory and CPU limits")
    gpu_types: str | list[str] | None = Field(default=None, description="run only on GPUs of this type or these "
                                                                         "types (A100, or [A100, V100])")
    gpu_type: str | list[str] | None = Field(default=None, description="the same as gpu_types")
    exclude_gpu_types: str | list[str] | None = Field(default=None, description="never run on GPUs of these types")

    @field_validator("gpu_types", "gpu_type", "exclude_gpu_types", mode="before")
    @classmethod
    def _types(cls, v: Any) -> list[str] | None:
        return None if v is None else list(gpu_type_list(v))

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: Any) -> GpuValue:
        return parse_gpu_request(v).value()

    @field_validator("script", "workdir")
    @classmethod
    def _path(cls, v: str, info: ValidationInfo) -> str:
        launchable(v, str(info.field_name), path=True)
        return v

    @field_validator("args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        for i, a in enumerate(v):
            launchable(a, f"args[{i}]")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            launchable(key, f"env key {ascii(key[:40])}")
            if not key or "=" in key:
                raise ValueError(f"env key {ascii(key[:40])}: not a variable name (empty, or with '=')")
            launchable(f"{key}={value}", f"env[{ascii(key[:40])}]")
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        launchable(v, "model")
        return v

    @field_validator("resources", mode="before")
    @classmethod
    def _auto_resources(cls, v: Any) -> Any:
        if isinstance(v, str):
            if v.strip().lower() == "auto":
                return {"auto": True}
            raise ValueError(f"{v!r} is not a resource request: write `resources: auto` to size the job "
                             "automatically, or give limits like `resources: {memory: 2Gi, cpus: 1.5}`")
        return v

    @property
    def auto(self) -> bool:
        """Sized by the control plane: ``resources: auto``, or no GPU count
        of any kind (``gpus``, ``min_gpus``, ``max_gpus``)."""
        asked = self.gpus is not None or self.min_gpus is not None or self.max_gpus is not None
        return bool(self.resources is not None and self.resources.auto) or not asked

    @model_validator(mode="after")
    def _work(self) -> "JobSubmission":
        if self.iterations is None and self.epochs is None:
            raise ValueError("give iterations or epochs")
        if self.epochs is not None and self.dataset_size is None:
            raise ValueError("epochs needs dataset_size")
        if self.min_gpus and self.max_gpus and self.min_gpus > self.max_gpus:
            raise ValueError("min_gpus > max_gpus")
        if self.gpu_type is not None:
            if self.gpu_types is not None:
                raise ValueError("give gpu_types or gpu_type (the same key), not both")
            self.gpu_types, self.gpu_type = self.gpu_type, None
        both = sorted(set(self.gpu_types or ()) & set(self.exclude_gpu_types or ()))
        if both:
            raise ValueError(f"GPU type {both[0]} is both in gpu_types and in exclude_gpu_types")
        return self._fits_exec()

    def _fits_exec(self) -> "JobSubmission":
        """Script, arguments and environment together within :func:`exec_budget`."""
        used = sum(len(a.encode()) + 9 for a in (self.script, *self.args))  # each with its NUL and pointer
        used += sum(len(k.encode()) + len(v.encode()) + 10 for k, v in self.env.items())
        if used > exec_budget():
            raise ValueError(f"script, args and env take {used} bytes at exec, over the {exec_budget()} a job may "
                             "use (a share of the host's ARG_MAX); pass large data in a file")
        return self

    def rescalable(self, gpus: GpuRequest | None = None) -> bool:
        """Whether the scheduler may run the job at another size: a range, a
        set or no count always; a plain count only with ``elastic: true`` or
        ``min_gpus``/``max_gpus`` around it (so ``gpus: 1`` gets 1 GPU)."""
        gpus = gpus or parse_gpu_request(self.gpus)
        if gpus.flexible:
            return True
        if self.elastic is not None:
            return self.elastic
        return self.min_gpus is not None or self.max_gpus is not None

    def total_iterations(self) -> int:
        if self.iterations is not None:
            return self.iterations
        assert self.epochs is not None and self.dataset_size is not None
        return max(1, round(self.epochs * self.dataset_size / self.global_batch_size))

    def to_jobspec(self, job_id: str, submit_time: float, user: str) -> JobSpec:
        gpus = parse_gpu_request(self.gpus)
        return JobSpec(
            job_id=job_id,
            submit_time=submit_time,
            model=self.model,
            batch_size=self.global_batch_size,
            iterations=self.total_iterations(),
            requested_gpus=gpus.requested,
            user=user,
            min_gpus=self.min_gpus or gpus.lo,
            max_gpus=self.max_gpus or gpus.hi,
            allowed_gpus=gpus.allowed,
            deadline=(submit_time + self.deadline) if self.deadline else None,
            priority=self.priority,
            elastic=self.rescalable(gpus),
            gpu_types=tuple(self.gpu_types) if self.gpu_types else None,
            exclude_gpu_types=tuple(self.exclude_gpu_types or ()),
        )


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first: int) -> None:
        super().__init__(key)
        self.key, self.line, self.first = key, line, first


def _unique_keys_loader() -> type:
    """A YAML ``SafeLoader`` that refuses a mapping with a key given twice
    (plain YAML keeps the last silently; JSON specs are read by it too)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if not isinstance(key, (str, int, float, bool)):
                    continue  # an unhashable key: the safe constructor names it
                if key in seen:
                    raise _DuplicateKey(key, line, seen[key])
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return Loader


def load_spec_file(path: str | Path) -> JobSubmission:
    """Read a YAML job spec; errors name the file and the field."""
    import yaml

    p = Path(path)
    try:
        data = yaml.load(p.read_text(), Loader=_unique_keys_loader())  # noqa: S506 - a SafeLoader
    except FileNotFoundError:
        raise InputError("no such file", source=str(p)) from None
    except IsADirectoryError:
        raise InputError("a directory, not a spec file", source=str(p)) from None
    except OSError as e:
        raise InputError(f"cannot read it ({e.strerror})", source=str(p)) from None
    except _DuplicateKey as e:
        raise InputError(f"the key {e.key!r} is given twice (first at line {e.first}); keep one", source=str(p),
                         line=e.line) from None
    except UnicodeDecodeError as e:
        raise InputError(f"not a text (UTF-8) file: byte {e.start} cannot be decoded", source=str(p)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise InputError(f"not valid YAML: {e}", source=str(p), line=(mark.line + 1) if mark else None) from None
    if not isinstance(data, dict):
        raise InputError("a job spec must be a mapping of fields", source=str(p))
    try:
        return JobSubmission(**data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or None
        raise InputError(str(err["msg"]).removeprefix("Value error, "), source=str(p), field=field) from None
