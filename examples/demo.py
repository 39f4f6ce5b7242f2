"""A short training script with every classic pitfall safetorch catches, one per marked line. Run it as:

    python -m safetorch examples/demo.py

and each rule fires once, on the line whose comment names it. (Run as `python examples/demo.py`, nothing is
reported: the runner installs the checks without a change to the code.)
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Variable

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))
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
    loss = criterion(model(images), labels) / (16 * 16)  # ST008: BatchNorm still in eval mode
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

model.train()
diverged = criterion(model(images), labels) * float("nan")
diverged.backward()  # ST006: a NaN loss reaching backward

# Beyond the seed posts: the silent training bugs of ST009-ST018.
probs = model(images).softmax(dim=1)
criterion(probs, labels)  # ST009: cross_entropy applies log_softmax itself: pass the logits

head = nn.Linear(4, 4).double()
head_optimizer = torch.optim.SGD(head.parameters(), lr=0.01)
head.requires_grad_(False)  # frozen after its optimizer was built: nothing left to train
features = model(images).permute(0, 2, 3, 1)
head(features).sum().backward()
head_optimizer.step()  # ST010: none of the parameters it holds has a gradient

probe = nn.Linear(4, 4).double()
probe_optimizer = torch.optim.SGD(probe.parameters(), lr=0.01)
for _step in range(2):
    probe(features.detach()).sum().backward()
    probe_optimizer.step()  # ST011: zero_grad() forgotten: each step uses every earlier step's gradients

scaler = torch.amp.GradScaler("cpu")
optimizer.zero_grad()
scaler.scale(criterion(model(images), labels)).backward()
nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # ST012: clips gradients still scaled by 65536
scaler.step(optimizer)
scaler.update()


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.dropout(x, 0.5))  # ST013: training= defaults to True: dropout stays on in eval


classifier = Classifier().double().eval()
classifier(features)

checkpoint = {f"module.{k}": v for k, v in model.state_dict().items()}  # saved from DataParallel
model.load_state_dict(checkpoint, strict=False)  # ST014: loaded nothing: the keys start with 'module.'

backbone = nn.Linear(4, 4)
backbone.requires_grad = False  # ST015: an attribute, not requires_grad_(False): the backbone will be trained
torch.optim.SGD(backbone.parameters(), lr=0.01)  # what proves it: the optimizer holds the backbone's parameters

# A wrapper that keeps master weights and copies them back after every step, built after the optimizer.
master = [p.detach().clone() for p in probe.parameters()]


def put_back(*_: object) -> None:
    for p, m in zip(probe.parameters(), master, strict=True):
        p.data.copy_(m)


probe_optimizer.register_step_post_hook(put_back)
probe_optimizer.zero_grad()
probe(features.detach()).sum().backward()
probe_optimizer.step()  # ST018: finite gradients, lr > 0, and not one weight moved

# A perceptual loss: the features of a fixed network compared; eval() was meant to freeze it, and does not.
loss_net = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()).double().eval()
for _step in range(4):
    optimizer.zero_grad()
    perceptual = loss_net(model(images)).pow(2).mean()
    perceptual.backward()  # ST020: loss_net's gradients, which no optimizer holds, grow every step
    optimizer.step()

# A test loop left in training mode: BatchNorm folds the test batches into its running statistics.
test_batches = [torch.randn(8, 3, 16, 16, dtype=torch.float64) for _ in range(6)]
test_scores = [model(batch).argmax(1) for batch in test_batches]  # ST019: neither model.eval() nor no_grad()

# A NaN check that can never fire: NaN equals nothing, itself included.
if perceptual.item() == float("nan"):  # ST021: always False: write math.isnan(perceptual.item())
    print("the loss is NaN")

# A loader that refills one buffer and keeps a tensor of it per batch: every kept batch is that one buffer.
buffer = np.zeros((2, 3), dtype=np.float32)
kept_batches = []
for fill in range(3):
    buffer[:] = fill
    kept_batches.append(torch.from_numpy(buffer))  # ST022: no copy: all three batches show the last fill

# ST016 and ST017 need a DistributedDataParallel job of several ranks: see tests/distributed_job.py.
