"""A small elastic training job shipped with the package, used by ``tidal demo``
and the end-to-end tests (the user-facing examples are in ``examples/``).

With ``--record DIR`` every worker appends, per step it committed, the
dataset indices it trained on to ``DIR/<worker>.txt`` (``epoch step idx
idx ...``) and the step's global sample positions to ``DIR/<worker>.ranges``
(``epoch step lo hi``), so a test can check that every sample was used
exactly once per epoch, also when a worker cut off mid-step never wrote its
own line.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

import tidal.runtime
from tidal import settings


class Indexed(torch.utils.data.Dataset):
    """Synthetic regression data that also returns each sample's index."""

    def __init__(self, n: int, dim: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--sample-time", type=float, default=0.002,
                    help="seconds of pretend GPU work per sample: a step takes local batch x this, so more workers "
                         "make steps shorter, as on GPUs")
    ap.add_argument("--record", default=None)
    a = ap.parse_args()
    job = tidal.runtime.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    job.register_state(model, opt)
    rec = ranges = None
    if a.record:
        Path(a.record).mkdir(parents=True, exist_ok=True)
        rec = open(Path(a.record) / f"{settings.WORKER_ID.get() or 'w'}.txt", "a")
        ranges = open(Path(a.record) / f"{settings.WORKER_ID.get() or 'w'}.ranges", "a")
    loader = job.data(Indexed(a.samples), batch_size=a.batch_size, epochs=a.epochs, seed=1)
    for idx, x, y in loader:
        epoch, step, lo = loader.epoch, job.step_count, job.cursor  # the step's global slice starts at the cursor
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        applied = job.step()  # False: a peer died, the step was dropped and is redone by the survivors
        if rec is not None and ranges is not None and applied:
            rec.write(f"{epoch} {step} " + " ".join(str(int(i)) for i in idx) + "\n")
            rec.flush()
            # the whole step's slice of the data, as every member saw it committed (a peer cut off
            # mid-step cannot write its own line, but the others still record its samples' positions)
            hi = min(lo + job.global_batch_size, (epoch + 1) * a.samples)
            ranges.write(f"{epoch} {step} {lo} {hi}\n")
            ranges.flush()
        if a.sample_time:
            time.sleep(a.sample_time * len(idx))
        if job.rank == 0 and job.step_count % 20 == 0:
            print(f"step {job.step_count} workers {job.world_size} loss {loss.item():.4f}", flush=True)
    job.close()


if __name__ == "__main__":
    main()
