"""A small CNN on synthetic 1x28x28 images (10 classes), made elastic with Tidal.

The lines marked ``# tidal`` are everything a user adds. Run it::

    tidal run --workers 2 --max-workers 4 examples/cnn.py --epochs 3
    tidal scale cnn --workers 3          # from another terminal
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import tidal.runtime  # tidal


class SyntheticImages(torch.utils.data.Dataset):
    """Each class is a fixed random template plus noise, so the task is learnable."""

    def __init__(self, n: int, classes: int = 10, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(classes, 1, 28, 28, generator=g)
        self.labels = torch.randint(0, classes, (n,), generator=g)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)  # sample i is the same on every worker
        y = self.labels[i]
        return self.templates[y] + 0.8 * torch.randn(1, 28, 28, generator=g), y


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4096)
    args = ap.parse_args()

    job = tidal.runtime.init()  # tidal
    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job.register_state(model, opt, extras={"best_acc": 0.0})  # tidal

    loader = job.data(SyntheticImages(args.samples), batch_size=args.batch_size, epochs=args.epochs, seed=1)  # tidal
    correct = seen = 0
    for x, y in loader:
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        job.step()  # tidal
        correct += int((out.argmax(1) == y).sum())
        seen += len(y)
        if job.rank == 0 and job.step_count % 20 == 0:
            print(f"step {job.step_count} epoch {loader.epoch} workers {job.world_size} "
                  f"loss {loss.item():.3f} local acc {correct / max(seen, 1):.2f}", flush=True)
    if job.rank == 0 and not job.left:
        print(f"done: {job.step_count} steps", flush=True)
    job.close()  # tidal


if __name__ == "__main__":
    main()
