"""The one loop that hosts a job master, wherever it runs: ``tidal run``
(with local workers), ``tidal run``'s master-only mode, and the control
plane's per-job master process (:mod:`tidal.control.jobproc`).

Every ``poll_s`` it runs the master's hung-worker check; every
``status_every_s`` it hands the master's status to ``on_status``; it returns
when ``stop()`` says so, or on the timeout.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from tidal.runtime.messages import Status

if TYPE_CHECKING:  # the master imports torch: only for type checking here
    from tidal.runtime.master import JobMaster


def host_master(
    master: "JobMaster",
    *,
    stop: Callable[[], bool],
    on_status: Callable[[Status], None] | None = None,
    on_hung: Callable[[str], None] | None = None,
    status_every_s: float = 1.0,
    poll_s: float = 0.1,
    timeout_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Run until ``stop()``; False if ``timeout_s`` passed first."""
    t0 = clock()
    last_status = float("-inf")
    while True:
        for w in master.check_health():
            if on_hung is not None:
                on_hung(w)
        now = clock()
        if on_status is not None and now - last_status >= status_every_s:
            last_status = now
            on_status(master.status())
        if stop():
            return True
        if timeout_s is not None and now - t0 > timeout_s:
            return False
        sleep(poll_s)
