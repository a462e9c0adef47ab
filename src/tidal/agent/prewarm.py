"""Early initialisation (SideCar §III-C): start a worker's interpreter and its
heavy imports while its GPU still belongs to the job that is giving it up,
then wait at a gate; the agent opens the gate (creates the file) once the
server has handed the GPU over, and the training script runs in this
already-warm process. Nothing touches the GPU before the gate opens.

    python -m tidal.agent.prewarm GATE_FILE -- PYTHON -u SCRIPT ARGS...
"""

from __future__ import annotations

import os
import runpy
import sys
import time


def main() -> None:
    gate, sep, *argv = sys.argv[1:]
    if sep != "--" or len(argv) < 2:
        raise SystemExit("usage: python -m tidal.agent.prewarm GATE -- PYTHON [-u] SCRIPT ARGS...")
    cmd = argv[1:]
    if cmd and cmd[0] == "-u":
        cmd = cmd[1:]
    t0 = time.time()
    import torch  # noqa: F401  (the expensive part of a start: ~1-2 s)

    import tidal.runtime  # noqa: F401

    warm = time.time() - t0
    while not os.path.exists(gate):
        time.sleep(0.02)
    print(f"[tidal prewarm] warmed up in {warm:.2f}s, waited {time.time() - t0 - warm:.2f}s at the gate", flush=True)
    sys.argv = cmd
    sys.path.insert(0, os.path.dirname(os.path.abspath(cmd[0])))
    runpy.run_path(cmd[0], run_name="__main__")


if __name__ == "__main__":
    main()
