"""A worker's environment carries the job's termination condition: a spec's
``iterations`` becomes ``TIDAL_MAX_STEPS`` (training ends at that step on
every rank); with ``epochs`` the script's own ``job.epochs(N)`` ends it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tidal import settings
from tidal.control.spawner import worker_env


def _job(**submission: Any) -> Any:
    return SimpleNamespace(id="j1", master_url="http://m:1", tags={}, spec={"submission": submission})


def test_iterations_become_the_workers_step_limit(tmp_path: Path) -> None:
    env = worker_env(_job(name="a", script="t.py", iterations=100000), "w3", tmp_path)
    assert env[settings.MAX_STEPS.name] == "100000" and env[settings.WORKER_ID.name] == "w3"


def test_an_epochs_spec_sets_no_step_limit(tmp_path: Path) -> None:
    env = worker_env(_job(name="a", script="t.py", iterations=None, epochs=2, dataset_size=4096), "w0", tmp_path)
    assert settings.MAX_STEPS.name not in env
