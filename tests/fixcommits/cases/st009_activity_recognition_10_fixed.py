"""ST009 — jindongwang/Deep-learning-activity-recognition#10
(https://github.com/jindongwang/Deep-learning-activity-recognition/issues/10), acknowledged by the author: the network's
forward ended in `F.softmax`, and training gave its output to `nn.CrossEntropyLoss`, which applies log_softmax itself;
the fix returns the raw outputs."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Network(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(9, 16, kernel_size=(1, 5)), nn.ReLU(), nn.MaxPool2d((1, 2)))
        self.fc1 = nn.Linear(16 * 6, 32)
        self.fc2 = nn.Linear(32, 6)

    def forward(self, x):
        out = self.conv1(x).reshape(x.size(0), -1)
        out = F.relu(self.fc1(out))
        return self.fc2(out)


torch.manual_seed(0)
model = Network()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
criterion = nn.CrossEntropyLoss()
for _ in range(3):
    sample, target = torch.randn(4, 9, 1, 16), torch.randint(0, 6, (4,))
    output = model(sample)
    loss = criterion(output, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
