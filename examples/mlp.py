"""An MLP on synthetic regression data, made elastic with Tidal.

The lines marked ``# tidal`` are everything a user adds to a plain PyTorch
loop. Run it::

    tidal run --workers 2 examples/mlp.py --epochs 20 --delay 0.05
    tidal scale mlp --workers 4          # from another terminal
    tidal scale mlp --workers 1

or without Tidal's launcher as a single local worker: ``python examples/mlp.py``.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import tidal.runtime  # tidal


class Synthetic(torch.utils.data.Dataset):
    """``y = sin(x @ w)`` plus noise; a map-style dataset (``__getitem__``)."""

    def __init__(self, n: int, dim: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.sin(self.x @ torch.randn(dim, 1, generator=g)) + 0.05 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=128, help="global batch (fixed under strong scaling)")
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--delay", type=float, default=0.0, help="extra seconds per step (pretend to be a bigger model)")
    args = ap.parse_args()

    job = tidal.runtime.init()  # tidal: connect to the job master
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * args.samples // args.batch_size)
    job.register_state(model, opt, sched)  # tidal: what a newcomer receives
    job.register_hook(lambda old, new: print(f"[{job.worker_id}] rescaled {old} -> {new} workers", flush=True))  # tidal (optional)

    data = Synthetic(args.samples)
    loader = job.data(data, batch_size=args.batch_size, epochs=args.epochs, seed=0)  # tidal: replaces DataLoader
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        job.step()  # tidal: replaces optimizer.step(); zero_grad()
        sched.step()
        if args.delay:
            time.sleep(args.delay)
        if job.rank == 0 and job.step_count % 50 == 0:
            print(f"step {job.step_count} epoch {loader.epoch} workers {job.world_size} loss {loss.item():.4f}", flush=True)
    if job.rank == 0 and not job.left:
        print(f"done: {job.step_count} steps, final loss {loss.item():.4f}", flush=True)
    job.close()  # tidal


if __name__ == "__main__":
    main()
