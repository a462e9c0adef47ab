"""A training script written the way people write them (not collected by
pytest): gradient clipping, AMP with a GradScaler, gradient accumulation
with no_sync, a branch some batches do not use, per-epoch LR schedule and
rank-0-only evaluation. Ported to Tidal with the lines marked ``# tidal``.

Every rank logs the dataset indices of each micro-batch (exactly-once
audit); the final rank 0 saves the parameters. Runs under ``tidal run`` or
alone with ``python`` (the fixed-size reference).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import tidal.runtime  # tidal


class Net(torch.nn.Module):
    """An MLP with a per-sample gated branch (unused by batches without a
    gated sample) and a head nothing uses."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.branch = torch.nn.Linear(8, 1)
        self.never = torch.nn.Linear(8, 1)
        self.to(dtype)

    def forward(self, x: torch.Tensor, gated: bool) -> torch.Tensor:
        out = self.body(x)
        mask = (x[:, :1] > 1.0).to(x.dtype)
        if gated and bool(mask.any()):
            out = out + mask * self.branch(x)
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--features", default="", help="comma list: clip, amp, accum, unused")
    ap.add_argument("--n", type=int, default=384)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--sleep", type=float, default=0.0)
    a = ap.parse_args()
    feats = set(filter(None, a.features.split(",")))
    accum = 2 if "accum" in feats else 1

    job = tidal.runtime.init()  # tidal
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.n, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g)) + 0.1 * torch.randn(a.n, 1, generator=g)
    dtype = torch.float32 if "amp" in feats else torch.float64
    torch.manual_seed(0)
    model = Net(dtype)
    model = job.wrap(model)  # tidal
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled="amp" in feats)
    data = TensorDataset(x.to(dtype), y.to(dtype))
    loader = DataLoader(data, batch_size=a.batch, shuffle=True)
    loader = job.loader(loader)  # tidal
    log = open(os.path.join(a.out, f"steps-{job.worker_id}.jsonl"), "w")
    for epoch in job.epochs(a.epochs):  # tidal
        model.train()
        for xb, yb in loader:
            i = loader.batch_index  # tidal: enumerate() would count from 0 on a worker that joins mid-epoch
            sync = (i + 1) % accum == 0 or i + 1 == len(loader)
            ctx = contextlib.nullcontext() if sync else job.no_sync()  # DDP: model.no_sync()
            with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled="amp" in feats):
                loss = torch.nn.functional.mse_loss(model(xb, gated="unused" in feats).float(), yb.float())
                scaler.scale(loss / accum).backward()
            log.write(json.dumps({"step": job.step_count, "epoch": epoch, "idx": loader.last_indices,
                                  "world": job.world_size, "rank": job.rank}) + "\n")
            if not sync:
                continue
            if "clip" in feats:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if a.sleep and not os.path.exists(os.path.join(a.out, "fast")):
                time.sleep(a.sleep)
        sched.step()
        if job.rank == 0:
            with torch.no_grad():
                ev = torch.nn.functional.mse_loss(model(x.to(dtype), gated=False), y.to(dtype)).item()
            print(f"epoch {epoch} eval loss {ev:.4f} workers {job.world_size}", flush=True)
    log.close()
    if not job.left and job.rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(a.out, "final.pt"))


if __name__ == "__main__":
    main()
