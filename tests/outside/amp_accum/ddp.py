"""Outside script 4, DDP: plain.py under DistributedDataParallel, as people
port it (no gradient all-reduce inside an accumulation window: no_sync).
Run: torchrun --nproc-per-node 2 ddp.py --epochs 5 --out runs/
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_data(n, seed):
    w = torch.randn(24, 5, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 24, generator=g)
    y = (x @ w + 0.3 * torch.randn(n, 5, generator=g)).argmax(1)
    return TensorDataset(x, y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--accum-steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="runs")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    use_cuda = device.type == "cuda"
    amp_dtype = torch.float16 if use_cuda else torch.bfloat16

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 5)).to(device)
    model = DDP(model, device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cuda", enabled=use_cuda)
    criterion = nn.CrossEntropyLoss()
    train_set = make_data(2048, 0)
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=sampler)
    test_x, test_y = make_data(512, 1).tensors

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            sync = (i + 1) % args.accum_steps == 0
            with contextlib.nullcontext() if sync else model.no_sync():
                with torch.autocast(device_type=device.type, dtype=amp_dtype):
                    loss = criterion(model(x), y) / args.accum_steps
                scaler.scale(loss).backward()
            if sync:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)

        model.eval()
        with torch.no_grad(), torch.autocast(device_type=device.type, dtype=amp_dtype):
            acc = (model(test_x.to(device)).argmax(1) == test_y.to(device)).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch}: last loss {loss.item() * args.accum_steps:.4f} test acc {acc:.3f}")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(args.out, "amp_accum.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
