"""tests/outside imports its helpers by plain name, as tests/runtime does
(``outside_helpers`` here, ``runtime_helpers`` and ``changed_lines`` of
``test_examples_port`` there): both directories are put on ``sys.path``."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _d in (HERE, HERE.parent / "runtime"):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))
