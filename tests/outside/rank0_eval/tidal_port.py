"""Outside script 5, Tidal: plain.py made elastic as docs/runtime.md says:
rank 0 alone evaluates and saves (``job.on_rank0``), and the best loss is a
value every worker keeps (``job.keep``), so it survives a change of rank 0.
Run: tidal run --workers 2 tidal_port.py --epochs 5 --out runs/
"""

import argparse
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import tidal.runtime


def make_data(n, seed):
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = torch.sin(0.3 * x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def evaluate(model, loader, device):
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            total += nn.functional.mse_loss(model(x), y, reduction="sum").item()
            count += len(x)
    model.train()
    return total / count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default="runs")
    args = parser.parse_args()

    job = tidal.runtime.init()
    device = job.device
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    model = job.wrap(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_loader = job.loader(DataLoader(make_data(2048, 0), batch_size=args.batch_size, shuffle=True))
    if os.environ.get("OUTSIDE_RECORD"): train_loader = __import__("outside_record").attach(job, train_loader, model)  # audit
    val_loader = DataLoader(make_data(512, 1), batch_size=512)
    os.makedirs(args.out, exist_ok=True)
    best_path = os.path.join(args.out, "best.pt")
    keep = job.keep(best_val=float("inf"))

    for epoch in job.epochs(args.epochs):
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        val_loss = job.on_rank0(evaluate, model, val_loader, device)
        print(f"epoch {epoch}: train loss {loss.item():.4f} val loss {val_loss:.4f}")
        if val_loss < keep.best_val:
            keep.best_val = val_loss
            job.on_rank0(torch.save, model.state_dict(), best_path)
            print(f"  saved a new best model to {best_path}")


if __name__ == "__main__":
    main()
