"""Sending the full elastic state to newcomers (EDL §4.2: "each newcomer
receives the full state from an existing worker").

Two ways: :func:`broadcast_state`, a collective over the whole new group, and
:func:`replicate_state`, point-to-point transfers from several sources at once
(Elan §IV; the sources are chosen by :mod:`tidal.runtime.replication`).

Pickling a large state dict through ``broadcast_object_list`` is slow; here
only the structure (with tensors replaced by references) is pickled, and the
tensors travel as one flat buffer per dtype with ``dist.broadcast``.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tidal.runtime.sealed import seal, store_key, unseal

_SEAL_NAME = "tidal/state-transfer"  # what the seal of a transferred structure is bound to


@dataclass(frozen=True)
class _Ref:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool = True  # CPU tensors (RNG states, step counters) land on the CPU, the rest on the comm device


def comm_device() -> torch.device:
    """Where tensors travel: the current CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def place(t: torch.Tensor, ref: _Ref) -> torch.Tensor:
    """A received tensor on the device it belongs on at the receiver."""
    return t.cpu() if ref.on_cpu and t.device.type != "cpu" else t


def _strip(obj: Any, out: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        out.append(obj.detach())
        return _Ref(len(out) - 1, tuple(obj.shape), obj.dtype, obj.device.type == "cpu")
    if isinstance(obj, dict):
        return {k: _strip(v, out) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strip(v, out) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_strip(v, out) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Ref):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_fill(v, tensors) for v in obj)
    return obj


def _refs(obj: Any, acc: list[_Ref]) -> list[_Ref]:
    if isinstance(obj, _Ref):
        acc.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _refs(v, acc)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _refs(v, acc)
    return acc


def _pack(meta: Any) -> bytes:
    """The structure, pickled and sealed with the job's key: a peer
    connection a co-tenant slipped into cannot make a receiver unpickle its
    bytes (:mod:`tidal.runtime.sealed`)."""
    return seal(store_key(), _SEAL_NAME, pickle.dumps(meta))


def _unpack(body: torch.Tensor) -> Any:
    """What :func:`_pack` packed; :class:`~tidal.runtime.sealed.Forged` if
    this job did not pack it (nothing is unpickled then)."""
    return pickle.loads(unseal(store_key(), _SEAL_NAME, body.cpu().numpy().tobytes()))


def broadcast_state(obj: Any, src: int = 0) -> Any:
    """Broadcast a nested dict/list of tensors and picklable values from
    ``src``; returns the received object on every rank (``obj`` itself on src)."""
    rank, dev = dist.get_rank(), comm_device()
    tensors: list[torch.Tensor] = []
    meta = [_strip(obj, tensors) if rank == src else None]
    raw = _pack(meta[0]) if rank == src else b""
    size = torch.tensor([len(raw)], dtype=torch.int64, device=dev)
    dist.broadcast(size, src=src)
    body = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev) if rank == src else \
        torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(body, src=src)
    if rank != src:
        meta[0] = _unpack(body)
    refs = sorted(_refs(meta[0], []), key=lambda r: r.index)
    received: list[torch.Tensor | None] = [None] * len(refs)
    for dtype in sorted({r.dtype for r in refs}, key=str):
        group = [r for r in refs if r.dtype == dtype]
        if rank == src:
            buf = torch.cat([tensors[r.index].reshape(-1).to(dev) for r in group]) if group else \
                torch.zeros(0, dtype=dtype, device=dev)
        else:
            buf = torch.empty(sum(int(torch.Size(r.shape).numel()) for r in group), dtype=dtype, device=dev)
        dist.broadcast(buf, src=src)
        if rank != src:
            off = 0
            for r in group:
                n = int(torch.Size(r.shape).numel())
                received[r.index] = place(buf[off : off + n].view(r.shape).clone(), r)
                off += n
    if rank == src:
        return obj
    return _fill(meta[0], received)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- point to point (Elan §IV)


def _flat_buffers(tensors: list[torch.Tensor], refs: list[_Ref]) -> list[torch.Tensor]:
    """One flat buffer per dtype (sorted by name), in the order both sides use."""
    out = []
    for dtype in sorted({r.dtype for r in refs}, key=str):
        group = [r for r in refs if r.dtype == dtype]
        out.append(torch.cat([tensors[r.index].reshape(-1).to(comm_device()) for r in group]))
    return out


def _chunks(buf: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    if chunk_bytes <= 0 or buf.numel() == 0:
        return [buf]
    step = max(1, chunk_bytes // buf.element_size())
    return [buf[i : i + step] for i in range(0, buf.numel(), step)]


def send_state(obj: Any, dsts: list[int], max_bytes_per_s: float = 0.0, chunk_bytes: int = 4 << 20) -> None:
    """Send ``obj`` to each rank in ``dsts``; all transfers are posted at once
    (``isend``) and progress concurrently. Pairs with :func:`recv_state`.

    ``max_bytes_per_s`` caps this sender's total egress (0: no cap), e.g. to
    leave a host's NIC to the training traffic of other jobs: the tensors go
    in ``chunk_bytes`` pieces, round robin over the destinations, paced."""
    if not dsts:
        return
    tensors: list[torch.Tensor] = []
    meta = _strip(obj, tensors)
    raw = _pack(meta)
    chunk = int(chunk_bytes) if max_bytes_per_s > 0 else 0
    head = torch.tensor([len(raw), chunk], dtype=torch.int64, device=comm_device())
    body = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(comm_device())
    pieces = [c for b in _flat_buffers(tensors, sorted(_refs(meta, []), key=lambda r: r.index)) for c in _chunks(b, chunk)]
    works = []
    for d in dsts:
        works.append(dist.isend(head, dst=d, tag=0))
        works.append(dist.isend(body, dst=d, tag=1))
    t0, sent = time.perf_counter(), 0
    for tag, t in enumerate(pieces, start=2):
        for d in dsts:
            works.append(dist.isend(t, dst=d, tag=tag))
            sent += t.numel() * t.element_size()
        if max_bytes_per_s > 0:  # pace: wait until the bytes posted so far fit the cap
            for w in works:
                w.wait()
            works = []
            ahead = sent / max_bytes_per_s - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
    for w in works:
        w.wait()


def recv_state(src: int) -> Any:
    """Receive what :func:`send_state` sends from ``src``."""
    head = torch.zeros(2, dtype=torch.int64, device=comm_device())
    dist.recv(head, src=src, tag=0)
    body = torch.empty(int(head[0].item()), dtype=torch.uint8, device=comm_device())
    dist.recv(body, src=src, tag=1)
    chunk = int(head[1].item())
    meta = _unpack(body)
    refs = sorted(_refs(meta, []), key=lambda r: r.index)
    received: list[torch.Tensor | None] = [None] * len(refs)
    tag = 2
    for dtype in sorted({r.dtype for r in refs}, key=str):
        group = [r for r in refs if r.dtype == dtype]
        buf = torch.empty(sum(int(torch.Size(r.shape).numel()) for r in group), dtype=dtype, device=comm_device())
        for piece in _chunks(buf, chunk):
            dist.recv(piece, src=src, tag=tag)
            tag += 1
        off = 0
        for r in group:
            n = int(torch.Size(r.shape).numel())
            received[r.index] = place(buf[off : off + n].view(r.shape), r)
            off += n
    return _fill(meta, received)  # type: ignore[arg-type]


def replicate_state(obj: Any, sources: dict[int, int], max_bytes_per_s: float = 0.0) -> Any:
    """``sources``: destination rank -> source rank. Sources send to their
    destinations concurrently, destinations receive, other ranks return at
    once. Returns the received object on a destination, ``obj`` elsewhere."""
    rank = dist.get_rank()
    if rank in sources:
        return recv_state(sources[rank])
    send_state(obj, sorted(d for d, s in sources.items() if s == rank), max_bytes_per_s)
    return obj
