"""One rank of a 2-process gloo all_reduce (run inside a host namespace).

Usage: ``gloo_allreduce.py RANK WORLD STORE_ADDR STORE_PORT``. Rank 0 hosts the
TCPStore. Rank r contributes ``[r+1, 10*(r+1)]``; prints the reduced tensor as
JSON.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main(rank: int, world: int, addr: str, port: int) -> None:
    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    dist.all_reduce(t)
    print(json.dumps({"rank": rank, "sum": t.tolist()}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can outlive the interpreter and abort a normal exit (SIGABRT)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
