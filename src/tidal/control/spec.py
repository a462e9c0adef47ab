"""Job specs for the live cluster: YAML file or CLI flags, validated with
pydantic so that an error names the field.

GPU request forms (SideCar's "optional numbers of GPUs", ElasticFlow's
serverless jobs):
  gpus: 4            a count (rigid unless ``elastic: true``, then preferred)
  gpus: "2-8"        an elastic range
  gpus: [1, 2, 4]    an allowed set
  (none) + deadline  serverless: the scheduler picks the count
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tidal.core.errors import InputError
from tidal.core.job import JobSpec


class JobSubmission(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")
    script: str = Field(..., min_length=1, description="training script (path on the agents' machines)")
    args: list[str] = Field(default_factory=list)
    workdir: str = ""
    env: dict[str, str] = Field(default_factory=dict)
    gpus: int | str | list[int] | None = None
    min_gpus: int | None = Field(default=None, ge=1)
    max_gpus: int | None = Field(default=None, ge=1)
    elastic: bool = True
    global_batch_size: int = Field(default=32, ge=1)
    iterations: int | None = Field(default=None, ge=1)
    epochs: float | None = Field(default=None, gt=0)
    dataset_size: int | None = Field(default=None, ge=1)
    deadline: float | None = Field(default=None, gt=0, description="seconds after submission")
    priority: int = 0
    model: str = Field(default="generic", description="throughput profile to schedule with")

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: Any) -> Any:
        if v is None:
            return v
        if isinstance(v, int):
            if v < 1:
                raise ValueError("must be >= 1")
            return v
        if isinstance(v, str):
            parts = v.split("-")
            if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
                raise ValueError("a range must look like '2-8'")
            lo, hi = (int(p) for p in parts)
            if not 1 <= lo <= hi:
                raise ValueError("range needs 1 <= low <= high")
            return v
        if not v or any((not isinstance(x, int)) or x < 1 for x in v):
            raise ValueError("an allowed set must be a non-empty list of counts >= 1")
        return sorted(set(v))

    @model_validator(mode="after")
    def _work(self) -> "JobSubmission":
        if self.iterations is None and self.epochs is None:
            raise ValueError("give iterations or epochs")
        if self.epochs is not None and self.dataset_size is None:
            raise ValueError("epochs needs dataset_size")
        if self.gpus is None and self.deadline is None and self.min_gpus is None:
            raise ValueError("give gpus, or a deadline for a serverless job")
        if self.min_gpus and self.max_gpus and self.min_gpus > self.max_gpus:
            raise ValueError("min_gpus > max_gpus")
        return self

    def total_iterations(self) -> int:
        if self.iterations is not None:
            return self.iterations
        assert self.epochs is not None and self.dataset_size is not None
        return max(1, round(self.epochs * self.dataset_size / self.global_batch_size))

    def to_jobspec(self, job_id: str, submit_time: float, user: str) -> JobSpec:
        lo, hi, allowed, req = self.min_gpus, self.max_gpus, None, 0
        if isinstance(self.gpus, int):
            req = self.gpus
        elif isinstance(self.gpus, str):
            a, b = (int(p) for p in self.gpus.split("-"))
            lo, hi, req = lo or a, hi or b, b
        elif isinstance(self.gpus, list):
            allowed, req = tuple(self.gpus), max(self.gpus)
        elastic = self.elastic or self.gpus is None or allowed is not None or isinstance(self.gpus, str)
        return JobSpec(
            job_id=job_id,
            submit_time=submit_time,
            model=self.model,
            batch_size=self.global_batch_size,
            iterations=self.total_iterations(),
            requested_gpus=req,
            user=user,
            min_gpus=lo,
            max_gpus=hi,
            allowed_gpus=allowed,
            deadline=(submit_time + self.deadline) if self.deadline else None,
            priority=self.priority,
            elastic=elastic,
        )


def load_spec_file(path: str | Path) -> JobSubmission:
    """Read a YAML job spec; errors name the file and the field."""
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise InputError("no such file", source=str(p)) from None
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
        raise InputError(err["msg"], source=str(p), field=field) from None
