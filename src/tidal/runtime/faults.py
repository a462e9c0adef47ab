"""Fault injection for tests and users.

Faults are described by a small spec string, usually given to every worker
through ``$TIDAL_FAULTS`` (``tidal run`` passes its environment on)::

    TIDAL_FAULTS="kill:w1@7"            # worker w1 kills itself with SIGKILL at the start of step 7
    TIDAL_FAULTS="kill:#2@7"            # whoever is rank 2 at step 7 (``#`` = rank)
    TIDAL_FAULTS="stop:w0@5=1.5"        # SIGSTOP w0 at step 5, SIGCONT after 1.5 s
    TIDAL_FAULTS="slow:w2@0=50"         # from step 0 on, w2's compute is 50 % slower
    TIDAL_FAULTS="kill:w1@7;slow:w0@3=20"   # several faults, ";"-separated

A fault fires at most once per process (``slow`` then stays on). The
worker-side faults model what EDL §4.2 treats as a forced exit (a lost worker,
``kill``), a temporarily unresponsive one (``stop``) and a straggler (EDL §5.2,
DLRover §5.4: ``slow``). Dropping the master (Elan §V-D) is done from outside
the job: :func:`kill_process` SIGKILLs a master-hosting process (tests use it
with :func:`wait_for_step`). Every fault that fires is appended as a JSON line
to ``$TIDAL_FAULT_LOG`` (if set) with its wall time, which the recovery
benchmark uses to measure detection time.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

from tidal import settings

log = logging.getLogger(__name__)

KINDS = ("kill", "stop", "slow")


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` at the start of global step ``step`` on ``target``
    (a worker id, ``#r`` for rank ``r``, or ``*`` for every worker).
    ``arg``: seconds stopped (``stop``) or percent slower (``slow``)."""

    kind: str
    target: str
    step: int
    arg: float = 0.0

    def matches(self, worker_id: str, rank: int) -> bool:
        if self.target == "*":
            return True
        if self.target.startswith("#"):
            return rank == int(self.target[1:])
        return self.target == worker_id

    def to_spec(self) -> str:
        return f"{self.kind}:{self.target}@{self.step}" + (f"={self.arg:g}" if self.arg else "")


def parse_faults(spec: str | None) -> tuple[Fault, ...]:
    """Parse ``kind:target@step[=arg];...`` (see the module docstring)."""
    out: list[Fault] = []
    for part in (spec or "").split(";"):
        part = part.strip()
        if not part:
            continue
        try:
            kind, rest = part.split(":", 1)
            target, rest = rest.split("@", 1)
            step_s, _, arg_s = rest.partition("=")
            f = Fault(kind.strip(), target.strip(), int(step_s), float(arg_s) if arg_s else 0.0)
        except ValueError as e:
            raise ValueError(f"bad fault spec {part!r}: expected kind:target@step[=arg]") from e
        if f.kind not in KINDS:
            raise ValueError(f"unknown fault kind {f.kind!r}; known: {KINDS}")
        out.append(f)
    return tuple(out)


def random_kill(seed: int, workers: int, steps: int, first_step: int = 1) -> Fault:
    """A seeded ``kill -9`` of a random worker (``w0``..``w{workers-1}``) at a
    random step in ``[first_step, steps)``."""
    rng = random.Random(seed)
    return Fault("kill", f"w{rng.randrange(workers)}", rng.randrange(first_step, steps))


def record(event: dict[str, object]) -> None:
    """Append ``event`` (with its wall time) to ``$TIDAL_FAULT_LOG``."""
    path = settings.FAULT_LOG.get()
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps(dict(event, wall=time.time(), pid=os.getpid())) + "\n")
        f.flush()
        os.fsync(f.fileno())


class FaultInjector:
    """Worker-side injector; :class:`~tidal.runtime.worker.Job` calls
    :meth:`before_step` when a batch starts and :meth:`slowdown` before the
    gradient all-reduce (so a ``slow`` fault stretches compute time only)."""

    def __init__(self, faults: tuple[Fault, ...] = (), kill: Callable[[], None] | None = None) -> None:
        self.faults = faults
        self.fired: set[Fault] = set()
        self.slow_pct = 0.0
        self._kill = kill or (lambda: os.kill(os.getpid(), signal.SIGKILL))

    @classmethod
    def from_env(cls) -> "FaultInjector":
        return cls(parse_faults(settings.FAULTS.get()))

    def __bool__(self) -> bool:
        return bool(self.faults)

    def before_step(self, worker_id: str, rank: int, step: int) -> None:
        for f in self.faults:
            if f in self.fired or step < f.step or not f.matches(worker_id, rank):
                continue
            if f.kind != "slow" and step != f.step:
                continue  # a kill/stop step that this process did not run (e.g. it joined later)
            self.fired.add(f)
            record({"fault": f.to_spec(), "worker": worker_id, "rank": rank, "step": step})
            log.warning("fault injection: %s on %s (rank %d) at step %d", f.kind, worker_id, rank, step)
            if f.kind == "kill":
                self._kill()
            elif f.kind == "stop":
                _stop_self(f.arg)
            else:
                self.slow_pct = f.arg

    def slowdown(self, compute_s: float) -> None:
        """Sleep ``slow_pct`` % of this step's compute time."""
        if self.slow_pct > 0 and compute_s > 0:
            time.sleep(compute_s * self.slow_pct / 100.0)


def _stop_self(seconds: float) -> None:
    """SIGSTOP this process; a detached helper sends SIGCONT after ``seconds``."""
    pid = os.getpid()
    # the helper gives up early if the stopped process is killed meanwhile (e.g. found hung);
    # it must not hold the worker's stdout, or whoever reads that would wait for it
    code = (f"import os,signal,time\nend=time.monotonic()+{float(seconds)!r}\n"
            f"while time.monotonic()<end:\n"
            f"    time.sleep(0.2)\n"
            f"    try: os.kill({pid},0)\n"
            f"    except OSError: raise SystemExit\n"
            f"os.kill({pid},signal.SIGCONT)\n")
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.05)  # let the helper start before we stop
    os.kill(pid, signal.SIGSTOP)


def kill_process(pid: int) -> None:
    """``kill -9`` a process, e.g. the one hosting the job master."""
    record({"fault": "kill-process", "target_pid": pid})
    os.kill(pid, signal.SIGKILL)


def wait_for_step(status: Callable[[], object], step: int, timeout_s: float = 60.0) -> None:
    """Poll ``status()`` (a :class:`~tidal.runtime.messages.Status`) until
    the job reached ``step``."""
    deadline = time.monotonic() + timeout_s
    while getattr(status(), "step", 0) < step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job did not reach step {step} in {timeout_s}s")
        time.sleep(0.02)
