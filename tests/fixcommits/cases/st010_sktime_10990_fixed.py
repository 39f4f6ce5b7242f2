"""ST010 — sktime/sktime#10990 (https://github.com/sktime/sktime/issues/10990), fixed in sktime/sktime#11035
(https://github.com/sktime/sktime/pull/11035): `BaseDeepClassifierPytorch` accepts an optimizer instance, but the
network is built only inside `_fit`, and `_instantiate_optimizer` returned the user's instance unchanged, so
`_run_epoch`'s `self._optimizer.step()` walked parameters the loss never used while the network's gradients were
dropped; the fix re-instantiates the optimizer over `self.network.parameters()` with the instance's settings. The
rule reports the step that has nothing to update."""
import torch
import torch.nn as nn


class MLPClassifierTorch:
    def __init__(self, optimizer=None, lr=0.01, num_epochs=2):
        self.optimizer = optimizer
        self.lr = lr
        self.num_epochs = num_epochs

    def _build_network(self, n_in, n_out):
        return nn.Sequential(nn.Linear(n_in, 16), nn.ReLU(), nn.Linear(16, n_out))

    def _instantiate_optimizer(self):
        if not self.optimizer:
            return torch.optim.Adam(self.network.parameters(), lr=self.lr)
        elif isinstance(self.optimizer, torch.optim.Optimizer):
            return type(self.optimizer)(self.network.parameters(), **self.optimizer.defaults)

    def _fit(self, X, y):
        torch.manual_seed(0)
        self.network = self._build_network(X.shape[1], int(y.max()) + 1)
        self._criterion = nn.CrossEntropyLoss()
        self._optimizer = self._instantiate_optimizer()
        self.network.train()
        for _ in range(self.num_epochs):
            self._run_epoch(X, y)

    def _run_epoch(self, X, y):
        for inputs, outputs in zip(X.split(4), y.split(4), strict=True):
            y_pred = self.network(inputs)
            loss = self._criterion(y_pred, outputs)
            self._optimizer.zero_grad()
            loss.backward()
            self._optimizer.step()


torch.manual_seed(0)
X, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
user_optimizer = torch.optim.SGD(nn.Linear(6, 3).parameters(), lr=0.05, momentum=0.9)
MLPClassifierTorch(optimizer=user_optimizer)._fit(X, y)
