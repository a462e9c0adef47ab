"""Test records of the outside scripts' Tidal ports (not collected by pytest).

A port calls :func:`attach` in one line, and only when ``$OUTSIDE_RECORD``
names a directory (the tests set it; a user's run never imports this). The
loader it returns is the script's own, plus: every batch appends one JSON
line to ``steps-<worker>.jsonl`` in the format of the runtime tests
(``step``, ``epoch``, ``idx``, ``world``, ``rank``; see
``tests/runtime/runtime_helpers.check_exactly_once``) with the generation,
the batch index and the pid; at exit ``final-<worker>.json`` holds a digest
of the parameters of the given modules (together and each; the buffers apart). While a
file ``hold`` exists in the directory every batch first sleeps the seconds
it holds, so a test can rescale or kill a worker before the job ends.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import time
from typing import Any, Iterator

import torch

VAR = "OUTSIDE_RECORD"


def digest(tensors: Any) -> str:
    """sha256 over the tensors' bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Recorded:
    """The script's elastic loader, recording what each batch held."""

    def __init__(self, job: Any, loader: Any, modules: tuple[torch.nn.Module, ...], out: str) -> None:
        self._job, self._loader, self._modules, self._out = job, loader, modules, out
        self._log = open(os.path.join(out, f"steps-{job.worker_id}.jsonl"), "a", buffering=1)
        atexit.register(self._final)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        hold = os.path.join(self._out, "hold")
        for batch in self._loader:
            j, ld = self._job, self._loader
            self._log.write(json.dumps({
                "step": j.step_count, "epoch": ld.epoch, "idx": ld.last_indices, "world": j.world_size,
                "rank": j.rank, "gen": j.gen.gen if j.gen is not None else 0, "bi": ld.batch_index,
                "pid": os.getpid(), "t": time.time()}) + "\n")
            try:
                with open(hold) as f:
                    time.sleep(float(f.read() or 0))
            except (OSError, ValueError):  # no hold (any more), or caught mid-write
                pass
            yield batch

    def _final(self) -> None:
        j = self._job
        params = [p for m in self._modules for p in m.parameters()]
        buffers = [b for m in self._modules for b in m.buffers()]
        rec = {"worker": j.worker_id, "left": bool(j.left), "finished": bool(j.finished), "rank": j.rank,
               "world": j.world_size, "steps": j.step_count, "params": digest(params), "buffers": digest(buffers),
               "modules": [digest(m.parameters()) for m in self._modules]}
        path = os.path.join(self._out, f"final-{j.worker_id}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(rec, f)
        os.replace(path + ".tmp", path)


def attach(job: Any, loader: Any, *modules: torch.nn.Module) -> Recorded:
    """``loader`` recorded into ``$OUTSIDE_RECORD`` (see the module docstring)."""
    return Recorded(job, loader, modules, os.environ[VAR])
