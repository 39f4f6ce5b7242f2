"""ST005 — keon/seq2seq#27 (https://github.com/keon/seq2seq/pull/27), "fix(evaluate): use no_grad over
volatile=True": evaluate() wrapped its batches in `Variable(..., volatile=True)`, which does nothing since torch 0.4;
the fix evaluates under `torch.no_grad()`."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Variable

torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(8 * 5, 20))


def evaluate(model, batches):
    model.eval()
    total = 0.0
    for src, trg in batches:
        src = Variable(src.data, volatile=True)  # ST005: volatile does nothing
        output = model(src)
        total += F.cross_entropy(output, trg).item()
    return total / len(batches)


batches = [(torch.randint(0, 20, (4, 5)), torch.randint(0, 20, (4,))) for _ in range(3)]
evaluate(model, batches)
