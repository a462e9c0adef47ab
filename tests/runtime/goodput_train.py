"""Training script of the goodput tests (not collected by pytest).

Softmax regression through a small float64 MLP on synthetic 10-class data
whose labels are partly random (real per-sample gradient noise, growing as
the loss falls), SGD with momentum at a learning rate tuned for the base
batch. Every worker logs, per step, the dataset indices it consumed, the
global batch, the learning rate and what ``job.goodput`` reports; at each
epoch's end every worker computes the full-data loss (equal on every rank:
the replicas are equal) and, with ``--target-loss``, rank 0 records the wall
time at which it was first reached and every worker skips the remaining
epochs. The last ranks save their parameters. Run under ``tidal run``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import tidal.runtime

DIM, CLASSES = 20, 10


def make_data(n: int, seed: int, flip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels: the argmax of a random linear map, a fraction ``flip`` replaced by random labels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g, dtype=torch.float64)
    w = torch.randn(DIM, CLASSES, generator=g, dtype=torch.float64)
    y = (x @ w).argmax(1)
    noisy = torch.rand(n, generator=g, dtype=torch.float64) < flip
    y[noisy] = torch.randint(0, CLASSES, (int(noisy.sum()),), generator=g)
    return x, y


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.Tanh(), torch.nn.Linear(64, CLASSES)).double()


class Pairs(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--flip", type=float, default=0.3)
    ap.add_argument("--sleep", type=float, default=0.0, help="per-step pause while the file 'fast' is absent")
    ap.add_argument("--scaling", default="goodput", choices=["strong", "goodput"])
    ap.add_argument("--max-batch", type=int, default=None)
    ap.add_argument("--max-local", type=int, default=None)
    ap.add_argument("--lr-rule", default="adascale")
    ap.add_argument("--drift", type=float, default=0.0, help="0: the batch changes at switches only")
    ap.add_argument("--noise", action="store_true", help="measure the noise scale under strong scaling")
    ap.add_argument("--target-loss", type=float, default=0.0)
    return ap.parse_args()


def main() -> None:
    a = parse()
    job = tidal.runtime.init()
    x, y = make_data(a.n, a.seed, a.flip)
    model = job.wrap(make_model(a.seed))
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    kw = ({"max_batch": a.max_batch, "max_local": a.max_local, "lr_rule": a.lr_rule, "drift": a.drift or None}
          if a.scaling == "goodput" else {"noise_scale": a.noise})
    loader = job.loader(Pairs(x, y), a.batch, seed=a.seed, scaling=tidal.runtime.make_policy(a.scaling, a.batch, **kw))
    log = open(os.path.join(a.out, f"steps-{job.worker_id}.jsonl"), "w")
    losses: list[tuple[int, float, float]] = []
    reached = None
    t_start = None
    for epoch in job.epochs(a.epochs):
        if reached is not None:
            continue  # every rank saw the same loss: all skip the rest
        for xb, yb in loader:
            t_start = t_start or time.time()
            rec = {"step": job.step_count, "epoch": epoch, "idx": loader.last_indices, "world": job.world_size,
                   "rank": job.rank, "gen": job.gen.gen if job.gen else 0, "B": job.global_batch_size,
                   "goodput": job.goodput, "timings": job.policy.state_dict().get("timings")}
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            rec["lr"] = opt.param_groups[0]["lr"]  # job.step() below would not change it: the LR of this step
            opt.step()
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if a.sleep and not os.path.exists(os.path.join(a.out, "fast")):
                time.sleep(a.sleep)
        with torch.no_grad():
            loss = float(torch.nn.functional.cross_entropy(model(x), y))
        losses.append((job.step_count, time.time() - (t_start or time.time()), loss))
        if a.target_loss and loss <= a.target_loss:
            reached = losses[-1]
    log.close()
    if not job.left:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(a.out, f"final-{job.worker_id}.pt"))
        summ = job.summary()
        summ.update(losses=losses, reached=reached, final_rank=job.rank)
        with open(os.path.join(a.out, f"summary-{job.worker_id}.json"), "w") as f:
            json.dump(summ, f)
    job.close()


if __name__ == "__main__":
    main()
