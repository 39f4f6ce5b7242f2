"""An evaluation that changes the model it measures: `python -m safetorch examples/eval_loop_in_train_mode.py` (ST019).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 10), torch.randint(0, 3, (64,))
test_batches = [torch.randn(64, 10) * 3 + 1 for _ in range(8)]  # a test set that looks unlike the training set
for epoch in range(2):
    for _step in range(5):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    predictions = [model(batch).argmax(1) for batch in test_batches]  # neither model.eval() nor torch.no_grad()
    seen = model[1].num_batches_tracked.item()
    print(f"epoch {epoch}: loss {loss.item():.3f}; BatchNorm counted {seen} batches, {8 * (epoch + 1)} of them test")
