"""``tidal run --join HOST:PORT``: add this host's workers to a running job
(torchrun's multi-node launch, but elastic: the job does not stop).

The launcher asks the job's master for a scale-out by worker ids it chose
(``<host>-<pid>-<i>``, unique across hosts), starts those workers here with
the master's URL, and waits. Ctrl-C or SIGTERM is a graceful scale-in of
exactly these workers (they leave at the agreed switch step; nothing is
lost); a second one kills them, which the job recovers from like any lost
worker. The launcher's exit code is 0 when every worker it started exited 0.
With ``--replace-host H`` the new workers replace H's in one switch instead
(a migration between hosts: they warm up while the job trains).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import Callable, Sequence

from tidal.runtime.client import MasterUnavailable, MasterClient, retry_while_busy
from tidal.runtime.messages import ScaleAnswer
from tidal.runtime.spawner import LocalSpawner, WorkerLaunch

log = logging.getLogger(__name__)


def master_url(join: str) -> str:
    """``HOST:PORT`` or a URL, as a URL; a clear error otherwise."""
    url = join if join.startswith(("http://", "https://")) else f"http://{join}"
    rest = url.split("://", 1)[1].rstrip("/")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--join {join!r}: expected HOST:PORT of the job's master (as `tidal run` prints it)")
    if not 0 < int(port) < 65536:
        raise ValueError(f"--join {join!r}: port {port} is not a TCP port (1-65535)")
    return url.rstrip("/")


def worker_ids(count: int, host: str | None = None, pid: int | None = None) -> list[str]:
    """Ids no other launcher picks: host name, launcher pid, index."""
    tag = (host or socket.gethostname()).split(".")[0].replace("-", "")[:16] or "host"
    return [f"{tag}-{pid or os.getpid()}-{i}" for i in range(count)]


def _leave(c: MasterClient, sp: LocalSpawner, out: Callable[[str], None], timeout_s: float) -> None:
    """Scale in this launcher's live workers and wait for them to exit."""
    live = [w for w, code in sp.exit_codes().items() if code is None]
    if not live:
        return
    out(f"tidal run: leaving: scale-in of {', '.join(live)}")
    try:
        ans = retry_while_busy(lambda: c.scale_in(workers=live), timeout_s)
        out(f"tidal run: {ans.status}: {ans.message}")
    except Exception as e:  # noqa: BLE001 - the master may be gone; then the workers are killed
        out(f"tidal run: scale-in failed ({e}); stopping the workers")
    deadline = time.monotonic() + timeout_s
    while any(code is None for code in sp.exit_codes().values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    sp.terminate(grace_s=5.0)


def _ask(c: MasterClient, ids: list[str], replace_host: str | None, timeout_s: float) -> ScaleAnswer:
    """A scale-out by ``ids``, or with ``replace_host`` a migration of that
    host's workers to them: one switch (EDL §5.2)."""
    if replace_host is None:
        return retry_while_busy(lambda: c.scale_out(workers=ids), timeout_s)
    st = c.status()
    ranks = [r for r, w in enumerate(st.members) if st.hosts.get(w) == replace_host]
    if len(ranks) != len(ids):
        return ScaleAnswer("error", f"host {replace_host!r} has {len(ranks)} worker(s) of the job, "
                                    f"so --workers must be {len(ranks)} to replace them, not {len(ids)}")
    return retry_while_busy(lambda: c.migrate(ranks, workers=ids), timeout_s)


def join_job(join: str, script: str, args: Sequence[str] = (), size: int = 1, *,
             timeout_s: float = 120.0, out: Callable[[str], None] = print, replace_host: str | None = None) -> int:
    """Start ``size`` workers of ``script`` here, in the job whose master
    answers at ``join``; with ``replace_host`` they replace that host's
    workers in one switch. Returns the exit code (see the module docstring)."""
    try:
        url = master_url(join)
    except ValueError as e:
        out(f"tidal run: {e}")
        return 2
    if size < 1:
        out(f"tidal run: --workers must be at least 1 to join, not {size}")
        return 2
    if not os.path.isfile(script):
        out(f"tidal run: no such script: {script} (relative to {os.getcwd()})")
        return 2
    c = MasterClient(url, patience_s=min(30.0, timeout_s))
    ids = worker_ids(size)
    try:
        ans = _ask(c, ids, replace_host, timeout_s)
    except (MasterUnavailable, OSError) as e:
        out(f"tidal run: no job master answers at {url} ({e}); give the HOST:PORT `tidal run` printed on the "
            "job's first host")
        return 1
    if ans.status != "accepted":
        out(f"tidal run: the master at {url} refused: {ans.status}: {ans.message}")
        return 1
    sp = LocalSpawner(script, args, master_url=url)
    try:
        sp.spawn([WorkerLaunch(w) for w in ids])
    except (ValueError, OSError) as e:  # e.g. no free GPU here; the master drops the change after its join timeout
        out(f"tidal run: cannot start the workers here: {e}")
        return 1
    out(f"tidal run: joined job at {url} with {', '.join(ids)}")
    # Ctrl-C and kill both mean "leave": installed here, since a launcher started in the
    # background of a shell inherits SIGINT ignored and would never see Ctrl-C otherwise
    prev = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while any(code is None for code in sp.exit_codes().values()):
            time.sleep(0.2)
    except KeyboardInterrupt:
        try:
            _leave(c, sp, out, timeout_s)
        except KeyboardInterrupt:
            sp.terminate(grace_s=0.0)
    finally:
        for sig, handler in prev.items():
            signal.signal(sig, handler)
    codes = sp.exit_codes()
    out("tidal run: workers exited: " + ", ".join(f"{w}: {code}" for w, code in sorted(codes.items())))
    return 0 if all(code == 0 for code in codes.values()) else 1


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
