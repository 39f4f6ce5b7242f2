"""ST003 — skorch-dev/skorch#219 (https://github.com/skorch-dev/skorch/pull/219), for issue #218: validation_step put
the module in eval mode and called `infer`, which train_step shares, with autograd on: every validation batch kept
its activations until the GPU ran out of memory. The fix wraps validation_step's work in `torch.no_grad()`."""
import torch
import torch.nn as nn


class NeuralNet:
    def __init__(self):
        torch.manual_seed(0)
        self.module_ = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.optimizer_ = torch.optim.SGD(self.module_.parameters(), lr=0.1)
        self.criterion_ = nn.CrossEntropyLoss()

    def infer(self, x):
        return self.module_(x)

    def train_step(self, xi, yi):
        self.module_.train()
        self.optimizer_.zero_grad()
        loss = self.criterion_(self.infer(xi), yi)
        loss.backward()
        self.optimizer_.step()
        return loss.item()

    def validation_step(self, xi, yi):
        self.module_.eval()
        y_pred = self.infer(xi)  # ST003: eval() does not turn autograd off
        loss = self.criterion_(y_pred, yi)
        return {"loss": loss.item(), "y_pred": y_pred}

    def fit(self, x, y, epochs=2):
        for _ in range(epochs):
            for xi, yi in zip(x.split(4), y.split(4), strict=True):
                self.train_step(xi, yi)
            for xi, yi in zip(x.split(2), y.split(2), strict=True):
                self.validation_step(xi, yi)


NeuralNet().fit(torch.randn(8, 4), torch.randint(0, 2, (8,)))
