"""The seed posts' patterns that have a mechanical fix, in one script: `python -m safetorch examples/seed_posts.py`
finds them (ST001-ST005); `python -m safetorch fix --write --verify examples/seed_posts.py` rewrites them, after which
the script runs with no finding. The posts' own code ran on a GPU: `.double()` stands in for `.cuda()` here, the same
pitfall (a conversion returns a copy) on any machine.
"""

import torch
import torch.nn as nn
from torch.autograd import Variable

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))
images = torch.randn(2, 3, 16, 16)
labels = torch.randint(0, 4, (2, 16, 16))

model.double()  # Module.double() converts the module in place
images.double()  # Tensor.double() returns a copy: images is still float32

criterion = nn.CrossEntropyLoss(size_average=False)  # the sum over every pixel, written the legacy way
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
total_loss = 0.0
for _step in range(3):
    optimizer.zero_grad()
    loss = criterion(model(images), labels) / (16 * 16)  # a summed per-pixel loss, divided by H*W
    loss.backward()
    optimizer.step()
    total_loss += loss  # keeps the graph of every step alive
print(f"training loss: {total_loss / 3:.3f}")

model.eval()
val_loss = 0.0
for _step in range(4):
    val_input = Variable(images, volatile=True)  # volatile does nothing since torch 0.4
    score = model(val_input)  # eval() does not switch autograd off
    val_loss += criterion(score, labels).item() / (16 * 16)
print(f"validation loss: {val_loss / 4:.3f}")
