"""Outside script 4, plain: an MLP classifier trained under torch.autocast
(bfloat16 on the CPU, float16 with a GradScaler on CUDA) with gradient
accumulation over 4 micro-batches and gradient clipping. One process.
Run: python plain.py --epochs 5 --out runs/
"""

import argparse
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


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

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_cuda = device.type == "cuda"
    amp_dtype = torch.float16 if use_cuda else torch.bfloat16

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 5)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cuda", enabled=use_cuda)
    criterion = nn.CrossEntropyLoss()
    loader = DataLoader(make_data(2048, 0), batch_size=args.batch_size, shuffle=True)
    test_x, test_y = make_data(512, 1).tensors

    for epoch in range(args.epochs):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            with torch.autocast(device_type=device.type, dtype=amp_dtype):
                loss = criterion(model(x), y) / args.accum_steps
            scaler.scale(loss).backward()
            if (i + 1) % args.accum_steps == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)

        model.eval()
        with torch.no_grad(), torch.autocast(device_type=device.type, dtype=amp_dtype):
            acc = (model(test_x.to(device)).argmax(1) == test_y.to(device)).float().mean().item()
        print(f"epoch {epoch}: last loss {loss.item() * args.accum_steps:.4f} test acc {acc:.3f}")

    os.makedirs(args.out, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(args.out, "amp_accum.pt"))


if __name__ == "__main__":
    main()
