"""The compiled programs of `test_compiled`, importable without safetorch: each runs in a process of its own, with
safetorch imported first (as a user's script does) or never imported at all, which is the baseline (safetorch
imported and then uninstalled is none: on Python 3.13, even an import with ``SAFETORCH_DISABLE=1`` changes how dynamo
resumes after the optimizer's own ``graph_break()``, while an installed safetorch does not)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def train_step() -> tuple[int, int]:
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters())
    backend = CompileCounter()

    @torch.compile(backend=backend)
    def train(mod: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> None:
        opt.zero_grad(True)
        pred = mod(data[0])
        loss = torch.nn.CrossEntropyLoss()(pred, data[1])
        loss.backward()
        opt.step()

    for _ in range(10):
        train(model, (torch.randn(8, 16), torch.randint(0, 4, (8,))))
    return backend.frame_count, backend.op_count


def eval_model() -> tuple[int, int]:
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.BatchNorm1d(32), nn.Linear(32, 4)).eval()
    backend = CompileCounter()
    compiled = torch.compile(model, backend=backend)
    for _ in range(5):
        compiled(torch.randn(8, 16))
    return backend.frame_count, backend.op_count


def counted(name: str) -> dict[str, Any]:
    """Graphs and ops (the backend's count) and dynamo's own counters: graph breaks by kind, resumes, recompiles,
    graphs and calls captured."""
    import warnings

    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warnings about profiler contexts in a compiled step
        graphs, ops = {"train-step": train_step, "eval-model": eval_model}[name]()
    seen: dict[str, Any] = {"graphs": graphs, "ops": ops}
    for kind in ("graph_break", "resumes", "recompiles", "stats", "unimplemented"):
        seen[kind] = {key.split("\n")[0]: n for key, n in counters[kind].items()}
    return seen
