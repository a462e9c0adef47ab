"""The scheduling core's compiled kernels, or None where they are not built.

``setup.py`` builds ``tidal.scheduler._fastbits`` (C, optional) when the
package is installed on a machine with a C compiler. Each kernel computes
exactly what a passage of :mod:`tidal.scheduler.nodebits`,
:mod:`tidal.scheduler.buddy`, :mod:`tidal.scheduler.greedy`,
:mod:`tidal.scheduler.elan_event`, the ElasticFlow and Tidal policies, or the simulator's running rows and views
(:mod:`tidal.sim.runset`, :mod:`tidal.sim.views`) computes, and hands back ``NotImplemented``
for a case it does not cover; that passage then runs, as it does when
``fast`` is None. A build of other kernels than this code calls (the source
changed since ``pip install -e .``) is not used: a warning says to
reinstall.
"""

from __future__ import annotations

import logging
from types import ModuleType

API = 9  # the _fastbits.c this code calls (its API constant)

fast: ModuleType | None
try:
    from tidal.scheduler import _fastbits as fast
except ImportError:  # pragma: no cover - installed without a C compiler: Python alone
    fast = None

if fast is not None and getattr(fast, "API", None) != API:
    logging.getLogger(__name__).warning(
        "the compiled scheduling kernels (%s) are from another version of the source: not used, the "
        "simulator runs slower; rebuild them with `pip install -e .`", getattr(fast, "__file__", "?"))
    fast = None
