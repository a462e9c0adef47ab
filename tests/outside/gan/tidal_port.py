"""Outside script 2, Tidal: plain.py made elastic as docs/runtime.md says
(each network wrapped, as with DDP).
Run: tidal run --workers 2 tidal_port.py --epochs 5 --out runs/
"""

import argparse
import math
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import tidal.runtime

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

    job = tidal.runtime.init()
    device = job.device
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(LATENT, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                              nn.Linear(64, 2)).to(device)
    discriminator = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2),
                                  nn.Linear(64, 1)).to(device)
    generator = job.wrap(generator)
    discriminator = job.wrap(discriminator)
    opt_g = torch.optim.Adam(generator.parameters(), lr=args.lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=args.lr, betas=(0.5, 0.999))
    criterion = nn.BCEWithLogitsLoss()
    loader = job.loader(DataLoader(TensorDataset(ring_of_gaussians(2048, 0)), batch_size=args.batch_size, shuffle=True))
    if os.environ.get("OUTSIDE_RECORD"): loader = __import__("outside_record").attach(job, loader, generator, discriminator)  # audit

    for epoch in job.epochs(args.epochs):
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
        with torch.no_grad():
            samples = generator(torch.randn(1000, LATENT, device=device))
            radius = samples.norm(dim=1).mean().item()
        print(f"epoch {epoch}: loss_d {loss_d.item():.4f} loss_g {loss_g.item():.4f} mean radius {radius:.3f}")

    os.makedirs(args.out, exist_ok=True)
    job.on_rank0(torch.save, {"generator": generator.state_dict(), "discriminator": discriminator.state_dict()},
                 os.path.join(args.out, "gan.pt"))


if __name__ == "__main__":
    main()
