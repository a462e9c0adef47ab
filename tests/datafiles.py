"""Where the tests find the public data: ``../shared/data``, or the copy
the package ships of a file the shared data lacks."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
SHIPPED = REPO / "src" / "tidal" / "data"


def data_file(rel: str) -> Path:
    """``../shared/data/REL``, or the package's copy when the shared data
    lacks it (its ITP traces hold six of the ten clusters; the package ships
    cluster10 and 195job)."""
    p = SHARED / rel
    return p if p.exists() or not (SHIPPED / rel).exists() else SHIPPED / rel
