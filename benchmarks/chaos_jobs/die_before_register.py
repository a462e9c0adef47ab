"""Workers that die before they register, on the job's first start only.

The first ``--first N`` processes to start (counted with marker files in
``--markers``) SIGKILL themselves before ``tidal.runtime.init()`` (as if the
node's OOM killer took them while they loaded); later ones train normally."""

import argparse
import os
import signal
from pathlib import Path

from train import fault, parse, train


def claim(markers: Path, first: int) -> bool:
    """Whether this process is one of the first ``first`` to start."""
    markers.mkdir(parents=True, exist_ok=True)
    for k in range(first):
        try:
            os.close(os.open(markers / f"start-{k}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            continue
    return False


ap = argparse.ArgumentParser()
ap.add_argument("--markers", required=True)
ap.add_argument("--first", type=int, default=2)
a = ap.parse_known_args()[0]
if claim(Path(a.markers), a.first):
    fault("SIGKILLs itself before init")
    os.kill(os.getpid(), signal.SIGKILL)
train(parse())  # parse() leaves --markers and --first alone
