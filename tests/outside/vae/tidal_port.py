"""Outside script 3, Tidal: plain.py made elastic as docs/runtime.md says.
Run: tidal run --workers 2 tidal_port.py --epochs 5 --out runs/
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import tidal.runtime


class VAE(nn.Module):
    def __init__(self, dim=32, hidden=64, latent=4):
        super().__init__()
        self.enc = nn.Linear(dim, hidden)
        self.mu = nn.Linear(hidden, latent)
        self.logvar = nn.Linear(hidden, latent)
        self.dec1 = nn.Linear(latent, hidden)
        self.dec2 = nn.Linear(hidden, dim)

    def encode(self, x):
        h = F.relu(self.enc(x))
        return self.mu(h), self.logvar(h)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        return torch.sigmoid(self.dec2(F.relu(self.dec1(z))))

    def forward(self, x):
        mu, logvar = self.encode(x)
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def loss_function(recon_x, x, mu, logvar):
    bce = F.binary_cross_entropy(recon_x, x, reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def make_data(n, seed, dim=32):
    # points near a 4-dimensional manifold, squashed into [0, 1]
    mixing = torch.randn(4, dim, generator=torch.Generator().manual_seed(99))
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 4, generator=g)
    return torch.sigmoid(z @ mixing + 0.1 * torch.randn(n, dim, generator=g))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="runs")
    args = parser.parse_args()

    job = tidal.runtime.init()
    device = job.device
    torch.manual_seed(0)
    model = VAE().to(device)
    model = job.wrap(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_loader = job.loader(DataLoader(TensorDataset(make_data(2048, 0)), batch_size=args.batch_size, shuffle=True))
    if os.environ.get("OUTSIDE_RECORD"): train_loader = __import__("outside_record").attach(job, train_loader, model)  # audit
    test_loader = DataLoader(TensorDataset(make_data(512, 1)), batch_size=256)

    for epoch in job.epochs(args.epochs):
        model.train()
        train_loss = 0.0
        for (data,) in train_loader:
            data = data.to(device)
            optimizer.zero_grad()
            recon, mu, logvar = model(data)
            loss = loss_function(recon, data, mu, logvar)
            loss.backward()
            train_loss += loss.item()
            optimizer.step()

        model.eval()
        test_loss = 0.0
        with torch.no_grad():
            for (data,) in test_loader:
                data = data.to(device)
                recon, mu, logvar = model(data)
                test_loss += loss_function(recon, data, mu, logvar).item()
        print(f"epoch {epoch}: train loss {train_loss / len(train_loader.dataset):.4f} "
              f"test loss {test_loss / len(test_loader.dataset):.4f}")

    os.makedirs(args.out, exist_ok=True)
    job.on_rank0(torch.save, model.state_dict(), os.path.join(args.out, "vae.pt"))


if __name__ == "__main__":
    main()
