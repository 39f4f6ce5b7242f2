"""ST005 — facebookresearch/SentEval#42 (https://github.com/facebookresearch/SentEval/pull/42), "Remove volatile
option and use torch.no_grad()": the classifier's scoring wrapped its batches in `Variable(..., volatile=True)`, which
has no effect since torch 0.4; the fix runs them under `torch.no_grad()`."""
import torch
import torch.nn as nn
from torch.autograd import Variable


def score(model, devX, devy, batch_size=4):
    model.eval()
    correct = 0
    for i in range(0, len(devX), batch_size):
        Xbatch = Variable(devX[i:i + batch_size], volatile=True)  # ST005: volatile does nothing
        output = model(Xbatch)
        correct += (output.argmax(1) == devy[i:i + batch_size]).sum().item()
    return correct / len(devX)


torch.manual_seed(0)
score(nn.Sequential(nn.Linear(8, 3)), torch.randn(12, 8), torch.randint(0, 3, (12,)))
