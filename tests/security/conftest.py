"""A temporary directory other uids can enter (pytest's own are 0700)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tidal-sec-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
