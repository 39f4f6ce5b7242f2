"""``python -m bench.nosync [--device cpu|cuda] [--steps N]``: does safetorch ever make the host wait for the device?

A training loop on the device with every rule on and every look taken (an optimizer's first steps, a sample window
crossed: more than 1024 backwards), which also makes the mistakes whose checks read a device value later (ST006 a
NaN loss, ST011 a forgotten ``zero_grad()``, ST012 a clip before ``unscale_``) and the others once each. The loop
itself never reads a device value (no ``item()``, no ``GradScaler.step``, which does).

- On CUDA it runs under ``torch.cuda.set_sync_debug_mode("error")``: any synchronising call raises.
- On the CPU (with ``SAFETORCH_DEFERRED_CPU=1``, so that CPU tensors take the accelerator path) it runs under
  `Reads`, which records every read of a tensor's value into Python (``item``, ``bool``, ``tolist``, ``float``,
  ``equal``...) made from safetorch's code, except of the host memory that `safetorch._deferred` reads once the
  device has written it.

Prints one JSON object: ``reads`` (where safetorch read a device value: must be empty), ``findings`` (code, line) and
``lines`` (the loop's marked lines by code).
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import sys
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + "safetorch" + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep

#: What reads a tensor's value into Python: the methods and functions, wrapped while `Reads` is active.
_METHODS = ("item", "__bool__", "tolist", "__float__", "__int__", "__index__", "__complex__", "__repr__",
            "__format__")
_FUNCTIONS = ("equal", "allclose", "is_nonzero")
#: The lines where safetorch calls torch's function on the program's behalf: what torch reads below them is torch's.
_FORWARDS = ("wrapped(", "original(", "_module_call_impl(", "_checkpoint(",
             "_same_state(")  # ST003's act comparing generator states: host ByteTensors, whatever the device


class Reads:
    """Records the reads of tensor values into Python made from safetorch's code (its frames, or torch's code that
    safetorch called for itself), except of the host memory that `safetorch._deferred` reads once written. The
    methods are wrapped on ``torch.Tensor`` (a ``TorchFunctionMode`` would not see what runs inside a backward: a
    mode is off while its handler runs the function). A read inside a C++ operator is not seen; on CUDA
    ``set_sync_debug_mode("error")`` sees those."""

    def __init__(self) -> None:
        from safetorch import _deferred

        self.found: list[str] = []
        self._deferred = _deferred
        self._saved: list[tuple[Any, str, Any]] = []

    def _host(self, args: tuple[Any, ...]) -> bool:
        buffers = {b.untyped_storage().data_ptr() for b in self._deferred.host_buffers()}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return bool(tensors) and all(t.untyped_storage().data_ptr() in buffers for t in tensors)

    def _record(self, name: str, args: tuple[Any, ...]) -> None:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(_PACKAGE) or self._host(args):
            return
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        if not any(f in line for f in _FORWARDS):
            self.found.append(f"{name} at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} "
                              f"({frame.f_code.co_name})")

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def read(*args: Any, **kwargs: Any) -> Any:
            self._record(name, args)
            return original(*args, **kwargs)

        self._saved.append((owner, name, owner.__dict__.get(name, _ABSENT)))
        setattr(owner, name, read)

    def __enter__(self) -> Reads:
        for name in _METHODS:
            self._wrap(torch.Tensor, name)
        for name in _FUNCTIONS:
            self._wrap(torch, name)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, previous in reversed(self._saved):
            if previous is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
        self._saved.clear()


_ABSENT = object()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1),
                                  nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(F.dropout(x, 0.1, training=self.training))


class _Leaky(nn.Module):  # ST013's mistake
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.dropout(x, 0.5))  # ST013


def loop(device: str, steps: int) -> dict[str, list[int]]:
    """The loop; returns the line of each mistake it makes, by code."""
    from torch.autograd import Variable

    here = loop.__code__.co_firstlineno
    lines: dict[str, list[int]] = {}

    def mark(code: str) -> None:
        lines.setdefault(code, []).append(sys._getframe(1).f_lineno)

    torch.manual_seed(0)
    model = _Net().to(device)
    x = torch.randn(8, 16, device=device)
    y = torch.randint(0, 10, (8,), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    del here
    criterion(model(x).softmax(dim=1), y); mark("ST009")  # noqa: E702  (among the first losses: ST009 looks at all)
    # A correct loop first, long enough to cross a sample window of ST010/ST011 (1024 backwards).
    for _ in range(steps):
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()
    with torch.no_grad():
        for _ in range(4):
            model(x)
    model.train()
    # AMP: scale, a clip before unscale_ (ST012), unscale_, step, update; GradScaler.step would read found_inf.
    scaler = torch.amp.GradScaler(device)
    for _ in range(3):
        optimizer.zero_grad()
        scaler.scale(criterion(model(x), y)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0); mark("ST012")  # noqa: E702
        scaler.unscale_(optimizer)
        optimizer.step()
        scaler.update()
    # A loss that stays NaN, as a diverged one does (ST006; on a device one backward in 32 is looked at, after the
    # first 64), then one more step that is fine.
    for _ in range(33):
        criterion(model(x), y).mul(float("nan")).backward(); mark("ST006")  # noqa: E702
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    # zero_grad() forgotten on a probe (ST011).
    probe = nn.Linear(10, 10).to(device)
    probe_optimizer = torch.optim.SGD(probe.parameters(), lr=0.01)
    features = model(x).detach()
    for _ in range(3):
        probe(features).sum().backward()
        probe_optimizer.step(); mark("ST011")  # noqa: E702
    # The others, once each.
    x.float(); mark("ST001")  # noqa: E702
    nn.CrossEntropyLoss(size_average=False); mark("ST002")  # noqa: E702
    total = 0.0
    for _ in range(3):
        loss = criterion(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss; mark("ST004")  # noqa: E702
    Variable(x, volatile=True); mark("ST005")  # noqa: E702
    for _ in range(12):
        torch.cuda.empty_cache(); mark("ST007")  # noqa: E702
    model.eval()
    for _ in range(3):
        score = model(x); mark("ST003")  # noqa: E702
    for _ in range(3):  # training again, without model.train()
        loss = criterion(model(x), y); mark("ST008")  # noqa: E702
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.train()
    head = nn.Linear(10, 10).to(device)
    head_optimizer = torch.optim.SGD(head.parameters(), lr=0.01)
    head.requires_grad_(False)
    head(model(x)).sum().backward()
    head_optimizer.step(); mark("ST010")  # noqa: E702
    _Leaky().to(device).eval()(features); mark("ST013")  # noqa: E702
    model.load_state_dict({f"module.{k}": v for k, v in model.state_dict().items()}, strict=False); mark("ST014")  # noqa: E501,E702
    frozen = nn.Linear(4, 4).to(device)
    frozen.requires_grad = False; mark("ST015")  # noqa: E702  (found when the optimizer below is built)
    torch.optim.SGD(frozen.parameters(), lr=0.01)
    del score, total
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.nosync")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=1100)
    args = parser.parse_args(argv)
    import safetorch
    from safetorch import _deferred, _report

    safetorch.install()
    reads: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if args.device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
            try:
                lines = loop("cuda", args.steps)
            except RuntimeError as exc:
                lines, reads = {}, [f"{type(exc).__name__}: {exc}"]
            finally:
                torch.cuda.set_sync_debug_mode(0)
        else:
            with Reads() as recorder:
                lines = loop("cpu", args.steps)
                _deferred.poll(wait=True)
            reads = recorder.found
        _deferred.poll(wait=True)
    findings = sorted((s.code, s.lineno) for s in _report.findings())
    print(json.dumps({"device": args.device, "deferred_cpu": _deferred.FORCED, "reads": reads,
                      "findings": findings, "lines": lines}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
