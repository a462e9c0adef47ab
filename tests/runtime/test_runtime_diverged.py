"""A newcomer that takes another path through the script never hangs the
job. Here the script keeps its best evaluation in a plain variable it never
registers, and saves on rank 0 when it improves: a newcomer starts with no
best, makes one ``job.on_rank0`` call the others do not, and used to wait for
it for ever while the others waited for it in their all-reduce (the
1,800 s collective time-out would have ended it). Now it ends within 30 s
of joining, with a line naming the call site and what to register, and the
job goes on without it. A call that does not match rank 0's (another line or
step) is refused the same way (unit test)."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest

from runtime_helpers import grow_while_reading
from tidal.runtime import rank0

SCRIPT = """
import time, torch
import tidal.runtime
from torch.utils.data import DataLoader, TensorDataset

job = tidal.runtime.init()
torch.manual_seed(0)
model = job.wrap(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = job.loader(DataLoader(TensorDataset(torch.randn(256, 4), torch.randn(256, 1)), batch_size=32))
best = None  # kept by the script, never registered: a newcomer starts with None
for epoch in job.epochs(60):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        time.sleep(0.03)
    val = job.on_rank0(lambda: 1.0)  # the same every epoch
    if best is None or val < best:
        best = val
        job.on_rank0(lambda: None)  # "save the best model": only when it improved
"""


def test_a_call_that_does_not_match_rank_0s_is_refused_naming_both() -> None:
    class Store:
        def __init__(self) -> None:
            self.kv: dict[str, bytes] = {}

        def set(self, k: str, v: bytes) -> None:
            self.kv[k] = v

        def peek(self, k: str) -> bytes | None:
            return self.kv.get(k)

    s = Store()
    rank0.publish(s, rank0.Call("g1/rank0/3", "train.py:40", 120, "w0"), {"acc": 0.9})
    ok, got = rank0.await_result(s, rank0.Call("g1/rank0/3", "train.py:40", 120, "w1"), lambda: None, lambda: False)
    assert ok and got == {"acc": 0.9}
    with pytest.raises(rank0.Diverged, match=r"train.py:44 \(step 120\) met rank 0's call at train.py:40"):
        rank0.await_result(s, rank0.Call("g1/rank0/3", "train.py:44", 120, "w2"), lambda: None, lambda: False)
    with pytest.raises(rank0.Diverged, match=r"step 96"):
        rank0.await_result(s, rank0.Call("g1/rank0/3", "train.py:40", 96, "w2"), lambda: None, lambda: False)
    clock = [0.0]
    empty = Store()
    with pytest.raises(rank0.Diverged, match="while rank 0 trained on"):  # rank 0 never comes: bounded
        rank0.await_result(empty, rank0.Call("g1/rank0/4", "train.py:44", 120, "w2"), lambda: (121, "sync"),
                           lambda: False, now=lambda: clock.__setitem__(0, clock[0] + 0.6) or clock[0])
    assert pickle.loads(s.kv["g1/rank0/3"])["site"] == "train.py:40"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_newcomer_on_another_path_ends_within_30_s_naming_the_call_and_the_job_goes_on(tmp_path: Path) -> None:
    script = tmp_path / "best.py"
    script.write_text(SCRIPT)
    proc, lines, joined = grow_while_reading(script, "best", tmp_path / "home", lambda c: time.sleep(3))
    text = "".join(ln for _, ln in lines)
    hits = [(t, ln) for t, ln in lines if "took different paths" in ln]
    assert hits, text[-4000:]
    t, line = hits[0]
    assert t - joined < 30, (t - joined, line)
    assert "best.py:21" in line and "register_state" in line, line  # the call site, and what to do
    assert "finished" in text.split("summary:")[-1], text[-2000:]  # the job went on and finished
