"""Outside script 3, plain: a small VAE (MLP encoder and decoder, the
reparameterisation trick, BCE reconstruction + KL divergence) on synthetic
data in [0, 1]. One process. Run: python plain.py --epochs 5 --out runs/
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


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

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = VAE().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_loader = DataLoader(TensorDataset(make_data(2048, 0)), batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(TensorDataset(make_data(512, 1)), batch_size=256)

    for epoch in range(args.epochs):
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
    torch.save(model.state_dict(), os.path.join(args.out, "vae.pt"))


if __name__ == "__main__":
    main()
