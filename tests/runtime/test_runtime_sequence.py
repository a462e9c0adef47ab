"""Sequential data and carried state: ``job.sequence`` gives the batches of
the word-language-model example's ``batchify``/``get_batch`` (without a
collate rewrite), and ``loader.carry`` moves each stream's hidden state with
the stream. An LSTM language model (float64, no dropout) trained 2 -> 3 -> 2
under ``tidal run`` ends with the parameters of the same script run alone,
which is only possible if every stream's hidden state followed it to its new
rank at both rescales (without it: new zero states, another model)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime_helpers import env, master_url
from tidal.runtime.client import MasterClient
from tidal.runtime.sequence import Windows, collate_windows

SCRIPT = '''
import sys, time, torch
import tidal.runtime

out, slow = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
job = tidal.runtime.init()
tokens = torch.randint(0, 40, (6000,), generator=torch.Generator().manual_seed(1))


class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.out = torch.nn.Embedding(40, 16), torch.nn.LSTM(16, 24), torch.nn.Linear(24, 40)

    def forward(self, x, hidden):
        y, hidden = self.rnn(self.emb(x), hidden)
        return self.out(y).view(-1, 40), hidden

    def init_hidden(self, bsz):
        return torch.zeros(1, bsz, 24), torch.zeros(1, bsz, 24)


model = job.wrap(LM())
loader = job.sequence(tokens, batch_size=6, bptt=12)
lr = 2.0
for epoch in job.epochs(3):
    hidden = model.init_hidden(6)  # for all 6 streams
    for data, targets in loader:
        model.zero_grad()
        hidden = loader.carry(hidden)  # where repackage_hidden(hidden) would be
        output, hidden = model(data, hidden)
        torch.nn.functional.cross_entropy(output, targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        if slow == "1":
            time.sleep(0.03)
job.on_rank0(lambda: torch.save(model.state_dict(), out))
'''


def test_windows_are_batchify_and_get_batch() -> None:
    data = torch.arange(103)
    ds = Windows(data, streams=4, bptt=7)  # 25 tokens a stream: windows at 0, 7, 14, 21 (the last 3 long)
    src = data[:100].view(4, 25).t()  # batchify: (nbatch, bsz)
    assert len(ds) == 4 * 4
    for w, i in enumerate(range(0, 25 - 1, 7)):
        n = min(7, 25 - 1 - i)
        x, y = collate_windows([ds[w * 4 + s] for s in range(4)])
        assert torch.equal(x, src[i : i + n]) and torch.equal(y, src[i + 1 : i + 1 + n].reshape(-1))
    with pytest.raises(ValueError, match="one long 1-D tensor"):
        Windows(data.view(1, -1), 4, 7)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_lstm_trained_2_3_2_equals_the_script_run_alone(tmp_path: Path) -> None:
    script = tmp_path / "lm.py"
    script.write_text(SCRIPT)
    home = tmp_path / "home"
    alone = subprocess.run([sys.executable, str(script), str(tmp_path / "alone.pt"), "0"], env=env(home),
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    proc = subprocess.Popen([sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", "2", "--max-workers",
                             "3", "--job", "lm", "--timeout", "200", str(script), str(tmp_path / "elastic.pt"), "1"],
                            env=env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        c = MasterClient(master_url("lm", home, proc), patience_s=10)
        c.wait_for(2, timeout_s=60)
        while c.status().step < 40:  # mid first epoch (84 windows an epoch)
            time.sleep(0.05)
        assert c.scale_out(1).accepted
        c.wait_for(3, timeout_s=90)
        at = c.status().step
        while c.status().step < at + 80:  # across an epoch boundary
            time.sleep(0.05)
        assert c.scale_in(1).accepted
        c.wait_for(2, timeout_s=60)
        text, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, text[-3000:]
    assert "2 rescale(s)" in text and "Traceback" not in text, text[-3000:]
    a, b = torch.load(tmp_path / "alone.pt"), torch.load(tmp_path / "elastic.pt")
    worst = max(((a[k] - b[k]).norm() / a[k].norm()).item() for k in a)
    assert worst < 1e-9, worst
