"""The data path picks its device and backend from the model: NCCL for CUDA
parameters, gloo on the CPU, and the reducer's buckets where the parameters
are. This machine has no GPU: the CUDA branch is tested through the choice
function, and "another device" is torch's ``meta`` device."""

from __future__ import annotations

import pytest
import torch

from tidal.runtime import init
from tidal.runtime.devices import backend_for, params_device
from tidal.runtime.reducer import GradReducer


def test_cuda_parameters_choose_nccl_and_cpu_ones_gloo() -> None:
    assert backend_for(torch.device("cuda", 1), nccl_available=lambda: True) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"
    with pytest.raises(RuntimeError, match="NCCL"):
        backend_for(torch.device("cuda", 0), nccl_available=lambda: False)


def test_a_model_on_two_devices_is_refused_by_name() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="cpu and meta"):
        params_device(m.parameters())
    assert params_device(torch.nn.Linear(2, 2).parameters()) == torch.device("cpu")
    assert params_device([]) == torch.device("cpu")


def test_buckets_live_on_the_parameters_device() -> None:
    m = torch.nn.Linear(4, 3, device="meta")
    r = GradReducer(list(m.parameters()), overlap=False)
    try:
        assert r.device.type == "meta"
        assert all(b.buf.device.type == "meta" for b in r.buckets)
    finally:
        r.remove()


def test_a_cpu_job_uses_gloo() -> None:
    job = init(worker_id="w0")  # no master: one local worker
    job.register_state(torch.nn.Linear(2, 1))
    assert job.membership.backend == "gloo"


def test_state_transfer_puts_cpu_tensors_back_on_the_cpu() -> None:
    """Under NCCL the state travels in GPU memory; RNG states and step
    counters, CPU tensors at the sender, must land on the CPU again (``torch.
    set_rng_state`` takes only a CPU tensor), the rest on the receiver's
    device. Checked with the meta device standing in for a GPU."""
    from tidal.runtime.transfer import _Ref, _strip, comm_device, place

    out: list[torch.Tensor] = []
    meta = _strip({"rng": torch.get_rng_state(), "w": torch.zeros(2, device="meta")}, out)
    assert meta["rng"].on_cpu and not meta["w"].on_cpu
    travelled = torch.zeros(3, device="meta")  # as received in accelerator memory
    assert place(travelled, _Ref(0, (3,), torch.float32, on_cpu=False)).device.type == "meta"
    assert comm_device() == torch.device("cpu")  # no process group here: the CPU (gloo)
