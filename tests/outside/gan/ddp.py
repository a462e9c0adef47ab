"""Outside script 2, DDP: plain.py under DistributedDataParallel (both
networks wrapped), as people port it.
Run: torchrun --nproc-per-node 2 ddp.py --epochs 5 --out runs/
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

LATENT = 8


def ring_of_gaussians(n, seed):
    g = torch.Generator().manual_seed(seed)
    angles = torch.randint(0, 8, (n,), generator=g).float() * (2 * math.pi / 8)
    centers = torch.stack([torch.cos(angles), torch.sin(angles)], dim=1) * 2.0
    return centers + 0.05 * torch.randn(n, 2, generator=g)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--out", default="runs")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(LATENT, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                              nn.Linear(64, 2)).to(device)
    discriminator = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2),
                                  nn.Linear(64, 1)).to(device)
    device_ids = [local_rank] if torch.cuda.is_available() else None
    generator = DDP(generator, device_ids=device_ids)
    discriminator = DDP(discriminator, device_ids=device_ids)
    opt_g = torch.optim.Adam(generator.parameters(), lr=args.lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=args.lr, betas=(0.5, 0.999))
    criterion = nn.BCEWithLogitsLoss()
    dataset = TensorDataset(ring_of_gaussians(2048, 0))
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=args.batch_size // world_size, sampler=sampler)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for (real,) in loader:
            real = real.to(device)
            ones = torch.ones(real.size(0), 1, device=device)
            zeros = torch.zeros(real.size(0), 1, device=device)
            fake = generator(torch.randn(real.size(0), LATENT, device=device))

            # discriminator: real -> 1, fake -> 0 (no gradient into the generator)
            opt_d.zero_grad()
            loss_d = criterion(discriminator(real), ones) + criterion(discriminator(fake.detach()), zeros)
            loss_d.backward()
            opt_d.step()

            # generator: make the discriminator say 1 on fakes
            opt_g.zero_grad()
            loss_g = criterion(discriminator(fake), ones)
            loss_g.backward()
            opt_g.step()
        if rank == 0:
            with torch.no_grad():
                samples = generator.module(torch.randn(1000, LATENT, device=device))
                radius = samples.norm(dim=1).mean().item()
            print(f"epoch {epoch}: loss_d {loss_d.item():.4f} loss_g {loss_g.item():.4f} mean radius {radius:.3f}")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"generator": generator.module.state_dict(), "discriminator": discriminator.module.state_dict()},
                   os.path.join(args.out, "gan.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
