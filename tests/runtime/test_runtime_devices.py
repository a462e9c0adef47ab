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


def test_tidal_run_gives_each_worker_its_own_gpu_and_never_one_twice(tmp_path) -> None:
    """The local spawner (``tidal run``) hands out LOCAL_RANK as torchrun
    does; with GPUs that is the worker's GPU: a freed GPU is reused, and a
    worker beyond the last free one is refused (the GPU ids are given, as
    this machine has none)."""
    import subprocess
    import time

    from tidal.runtime.spawner import LocalSpawner, WorkerLaunch

    script = tmp_path / "w.py"
    script.write_text("import os, sys, time\n"
                      "open(sys.argv[1] + '/' + os.environ['TIDAL_WORKER_ID'], 'w').write(os.environ['LOCAL_RANK'])\n"
                      "time.sleep(60)\n")
    sp = LocalSpawner(str(script), [str(tmp_path)], env={"PATH": "/usr/bin:/bin"}, gpus=["4", "7"])

    def local_rank(w: str) -> str:
        deadline = time.monotonic() + 20
        while not (tmp_path / w).exists() or not (tmp_path / w).read_text():
            assert time.monotonic() < deadline, f"{w} did not start"
            time.sleep(0.05)
        return (tmp_path / w).read_text()

    try:
        sp.spawn([WorkerLaunch("w0"), WorkerLaunch("w1")])
        assert (local_rank("w0"), local_rank("w1")) == ("0", "1")
        with pytest.raises(ValueError, match="2 GPU"):
            sp.spawn([WorkerLaunch("w2")])
        assert "w2" not in sp.procs  # nothing half-started
        sp.kill("w0")
        sp.procs["w0"].wait(timeout=10)
        sp.spawn([WorkerLaunch("w2")])
        assert local_rank("w2") == "0"  # w0's GPU, free again
        cpu = LocalSpawner(str(script), [str(tmp_path / "cpu")], env={"PATH": "/usr/bin:/bin"}, gpus=[])
        (tmp_path / "cpu").mkdir()
        cpu.spawn([WorkerLaunch(f"c{i}") for i in range(3)])  # no GPUs: slots without a cap
        assert [local_rank(f"cpu/c{i}") for i in range(3)] == ["0", "1", "2"]
        cpu.terminate(grace_s=5)
    finally:
        sp.terminate(grace_s=5)
        for p in sp.procs.values():
            if p.poll() is None:
                p.kill()


def test_visible_gpus_come_from_cuda_visible_devices() -> None:
    from tidal.runtime.spawner import local_gpus

    assert local_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ["2", "5"]
    assert local_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert local_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert local_gpus({}) == []  # this machine: torch counts no GPU
