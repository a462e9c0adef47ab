"""Warm worker processes (early initialisation, SideCar §III-C, for every
scale-out): a process that has already paid for the interpreter and the heavy
imports waits, idle, until it is granted a worker; then the training script
runs in it as if ``python -u SCRIPT ARGS`` had started it.

The grant is one JSON line on the process's stdin: ``{"env": {...}, "argv":
[...]}`` (the variables to set, e.g. the worker id and ``LOCAL_RANK``, and the
script's arguments). End of file instead of a grant (its launcher is gone or
no longer needs it) ends the process quietly. Nothing touches a GPU before
the grant: importing torch does not initialise CUDA.

What is imported ahead: torch, torch.distributed, the data loader, the
runtime, and every module the script imports at its top level that is *not*
its own (found beside it): those run their import-time code as the script's
first lines would, only earlier; the script's own modules are left to the
script, since they may read the worker's environment when imported.

    python -u -m tidal.runtime.warm [--ready-fd FD] SCRIPT   (then one grant line on stdin)
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import logging
import os
import runpy
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

# what every worker imports: the expensive part of a start (~1-3 s of CPU)
HEAVY = ("torch", "torch.nn", "torch.distributed", "torch.utils.data", "torch.nn.parallel", "tidal.runtime",
         "tidal.runtime.worker", "tidal.runtime.loader", "tidal.runtime.reducer", "tidal.runtime.transfer",
         "tidal.runtime.checksum")


def script_imports(script: str) -> list[str]:
    """The absolute top-level imports of ``script`` (module names, in order),
    without the script's own modules (those found in its directory)."""
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8", errors="replace"), script)
    except (OSError, SyntaxError, ValueError):
        return []  # the script reports its own error when it runs
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    here = Path(script).resolve().parent
    return [n for n in dict.fromkeys(names) if n != "__future__" and not _own(n, here)]


def _own(name: str, here: Path) -> bool:
    """Whether module ``name`` is the script's own: not importable without the
    script's directory on the path, or found inside it."""
    top = name.split(".")[0]
    saved = sys.path[:]
    try:
        sys.path[:] = [p for p in sys.path if p not in ("", ".", str(here)) and Path(p or ".").resolve() != here]
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return True
    finally:
        sys.path[:] = saved
    origin = spec.origin if spec is not None else None
    return spec is None or (origin is not None and here in Path(origin).resolve().parents)


def warm_up(script: str) -> list[str]:
    """Import what a worker of ``script`` imports, and take one tiny training
    step on the CPU (the first optimizer built imports torch's compiler stack,
    ~1.5 s of CPU); returns what could not be imported (the script meets the
    same error itself, with its own traceback)."""
    failed = []
    for name in (*HEAVY, *script_imports(script)):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - anything: the script's own import reports it
            failed.append(name)
    try:
        _first_step()
    except Exception as e:  # noqa: BLE001 - only a warm-up: the script does the real work
        log.debug("warm-up step failed: %s", e)
    return failed


def _first_step() -> None:
    """Forward, backward and an update of a tiny CPU model with the common
    optimizers: the lazy imports and first-call set-up a script's first step
    would pay. Touches no GPU and leaves no state behind (seeds untouched)."""
    import torch

    w = torch.zeros(4, 4, requires_grad=True)
    for opt in (torch.optim.SGD([w], lr=0.1, momentum=0.9), torch.optim.Adam([w]), torch.optim.AdamW([w])):
        torch.nn.functional.cross_entropy(torch.ones(2, 4) @ w, torch.zeros(2, dtype=torch.long)).backward()
        opt.step()
        opt.zero_grad()


def run_granted(script: str, grant: dict) -> None:
    """Become the worker ``grant`` describes and run the script as
    ``__main__`` (its directory first on the path, as ``python SCRIPT`` does).
    An uncaught exception is reported through ``sys.excepthook`` with the
    script's frames only, and the process exits 1, as Python's would."""
    os.environ.update({str(k): str(v) for k, v in grant.get("env", {}).items()})
    devnull = os.open(os.devnull, os.O_RDONLY)  # the grant pipe is done with: the script's stdin is empty
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 lives as long as the process
    path = os.path.abspath(script)
    sys.argv = [script, *[str(a) for a in grant.get("argv", [])]]
    sys.path[0] = os.path.dirname(path)
    try:
        runpy.run_path(script, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - reported as an uncaught exception of the script
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next  # drop this module's and runpy's frames
        tb = tb or e.__traceback__
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)


class SparePool:
    """Up to ``size`` warm processes of one script for one launcher, started
    by ``start(argv, pass_fds)`` (which wires up their output). :meth:`take`
    hands one out (granted at once), :meth:`fill` starts the missing ones
    (call it when the job is steady: a warm-up takes a core for a second or
    two), :meth:`warm` counts those done warming, :meth:`close` ends them all."""

    def __init__(self, script: str, size: int,
                 start: Callable[[list[str], tuple[int, ...]], subprocess.Popen[bytes]]) -> None:
        self.script, self.size, self._start = script, max(0, size), start
        self._idle: list[tuple[subprocess.Popen[bytes], int]] = []  # (process, read end of its ready pipe)
        self._warm: set[int] = set()  # pids done warming
        self._lock = threading.Lock()

    def fill(self) -> int:
        """Start spares until ``size`` wait; returns how many were started."""
        with self._lock:
            gone = [(p, fd) for p, fd in self._idle if p.poll() is not None]
            self._idle = [x for x in self._idle if x not in gone]
            missing = self.size - len(self._idle)
        for _, fd in gone:
            _close(fd)
        started = []
        for _ in range(missing):
            r, w = os.pipe()
            try:
                started.append((self._start([sys.executable, "-u", "-m", "tidal.runtime.warm", "--ready-fd", str(w),
                                             self.script], (w,)), r))
            except OSError as e:  # no spare: newcomers start cold, as without a pool
                log.warning("could not start a warm spare: %s", e)
                _close(r)
                break
            finally:
                os.close(w)
        with self._lock:
            self._idle += started
        return len(started)

    def warm(self) -> int:
        """How many waiting spares are done warming up."""
        with self._lock:
            idle = list(self._idle)
        for p, fd in idle:
            if p.pid not in self._warm and fd >= 0 and select.select([fd], [], [], 0)[0]:
                self._warm.add(p.pid)
        return sum(1 for p, _ in idle if p.pid in self._warm and p.poll() is None)

    def take(self, env: dict[str, str], argv: list[str]) -> subprocess.Popen[bytes] | None:
        """A waiting spare, now granted ``env`` and ``argv``; None if none is left."""
        line = (json.dumps({"env": env, "argv": argv}) + "\n").encode()
        while True:
            with self._lock:
                if not self._idle:
                    return None
                p, fd = self._idle.pop(0)
            _close(fd)
            try:
                assert p.stdin is not None
                p.stdin.write(line)
                p.stdin.close()
                p.stdin = None  # the process's stdin is its own now (/dev/null)
                return p
            except (OSError, ValueError):  # it died while waiting: try the next one
                p.kill()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for p, fd in idle:
            _close(fd)
            p.kill()
            p.wait()
            if p.stdin is not None:
                p.stdin.close()


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    ready = -1
    if args[:1] == ["--ready-fd"] and len(args) > 1:
        ready, args = int(args[1]), args[2:]
    if len(args) != 1:
        raise SystemExit("usage: python -u -m tidal.runtime.warm [--ready-fd FD] SCRIPT  (then one grant line on stdin)")
    script = args[0]
    sys.modules.setdefault("tidal.runtime.warm", sys.modules[__name__])  # one module, however it was started
    warm_up(script)
    if ready >= 0:
        try:
            os.write(ready, b"1")  # the launcher can tell the user a scale-out starts warm now
        except OSError:
            pass  # granted before it was warm: the launcher closed its end
        os.close(ready)
    line = sys.stdin.readline()
    if not line.strip():
        return  # not needed after all
    run_granted(script, json.loads(line))


if __name__ == "__main__":
    main()
