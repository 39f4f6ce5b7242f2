"""`safetorch._hooks.LeafHook`: a tensor hook on a parameter that leaves the parameter as torch found it."""

from __future__ import annotations

from typing import Any

import torch

from safetorch import _hooks
from safetorch._hooks import LeafHook, settle


def _backward(p: torch.Tensor) -> None:
    (p * 2).sum().backward()


def test_removed_it_leaves_no_hook_runner_and_the_hook_fired_while_it_stood() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    seen: list[torch.Tensor] = []
    hook = LeafHook(p, seen.append)
    _backward(p)
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((3,), 2.0))
    hook.remove()
    hook.remove()  # twice: nothing more
    assert p._backward_hooks is not None  # queued: a removal may come from a finalizer in the middle of a backward
    settle()
    assert p._backward_hooks is None
    _backward(p)
    assert len(seen) == 1 and torch.equal(p.grad, torch.full((3,), 4.0))


def test_a_dict_the_program_made_and_a_hook_it_added_meanwhile_are_kept() -> None:
    before = torch.nn.Parameter(torch.ones(3))
    before.register_hook(lambda g: None).remove()  # torch leaves an empty dict: not ours to take away
    LeafHook(before, lambda g: None).remove()
    settle()
    assert before._backward_hooks is not None and len(before._backward_hooks) == 0

    during = torch.nn.Parameter(torch.ones(3))
    seen: list[int] = []
    ours = LeafHook(during, lambda g: None)
    during.register_hook(lambda g: seen.append(1))
    ours.remove()
    settle()
    _backward(during)
    assert len(during._backward_hooks) == 1 and seen == [1]


def test_a_removal_from_inside_the_hook_waits_for_settle() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    holder: list[LeafHook] = []

    def fn(grad: torch.Tensor) -> None:
        holder[0].remove()  # torch's runner is calling this very function: it must not go now
        assert p._backward_hooks is not None

    holder.append(LeafHook(p, fn))
    _backward(p)
    assert p._backward_hooks is not None and not p._backward_hooks  # removed, runner still there
    settle()
    assert p._backward_hooks is None
    _backward(p)
    assert torch.equal(p.grad, torch.full((3,), 4.0))


class _Locked(torch.Tensor):
    """A tensor subclass that refuses a new hook dict once it has one."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") == "__set__" and args and args[1] is None:
            raise RuntimeError("hooks are locked")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_that_refuses_the_reset_keeps_its_empty_dict_and_nothing_raises() -> None:
    p = torch.ones(3).as_subclass(_Locked).requires_grad_()
    LeafHook(p, lambda g: None).remove()
    settle()
    assert not _hooks._queued
    assert p._backward_hooks is not None and not p._backward_hooks


_HOOK_IDS = """
import os, torch, torch.nn as nn
from torch.utils.hooks import RemovableHandle
if os.environ.get("WITH_SAFETORCH"):
    import safetorch
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.1), nn.Linear(8, 2))
ids = [model[0].register_forward_hook(lambda *a: None).id]
for opt in (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters())):
    for _ in range(40):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    model.eval()
    model(torch.randn(8, 4)).sum()  # an eval-mode forward with autograd on
    model.train()
    ids.append(model[3].register_forward_hook(lambda *a: None).id)
ids.append(RemovableHandle.next_id)
print(ids)
"""


def test_the_programs_hook_handles_get_the_ids_they_get_without_safetorch() -> None:
    # torch numbers every hook handle from one global counter; a program that prints its handles (the pruning
    # tutorial) prints the same numbers with safetorch on: its hooks are filed under keys of their own.
    from .conftest import run_python

    off, on = run_python(_HOOK_IDS), run_python(_HOOK_IDS, env={"WITH_SAFETORCH": "1"})
    assert (off.returncode, on.returncode) == (0, 0), on.stderr[-2000:]
    assert on.stdout == off.stdout and on.stdout.strip() == "[0, 1, 2, 3]"
