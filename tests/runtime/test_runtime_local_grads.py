"""Without a master (plain ``python script.py``), one rank with nothing to
reduce: the gradients the script sees, and the parameters it ends with, are
exactly those of the same loop without Tidal (the reducer leaves them where
backward put them)."""

from __future__ import annotations

import torch

from elastic_train import Pairs, make_data, make_model, make_opt


def test_local_mode_gradients_and_parameters_equal_plain_pytorch() -> None:
    from tidal.runtime import init

    x, y = make_data(48, 0)
    job = init(master_url=None, worker_id="solo")
    model = make_model(0)
    opt, sched = make_opt(model)
    job.register_state(model, opt, sched)
    ref = make_model(0)
    ref_opt, ref_sched = make_opt(ref)
    it = job.data(Pairs(x, y), batch_size=8, epochs=2, seed=0)
    steps = 0
    for xb, yb in it:
        idx = it.last_indices
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        torch.nn.functional.mse_loss(ref(x[idx]), y[idx]).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.grad is not None and torch.equal(p.grad, q.grad)
        job.step()
        sched.step()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        steps += 1
    assert steps == 12
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
