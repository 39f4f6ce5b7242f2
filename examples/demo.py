"""A short training script with every classic pitfall safetorch catches, one per marked line. Run it as:

    python -m safetorch examples/demo.py

and each rule fires once, on the line whose comment names it. (Run as `python examples/demo.py`, nothing is
reported: the runner installs the checks without a change to the code.)
"""

import torch
import torch.nn as nn
from torch.autograd import Variable

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))
images = torch.randn(8, 3, 16, 16, dtype=torch.float64)
labels = torch.randint(0, 4, (8, 16, 16))

model.double()  # fine: Module.double() converts the module in place
images.float()  # ST001: Tensor.float() returns a copy; images is still float64

criterion = nn.CrossEntropyLoss(size_average=False)  # ST002: a sum, written the legacy way
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
total_loss = 0.0
for _step in range(3):
    loss = criterion(model(images), labels) / (16 * 16)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    total_loss += loss  # ST004: keeps every step's graph alive
print(f"training loss: {float(total_loss.detach()) / 3:.3f}")

model.eval()
val_loss = 0.0
for _step in range(12):
    val_input = Variable(images, volatile=True)  # ST005: volatile does nothing since torch 0.4
    score = model(val_input)  # ST003: eval() does not disable autograd
    val_loss += criterion(score, labels).item() / (16 * 16)
    torch.cuda.empty_cache()  # ST007: every iteration, for nothing
print(f"validation loss: {val_loss / 12:.3f}")

for _step in range(2):  # a little more training after validation, but model.train() was forgotten
    loss = criterion(model(images), labels) / (16 * 16)  # ST008: dropout and BatchNorm still in eval mode
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

model.train()
diverged = criterion(model(images), labels) * float("nan")
diverged.backward()  # ST006: a NaN loss reaching backward
