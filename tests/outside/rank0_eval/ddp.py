"""Outside script 5, DDP: plain.py under DistributedDataParallel, as people
port it: rank 0 alone evaluates and saves the best model.
Run: torchrun --nproc-per-node 2 ddp.py --epochs 5 --out runs/
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


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

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    model = DDP(model, device_ids=[local_rank] if torch.cuda.is_available() else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_set = make_data(2048, 0)
    sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=sampler)
    val_loader = DataLoader(make_data(512, 1), batch_size=512)
    os.makedirs(args.out, exist_ok=True)
    best_path = os.path.join(args.out, "best.pt")
    best_val = float("inf")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            val_loss = evaluate(model.module, val_loader, device)
            print(f"epoch {epoch}: train loss {loss.item():.4f} val loss {val_loss:.4f}")
            if val_loss < best_val:
                best_val = val_loss
                torch.save(model.module.state_dict(), best_path)
                print(f"  saved a new best model to {best_path}")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
