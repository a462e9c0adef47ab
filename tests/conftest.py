"""Shared fixtures: a toy throughput profile whose numbers can be worked by hand."""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tidal.core.profile import load_profiles

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"

# The tests press Ctrl-C as a terminal does (SIGINT to a process group). A test run started in the
# background of a non-interactive shell (`cmd &` in a script) inherits SIGINT ignored, and every process it
# starts would too (an ignored signal stays ignored across exec): such a run gets the terminal's default back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def toy_profiles(tmp_path_factory):
    """Model ``lin`` runs n iterations/s on n GPUs (perfect scaling up to 8);
    model ``sat`` saturates: 1, 1.5, 2, 2 iterations/s on 1, 2, 4, 8 GPUs."""
    d = tmp_path_factory.mktemp("profiles")
    (d / "lin.csv").write_text("global_batch_size,1,2,4,8\n32,1,2,4,8\n")
    (d / "sat.csv").write_text("global_batch_size,1,2,4,8\n32,1,1.5,2,2\n")
    return load_profiles(d)


@pytest.fixture(scope="session")
def shared() -> Path:
    """``../shared/data`` (traces, clusters); the test is skipped without it."""
    if not SHARED.exists():
        pytest.skip(f"shared data not found at {SHARED}")
    return SHARED


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A temporary directory other uids can enter (pytest's own are 0700):
    for the tests that start processes as other users."""
    d = Path(tempfile.mkdtemp(prefix="tidal-open-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
