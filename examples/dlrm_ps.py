"""A DLRM-like click model trained as a parameter-server job (docs/ps.md).

Three categorical fields, each with an embedding table on the parameter
servers, and 8 dense features through a bottom MLP; pairwise dot products of
the embeddings and the bottom output feed a top MLP that predicts a click.
The MLPs' weights live on the servers too, as one flat table. Synthetic data:
the click depends on hidden per-id scores, so the model can learn it.

    python examples/dlrm_ps.py --workers 2 --servers 2 --samples 40000
    python examples/dlrm_ps.py --processes --rows 3333334   # 10^7 rows x 16 over the servers

Halfway, the job scales its parameter servers from ``--servers`` to ``--servers + 1``.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import threading
import time

import torch
from torch import nn

from tidal.ps import ProcessLauncher, PSClient, PSMaster, ShardQueue, TableSpec, ThreadLauncher

FIELDS, DENSE = 3, 8
log = logging.getLogger("dlrm_ps")


class Dlrm(nn.Module):
    """Bottom MLP, dot interactions, top MLP; embeddings come from the servers."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(DENSE, 32), nn.ReLU(), nn.Linear(32, dim))
        pairs = (FIELDS + 1) * FIELDS // 2
        self.top = nn.Sequential(nn.Linear(pairs + dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, embs: list[torch.Tensor]) -> torch.Tensor:
        z = torch.stack([self.bottom(dense)] + embs, dim=1)
        dots = z @ z.transpose(1, 2)
        i, j = torch.triu_indices(z.shape[1], z.shape[1], offset=1)
        return self.top(torch.cat([z[:, 0], dots[:, i, j]], dim=1)).squeeze(1)


def batch(start: int, end: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples ``[start, end)``: categorical ids, dense features, clicks (deterministic per index)."""
    g = torch.Generator().manual_seed(start)
    ids = torch.randint(0, rows, (end - start, FIELDS), generator=g)
    dense = torch.randn(end - start, DENSE, generator=g)
    score = torch.sin(ids.double() * 0.37).sum(1) + dense[:, 0].double()
    return ids, dense, (score > 0).float()


def train_worker(addr: str, wid: str, dim: int, rows: int, batch_size: int, lr: float, out: dict) -> None:
    ps = PSClient(addr, wid, staleness=2)
    try:
        out[wid] = _train(ps, dim, rows, batch_size, lr)
    finally:
        ps.close()


def _train(ps: PSClient, dim: int, rows: int, batch_size: int, lr: float) -> list[float]:
    model = Dlrm(dim)
    params = list(model.parameters())
    losses = []
    for shard in ps.shards():
        for s in range(shard.start, shard.end, batch_size):
            ids, dense, y = batch(s, min(shard.end, s + batch_size), rows)
            uniq = [torch.unique(ids[:, f], return_inverse=True) for f in range(FIELDS)]
            pulled = ps.pull({"mlp": torch.arange(sum(p.numel() for p in params)),
                              **{f"emb{f}": u for f, (u, _) in enumerate(uniq)}})
            torch.nn.utils.vector_to_parameters(pulled["mlp"].flatten(), params)
            tables = [pulled[f"emb{f}"].requires_grad_() for f in range(FIELDS)]
            model.zero_grad()
            logits = model(dense, [tables[f][inv] for f, (_, inv) in enumerate(uniq)])
            loss = nn.functional.binary_cross_entropy_with_logits(logits, y)
            loss.backward()
            grads = {f"emb{f}": (u, tables[f].grad) for f, (u, _) in enumerate(uniq)}
            flat = torch.cat([p.grad.flatten() for p in params]).unsqueeze(1)
            grads["mlp"] = (torch.arange(flat.shape[0]), flat)
            ps.push(grads, lr=lr)
            losses.append(float(loss.detach()))
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=2, help="parameter servers at the start")
    p.add_argument("--rows", type=int, default=20_000, help="rows of each of the 3 embedding tables")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--samples", type=int, default=40_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--processes", action="store_true", help="servers as processes (default: threads)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    mlp_size = sum(q.numel() for q in Dlrm(a.dim).parameters())
    tables = [TableSpec(f"emb{f}", a.rows, a.dim, init="normal", std=0.1) for f in range(FIELDS)]
    tables.append(TableSpec("mlp", mlp_size, 1))
    with tempfile.TemporaryDirectory(prefix="dlrm-ps-") as ckpt:
        shards = ShardQueue(a.samples, shard_size=a.batch * 8)
        launcher = ProcessLauncher() if a.processes else ThreadLauncher()
        master = PSMaster(tables, ckpt, launcher, servers=a.servers, shards=shards)
        addr = master.start()
        try:
            init = PSClient(addr, "init")   # the MLP starts from torch's default init, not zeros
            try:
                vec = torch.nn.utils.parameters_to_vector(Dlrm(a.dim).parameters()).unsqueeze(1)
                init.push({"mlp": (torch.arange(mlp_size), -vec.detach())})
            finally:
                init.close()
            losses: dict[str, list[float]] = {}
            threads = [threading.Thread(target=train_worker, args=(addr, f"w{i}", a.dim, a.rows, a.batch,
                                                                     a.lr, losses)) for i in range(a.workers)]
            for t in threads:
                t.start()
            while len(shards.done) < shards.total // 2 and any(t.is_alive() for t in threads):
                time.sleep(0.1)
            master.scale_servers(a.servers + 1)
            for t in threads:
                t.join()
        finally:
            master.close()
    every = [x for v in losses.values() for x in v]
    k = max(1, len(every) // 10)
    log.info("batches %d; loss first 10%% %.3f, last 10%% %.3f; repartition pause %.0f ms", len(every),
             sum(every[:k]) / k, sum(every[-k:]) / k,
             next(e for e in master.events if e["kind"] == "scale_servers")["pause_ms"])


if __name__ == "__main__":
    main()
