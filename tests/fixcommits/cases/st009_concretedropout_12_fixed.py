"""ST009 — danielkelshaw/ConcreteDropout#12 (https://github.com/danielkelshaw/ConcreteDropout/pull/12), for issue #11
"is softmax required?": mnist_example.py's model ended its forward in softmax, and train() gave its output to
F.cross_entropy, which applies log_softmax itself. The fix removes the forward's softmax line."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


def train(model, optimizer, batches):
    model.train()
    for data, target in batches:
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()


torch.manual_seed(0)
model = Model()
train(model, torch.optim.Adam(model.parameters(), lr=1e-3),
      [(torch.randn(8, 16), torch.randint(0, 10, (8,))) for _ in range(3)])
