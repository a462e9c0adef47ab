"""Which device a job trains on and which collective backend it needs:
NCCL for CUDA parameters, gloo on the CPU (torch.distributed's guidance).
The reducer's buckets and the control tensor live on the parameters'
device, so a CUDA model's gradients are reduced where they are."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist


def params_device(params: Iterable[torch.Tensor]) -> torch.device:
    """The one device every parameter is on (CPU for a model without any);
    a model spread over several devices is refused, naming two of them."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        a, b = sorted(str(d) for d in devices)[:2]
        raise ValueError(f"the model's parameters are on several devices ({a} and {b}); "
                         "data-parallel training needs one device per worker")
    return devices.pop() if devices else torch.device("cpu")


def backend_for(device: torch.device, nccl_available: Callable[[], bool] = dist.is_nccl_available) -> str:
    """``nccl`` for a CUDA device (when torch was built with NCCL), else ``gloo``."""
    if device.type == "cuda":
        if not nccl_available():
            raise RuntimeError("CUDA parameters need the NCCL backend, which this torch build lacks")
        return "nccl"
    return "gloo"


def local_device(cuda_count: int, local_rank: str | None, visible: str | None, override: str | None = None
                 ) -> torch.device:
    """The device of one worker process, as torchrun users expect.

    ``override`` (``$TIDAL_DEVICE``) wins. Without a GPU: the CPU. With one
    visible GPU (the launcher set ``CUDA_VISIBLE_DEVICES`` to this worker's
    GPU): ``cuda:0``. With several: ``cuda:$LOCAL_RANK`` (torchrun's and
    Ray's convention), refused by name when that GPU is not visible."""
    if override:
        return torch.device(override)
    if cuda_count <= 0:
        return torch.device("cpu")
    if local_rank is None or cuda_count == 1:
        return torch.device("cuda", 0)
    try:
        lr = int(local_rank)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={local_rank!r} is not an integer") from None
    if not 0 <= lr < cuda_count:
        raise ValueError(f"LOCAL_RANK={lr} but only {cuda_count} GPU(s) are visible "
                         f"(CUDA_VISIBLE_DEVICES={visible!r}); give each worker its GPU")
    return torch.device("cuda", lr)
