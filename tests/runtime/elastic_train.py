"""Training script used by the runtime tests (not collected by pytest).

A float64 MLP on synthetic regression data, SGD with momentum and a step LR
schedule. Every worker logs, per step, the dataset indices it consumed; the
final rank 0 saves the parameters. Run under ``tidal run`` or directly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import tidal.runtime


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    w = torch.randn(8, 1, generator=g, dtype=torch.float64)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return x, y


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def make_opt(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.8)


class Pairs(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--crash-at", type=int, default=-1, help="worker --crash-worker dies at this step (tests)")
    ap.add_argument("--crash-worker", default="w1")
    ap.add_argument("--scaling", default="strong", choices=["strong", "weak", "hybrid"])
    a = ap.parse_args()

    job = tidal.runtime.init()
    x, y = make_data(a.n, a.seed)
    model = make_model(a.seed)
    opt, sched = make_opt(model)
    job.register_state(model, opt, sched)
    log = open(os.path.join(a.out, f"steps-{job.worker_id}.jsonl"), "w")
    loader = job.data(Pairs(x, y), batch_size=a.batch, epochs=a.epochs, seed=a.seed, scaling=a.scaling)
    try:  # a worker removed by a scale-in exits inside the loop: its summary is written on the way out
        for xb, yb in loader:
            if job.step_count == a.crash_at and job.worker_id == a.crash_worker:
                os._exit(3)  # die abruptly, like a lost host
            rec = {"step": job.step_count, "epoch": loader.epoch, "idx": loader.last_indices,
                   "world": job.world_size, "rank": job.rank, "gen": job.gen.gen if job.gen else 0,
                   "B": job.global_batch_size}
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            applied = job.step()  # False: a peer died, the step was dropped and will be redone
            rec.update(lr=opt.param_groups[0]["lr"], lr_step=sched.last_epoch)  # the LR this step used
            sched.step()
            if applied:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            if a.sleep and not os.path.exists(os.path.join(a.out, "fast")):
                time.sleep(a.sleep)  # slow steps while the test rescales; the test lifts it via the "fast" file
        if not job.left:
            torch.save({k: v.clone() for k, v in model.state_dict().items()},
                       os.path.join(a.out, f"final-{job.worker_id}.pt"))
    finally:
        log.close()
        summ = job.summary()
        summ["warm_start"] = "tidal.runtime.warm" in sys.modules  # started from a warm spare (tidal run)
        if not job.left:
            summ["final_rank"] = job.rank
        with open(os.path.join(a.out, f"summary-{job.worker_id}.json"), "w") as f:
            json.dump(summ, f)
    job.close()


if __name__ == "__main__":
    main()
