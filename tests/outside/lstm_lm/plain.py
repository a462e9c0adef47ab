"""Outside script 6, plain: a word-level LSTM language model trained the way
the PyTorch word-language-model example trains one. One long token stream
is cut into --batch-size columns (batchify), trained in windows of --bptt
tokens (get_batch) with the hidden state carried from window to window
(repackage_hidden), parameters updated by hand with gradient clipping, the
learning rate divided by 4 when validation stops improving, and the best
model saved. Run: python plain.py --epochs 4 --out runs/
"""

import argparse
import math
import os

import torch
import torch.nn as nn


def make_corpus(n, seed):
    # a random walk over a 50-word vocabulary: each word is followed by one of 3 others
    g = torch.Generator().manual_seed(seed)
    follow = torch.randint(0, 50, (50, 3), generator=torch.Generator().manual_seed(99))
    words = [0]
    choices = torch.randint(0, 3, (n,), generator=g)
    for c in choices.tolist():
        words.append(int(follow[words[-1], c]))
    return torch.tensor(words, dtype=torch.long)


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers, self.ntoken = nhid, nlayers, ntoken

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output))
        return decoded.view(-1, self.ntoken), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data[: nbatch * bsz]
    return data.view(bsz, -1).t().contiguous()


def get_batch(source, i, bptt):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def evaluate(data_source):
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i, args.bptt)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def train():
    model.train()
    total_loss = 0.0
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i, args.bptt)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        total_loss += loss.item()
    return total_loss / (batch + 1)


parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--batch-size", type=int, default=12)
parser.add_argument("--bptt", type=int, default=20)
parser.add_argument("--lr", type=float, default=20.0)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--out", default="runs")
args = parser.parse_args()

torch.manual_seed(0)
eval_batch_size = 10
train_data = batchify(make_corpus(5000, 0), args.batch_size)
val_data = batchify(make_corpus(1000, 1), eval_batch_size)
model = RNNModel(50, 32, 48, 2)
criterion = nn.CrossEntropyLoss()
save = os.path.join(args.out, "lm.pt")

lr = args.lr
best_val_loss = None
for epoch in range(args.epochs):
    train_loss = train()
    val_loss = evaluate(val_data)
    print(f"epoch {epoch}: train loss {train_loss:.3f}, valid loss {val_loss:.3f}, ppl {math.exp(val_loss):.1f}")
    if not best_val_loss or val_loss < best_val_loss:
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.state_dict(), save)
        best_val_loss = val_loss
    else:
        lr /= 4.0

model.load_state_dict(torch.load(save))
print(f"best model: valid loss {evaluate(val_data):.3f}")
