"""Outside script 1, DDP: plain.py under DistributedDataParallel, as people
port it. Run: torchrun --nproc-per-node 2 ddp.py --epochs 5 --out runs/
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class SmallCNN(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, kernel_size=3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


def make_dataset(n, seed):
    # one fixed template per class, and noisy copies of it
    templates = torch.randn(10, 1, 16, 16, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = templates[labels] + 1.5 * torch.randn(n, 1, 16, 16, generator=g)
    return TensorDataset(images, labels)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default="runs")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = SmallCNN().to(device)
    model = DDP(model, device_ids=[local_rank] if torch.cuda.is_available() else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    criterion = nn.CrossEntropyLoss()
    train_set = make_dataset(1536, 0)
    sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=sampler)
    test_loader = DataLoader(make_dataset(512, 1), batch_size=256)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running_loss = 0.0
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(model(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
        scheduler.step()

        model.eval()
        correct = total = 0
        with torch.no_grad():
            for images, labels in test_loader:
                images, labels = images.to(device), labels.to(device)
                correct += (model(images).argmax(1) == labels).sum().item()
                total += labels.size(0)
        if rank == 0:
            print(f"epoch {epoch}: train loss {running_loss / len(train_loader):.4f}, "
                  f"test acc {100.0 * correct / total:.1f}%, lr {scheduler.get_last_lr()[0]:.4f}")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(args.out, "cnn.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
