"""Threads: train and eval forwards, grad-mode context managers and conversions, 4 threads x hundreds of steps."""

from __future__ import annotations

import threading
import warnings

import torch

import safetorch

from .models import convnet

with open(__file__) as _fh:
    EVAL_LINE = next(n for n, line in enumerate(_fh, 1) if line.rstrip().endswith("# EVAL_LINE"))


def test_four_threads_of_train_and_eval() -> None:
    errors: list[str] = []
    barrier = threading.Barrier(4)

    def worker(kind: int) -> None:
        torch.manual_seed(kind)
        model = convnet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(2, 3, 8, 8)
        barrier.wait()  # (the main thread catches the warnings: catch_warnings() in a thread is not thread-safe)
        for i in range(150):
            if (i + kind) % 3 == 0:
                model.eval()
                # eval without no_grad: the first forward is watched (as written), the next ones keep no
                # activations (saved-tensor hooks are per thread: these see what a plain forward saves)
                packed: list[int] = []
                with torch.autograd.graph.saved_tensors_hooks(lambda t, p=packed: p.append(1) or t.detach(),
                                                              lambda t: t):
                    model(x.double().float())  # EVAL_LINE
                if packed and i >= 3:
                    errors.append("eval forward kept its activations")
                with torch.no_grad():
                    model(x)
                with torch.enable_grad():
                    if not model(x).requires_grad:
                        errors.append("enable_grad lost")
            else:
                model.train()
                loss = model(x.contiguous()).pow(2).mean()  # bounded below: it never reaches -inf
                opt.zero_grad()
                loss.backward()
                opt.step()
                if not all(p.grad is not None for p in model.parameters() if p.requires_grad):
                    errors.append("training step lost gradients")
            if not torch.is_grad_enabled():
                errors.append("grad mode left off")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    # the one finding the evaluation provokes on purpose, at its line (once per call site; a race may show it twice)
    found = {(w.category, w.lineno) for w in caught if issubclass(w.category, safetorch.SafetorchWarning)}
    assert found == {(safetorch.EvalModeGradWarning, EVAL_LINE)}
    assert torch.is_grad_enabled()
