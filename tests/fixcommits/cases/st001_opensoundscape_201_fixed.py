"""ST001 — kitzeslab/opensoundscape#201 (https://github.com/kitzeslab/opensoundscape/pull/201), "Fix CUDA semantics for
torch.train and torch.predict": `X.cuda()` returns a copy and leaves `X` where it was; the fix writes `X = X.cuda()`.
The same call, on the device this machine has."""
import torch
import torch.nn as nn


def predict(model, batches, device):
    model.to(device)
    model.eval()
    scores = []
    with torch.no_grad():
        for X in batches:
            X = X.to(device)
            scores.append(model(X))
    return torch.cat(scores)


torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
predict(nn.Sequential(nn.Flatten(), nn.Linear(16, 2)), [torch.randn(2, 1, 4, 4) for _ in range(3)], device)
