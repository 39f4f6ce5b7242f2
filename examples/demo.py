"""A short training script with the classic PyTorch pitfalls in it. Run it through safetorch:

    python -m safetorch examples/demo.py      (or: python examples/demo.py, which imports safetorch itself)

Each pitfall sits on its own line; safetorch reports each one there, once.
"""

import torch

import safetorch  # noqa: F401  (one line: every check is installed)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1))
tensor = torch.zeros(2, 3, 10, 10, dtype=torch.float64)

model.double()  # fine: Module.double() converts the module in place
tensor.float()  # ST001: Tensor.float() returns a copy; `tensor` is still float64

print("output:", tuple(model(tensor).shape))
