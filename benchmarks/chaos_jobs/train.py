"""A well-behaved elastic training job, written the way users write one
(docs/runtime.md): ``tidal.runtime.init()`` with periodic checkpoints (the
control plane gives the directory in ``$TIDAL_CHECKPOINT_DIR``), the model
and optimizer registered, the data through ``job.data``.

With ``--record DIR`` each worker appends, per committed step, its sample
indices to ``DIR/<worker>.txt`` (``epoch step idx ...``) and the step's
global slice to ``DIR/<worker>.ranges`` (``epoch step lo hi``), so the chaos
benchmark can count lost and duplicated samples. The other scripts of this
folder reuse :func:`train` with one misbehaviour each.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

import tidal.runtime

#: called before each step with the job and the number of steps this process ran
Hook = Callable[["tidal.runtime.Job", int], None]


class Numbered(torch.utils.data.Dataset):
    """Synthetic regression samples that carry their own index."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.mean(dim=1, keepdim=True).cos()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--sample-time", type=float, default=0.002, help="pretend GPU seconds per sample")
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--record", default=None)
    return ap.parse_known_args(argv)[0]


def train(a: argparse.Namespace, before_step: Hook | None = None) -> None:
    """Train to the end of the data; ``before_step`` may misbehave."""
    job = tidal.runtime.init(checkpoint_every=a.checkpoint_every)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    job.register_state(model, opt)
    rec = ranges = None
    if a.record:
        Path(a.record).mkdir(parents=True, exist_ok=True)
        rec = open(Path(a.record) / f"{job.worker_id}.txt", "a")
        ranges = open(Path(a.record) / f"{job.worker_id}.ranges", "a")
    loader = job.data(Numbered(a.samples), batch_size=a.batch_size, epochs=a.epochs, seed=1)
    ran = 0
    for idx, x, y in loader:
        if before_step is not None:
            before_step(job, ran)
        epoch, step, lo = loader.epoch, job.step_count, job.cursor
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if job.step() and rec is not None and ranges is not None:  # False: dropped, redone by the survivors
            rec.write(f"{epoch} {step} " + " ".join(str(int(i)) for i in idx) + "\n")
            hi = min(lo + job.global_batch_size, (epoch + 1) * a.samples)
            ranges.write(f"{epoch} {step} {lo} {hi}\n")
            rec.flush()
            ranges.flush()
        ran += 1
        time.sleep(a.sample_time * len(idx))
        if job.rank == 0 and job.step_count % 50 == 0:
            print(f"step {job.step_count} workers {job.world_size} loss {loss.item():.4f}", flush=True)
    job.close()


def fault(what: str) -> None:
    """Say in the job's log when a misbehaviour starts (the benchmark's clock)."""
    print(f"chaos-fault {time.time():.3f} pid {os.getpid()}: {what}", flush=True)


if __name__ == "__main__":
    train(parse())
