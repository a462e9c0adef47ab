"""A classifier trained the plain PyTorch way, in one process.

Compare with ddp.py (the same script under DistributedDataParallel) and
tidal_port.py (the same script made elastic). Run: python plain.py
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    y = (x[:, :5].sum(1) > 0).long() + (x[:, 5:10].sum(1) > 0).long()
    return TensorDataset(x, y)


def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            correct += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    model.train()
    return correct / total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--save", default="model.pt")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 3)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    train_loader = DataLoader(make_data(4096, 0), batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(make_data(1024, 1), batch_size=256)

    for epoch in range(args.epochs):
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        scheduler.step()
        acc = evaluate(model, test_loader, device)
        print(f"epoch {epoch} loss {loss.item():.4f} accuracy {acc:.3f}")
    torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
