"""A step dropped because a peer died leaves gradients as tensors, as DDP
does, never None: a script that updates its parameters by hand
(``p.data.add_(p.grad, alpha=-lr)``, the word-language-model example's way)
survives a worker's death. Its registered optimizers skip that step (zero
gradients would still move parameters through momentum or weight decay).
The run's summary shows the recovery's pause as the workers measured it."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime_helpers import env
from tidal.runtime.capture import LateOptimizerGuard
from tidal.runtime.state import ElasticState


def test_a_registered_optimizer_skips_a_dropped_step_and_the_script_sees_zero_gradients() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # a momentum buffer that a zero-gradient step would still apply
    dropped = [True]
    guard = LateOptimizerGuard(ElasticState(model, opt), lambda: None, dropped=lambda: dropped[0])
    try:
        before = [p.detach().clone() for p in model.parameters()]
        bufs = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # what the reducer leaves after a dropped step
        opt.step()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert all(torch.equal(b, opt.state[p]["momentum_buffer"]) for b, p in zip(bufs, model.parameters()))
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())  # tensors, for the script
        dropped[0] = False
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()  # the next step is a real one
        assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    finally:
        guard.remove()


MANUAL = """
import os, sys, torch
import tidal.runtime
from torch.utils.data import DataLoader, TensorDataset

job = tidal.runtime.init()
torch.manual_seed(0)
model = job.wrap(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
data = TensorDataset(torch.randn(1536, 8), torch.randn(1536, 1))
loader = job.loader(DataLoader(data, batch_size=48, shuffle=True))
lr = 0.05
for epoch in job.epochs(4):
    for x, y in loader:
        if job.step_count == 12 and os.environ.get("TIDAL_WORKER_ID") == "w2":
            os._exit(3)  # a worker dies in the middle of the job
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)  # by hand, as the word-language-model example does
        job.step(optimizer_step=False)
digest = sum(float(p.detach().double().sum()) for p in model.parameters())
print(f"DONE {os.environ.get('TIDAL_WORKER_ID')} {digest:.12f}", flush=True)
"""


@pytest.mark.slow  # 15-25 s of a 3-worker job: CI's second step
@pytest.mark.timeout(180)
def test_a_script_that_updates_by_hand_survives_a_workers_death(tmp_path: Path) -> None:
    script = tmp_path / "manual.py"
    script.write_text(MANUAL)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", "3", "--job", "manual",
                        "--timeout", "150", str(script)], env=env(tmp_path / "home"), capture_output=True, text=True,
                       timeout=170)
    out = p.stdout + p.stderr
    assert "NoneType" not in out and "Traceback" not in out, out[-4000:]
    done = re.findall(r"DONE (w\d+) (-?[0-9.]+)", out)  # the two ranks' lines may interleave
    assert sorted(w for w, _ in done) == ["w0", "w1"], out[-3000:]  # both survivors finished
    assert len({d for _, d in done}) == 1, done  # with equal parameters
    # the summary's recovery shows the pause the workers measured (it said 0.0 ms)
    pauses = [float(m) for m in re.findall(r"recover 3->2 at step \d+, pause ([0-9.]+) ms", out)]
    assert len(pauses) == 1 and pauses[0] > 0.0, out[-3000:]
    assert time.monotonic() - t0 < 170


def test_a_worker_that_left_gets_an_error_from_the_runtime_not_a_made_up_value(monkeypatch) -> None:
    """Code a leaver still runs on its way out (a ``finally``) gets a clear
    error from ``on_rank0`` and ``step``, never a result nobody computed."""
    import tidal.runtime

    from tidal import settings

    monkeypatch.delenv(settings.MASTER_URL.name, raising=False)
    job = tidal.runtime.init()
    job.left = True
    with pytest.raises(RuntimeError, match="left the job: job.on_rank0"):
        job.on_rank0(lambda: 1.0)
    with pytest.raises(RuntimeError, match="left the job: job.step"):
        job.step()
