"""The scheduling core's compiled kernels, or None where they are not built.

``setup.py`` builds ``tidal.scheduler._fastbits`` (C, optional) when the
package is installed on a machine with a C compiler. Each kernel computes
exactly what a numpy passage of :mod:`tidal.scheduler.nodebits` or
:mod:`tidal.scheduler.greedy` computes, on the same arrays, without numpy's
per-call overhead, and hands back ``NotImplemented`` for a case it does not
cover; the numpy code then runs, as it does when ``fast`` is None.
"""

from __future__ import annotations

from types import ModuleType

fast: ModuleType | None
try:
    from tidal.scheduler import _fastbits as fast
except ImportError:  # pragma: no cover - installed without a C compiler: numpy alone
    fast = None
