"""ST015 — SvenBecker/vscode-pytorch#8 (https://github.com/SvenBecker/vscode-pytorch/issues/8), "'freeze' syntax is
incorrect and PyTorch won't tell you": the extension's fine-tuning snippet froze the pretrained layers with
`param.require_grad = False`, so "PyTorch does not complain about it and keeps all params trainable". The rule reports
at the freeze's line, the one the fix changes, naming the optimizer that proves it."""
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
for param in model.parameters():
    param.require_grad = False  # ST015: the "frozen" layers are trained
model[4] = nn.Linear(8, 2)  # the new head
optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
criterion = nn.CrossEntropyLoss()
for _ in range(2):
    optimizer.zero_grad()
    criterion(model(torch.randn(4, 3, 8, 8)), torch.randint(0, 2, (4,))).backward()
    optimizer.step()
