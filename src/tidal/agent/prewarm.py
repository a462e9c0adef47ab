"""Early initialisation (SideCar §III-C): start a worker's interpreter and its
heavy imports while its GPU still belongs to the job that is giving it up,
then wait at a gate; the agent opens the gate (creates the file) once the
server has handed the GPU over, and the training script runs in this
already-warm process. Nothing touches the GPU before the gate opens. The
warm-up and the run are :mod:`tidal.runtime.warm`'s, as in a ``tidal run``
spare.

    python -m tidal.agent.prewarm GATE_FILE -- PYTHON -u SCRIPT ARGS...
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    gate, sep, *argv = sys.argv[1:]
    if sep != "--" or len(argv) < 2:
        raise SystemExit("usage: python -m tidal.agent.prewarm GATE -- PYTHON [-u] SCRIPT ARGS...")
    cmd = argv[1:]
    if cmd and cmd[0] == "-u":
        cmd = cmd[1:]
    from tidal.runtime.warm import run_granted, warm_up

    t0 = time.time()
    warm_up(cmd[0])
    warm = time.time() - t0
    while not os.path.exists(gate):
        time.sleep(0.02)
    print(f"[tidal prewarm] warmed up in {warm:.2f}s, waited {time.time() - t0 - warm:.2f}s at the gate", flush=True)
    run_granted(cmd[0], {"argv": cmd[1:]})


if __name__ == "__main__":
    main()
