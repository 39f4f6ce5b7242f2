"""The patch registry: uninstall restores every touched attribute by identity; no order of calls double-wraps."""

from __future__ import annotations

import itertools
import json
import sys

import pytest
import torch

import safetorch
from safetorch._patch import Registry, is_patch, registry

from .conftest import run_python


def _touched_values() -> dict[tuple[int, str], object]:
    return {(id(owner), name): owner.__dict__.get(name) for owner, name in registry.touched()}


def test_patches_are_in_the_owners_dict_and_wrap_the_original() -> None:
    if sys.version_info >= (3, 12):  # ST001's methods stay torch's own there (sys.monitoring)
        assert torch.Tensor.float is torch._C.TensorBase.float
    else:  # torch's method lives on TensorBase: the patch is added to Tensor's own dict
        patched = torch.Tensor.__dict__["float"]
        assert is_patch(patched)
        assert patched.__wrapped__ is torch._C.TensorBase.__dict__["float"]
        assert "float" not in torch._C.TensorBase.__dict__ or not is_patch(torch._C.TensorBase.__dict__["float"])
    hook = torch.Tensor.__dict__["register_hook"]  # ST003's, on every Python: torch's was in Tensor's own dict
    assert is_patch(hook) and not is_patch(hook.__wrapped__) and hook.__wrapped__.__qualname__ == "Tensor.register_hook"


def test_uninstall_restores_identity_and_deletes_what_was_added() -> None:
    detach_before = torch._C.TensorBase.__dict__["detach"]
    touched = registry.touched()
    assert touched
    safetorch.uninstall()
    assert "float" not in torch.Tensor.__dict__  # it lives on TensorBase: added by install, deleted by uninstall
    assert torch.Tensor.__dict__["detach"] is detach_before  # it was in Tensor's own dict: put back, same object
    assert torch.Tensor.float is torch._C.TensorBase.float
    assert registry.touched() == []
    assert not any(is_patch(vars(owner).get(name)) for owner, name in touched)


@pytest.mark.parametrize("steps", list(itertools.product(["install", "uninstall"], repeat=4)))
def test_every_order_of_install_and_uninstall(steps: tuple[str, ...]) -> None:
    safetorch.uninstall()
    original = dict(torch.Tensor.__dict__)
    for step in steps:
        getattr(safetorch, step)()
        if step == "install":
            for (owner_id, name), outer in _touched_values().items():
                groups = sum(1 for o, n in registry.touched() if id(o) == owner_id and n == name)
                depth, layer = 0, outer
                while is_patch(layer):
                    depth, layer = depth + 1, layer.__wrapped__
                assert depth == (groups if is_patch(outer) else 0), name  # one layer per check, never two
        else:
            assert registry.touched() == []
    safetorch.uninstall()
    after = dict(torch.Tensor.__dict__)
    assert after.keys() == original.keys() and all(after[k] is original[k] for k in original)


def test_install_with_ignore_switches_checks_on_and_off() -> None:
    assert "ST001" in safetorch.installed_checks()
    safetorch.install(ignore=["discarded-conversion"])
    assert "ST001" not in safetorch.installed_checks()
    assert "float" not in torch.Tensor.__dict__
    safetorch.install(ignore="")
    assert "ST001" in safetorch.installed_checks()


def test_a_replacement_made_after_us_is_left_alone() -> None:
    class Owner:
        def method(self) -> int:
            return 1

    reg = Registry()
    reg.wrap(Owner, "method", lambda w, i, a, k: w(*a, **k) + 1, "test")
    assert Owner().method() == 2

    def theirs(self: Owner) -> int:
        return 3

    Owner.method = theirs  # type: ignore[method-assign]
    reg.restore()
    assert Owner.__dict__["method"] is theirs


def test_wrapping_an_existing_patch_adds_no_layer() -> None:
    class Owner:
        def method(self) -> int:
            return 1

    first, second = Registry(), Registry()  # e.g. two copies of the module after a reload
    p1 = first.wrap(Owner, "method", lambda w, i, a, k: w(*a, **k) + 1, "a")
    p2 = second.wrap(Owner, "method", lambda w, i, a, k: w(*a, **k) + 10, "b")
    assert p1 is p2 and is_patch(p1)
    assert Owner().method() == 2


SNAPSHOT = r"""
import json, sys, torch, torch.nn, torch.nn.functional, torch.autograd, torch.cuda, torch.optim.optimizer
namespaces = {"Tensor": torch.Tensor, "TensorBase": torch._C.TensorBase, "F": torch.nn.functional,
              "Module": torch.nn.Module, "torch": torch, "autograd": torch.autograd, "cuda": torch.cuda,
              "Variable": torch.autograd.Variable, "optim": torch.optim.Optimizer, "sys": sys,
              "_reduction": torch.nn._reduction, "jit": torch.jit, "optimizer": sys.modules["torch.optim.optimizer"],
              "enable_grad": torch.autograd.grad_mode.enable_grad, "no_grad": torch.autograd.grad_mode.no_grad,
              "set_grad_enabled": torch.autograd.grad_mode.set_grad_enabled, "cuda.memory": torch.cuda.memory,
              "inference_mode": torch.autograd.grad_mode.inference_mode,
              "VariableMeta": type(torch.autograd.Variable), "GradScaler": torch.amp.GradScaler,
              "nn.utils": torch.nn.utils, "clip_grad": sys.modules["torch.nn.utils.clip_grad"],
              "GraphModule": torch.fx.GraphModule, "distributed": torch.distributed,
              "DDP": torch.nn.parallel.DistributedDataParallel}
import torch.nn.modules.loss as L
for n, c in vars(L).items():
    if isinstance(c, type):
        namespaces["loss." + n] = c
before = {k: dict(vars(v)) for k, v in namespaces.items()}
"""


def test_uninstall_restores_every_touched_namespace_exactly_in_a_fresh_process() -> None:
    code = SNAPSHOT + r"""
import safetorch
from safetorch._patch import registry
touched = {id(o) for o, _ in registry.touched()}
known = {id(v) for v in namespaces.values()}
assert touched <= known, [repr(o) for o, _ in registry.touched() if id(o) not in known]
assert touched, "nothing was patched"
for _ in range(2):
    safetorch.install(); safetorch.install(); safetorch.uninstall(); safetorch.uninstall()
bad = []
for k, v in namespaces.items():
    after = dict(vars(v))
    if after.keys() != before[k].keys():
        bad.append((k, sorted(set(after) ^ set(before[k]))))
    bad += [(k, n) for n in before[k] if n in after and after[n] is not before[k][n]]
print(json.dumps({"bad": [str(b) for b in bad], "touched": len(touched)}))
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bad"] == []


def test_disable_patches_nothing_in_a_fresh_process() -> None:
    code = SNAPSHOT + r"""
import safetorch
safetorch.install()  # the kill switch wins over an explicit call too
bad = [k for k, v in namespaces.items() if dict(vars(v)) != before[k]
       or any(vars(v)[n] is not before[k][n] for n in before[k])]
from safetorch._patch import registry
print(json.dumps({"bad": bad, "touched": len(registry.touched()), "checks": safetorch.installed_checks()}))
"""
    proc = run_python(code, env={"SAFETORCH_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"bad": [], "touched": 0, "checks": []}


def test_import_then_install_twice_in_a_fresh_process_wraps_once() -> None:
    code = r"""
import torch, safetorch, importlib
safetorch.install(); safetorch.install(strict=False)
import safetorch._patch as p
importlib.reload(p)  # a second copy of the registry must not add a layer either
p.registry.wrap(torch.Tensor, "float", lambda w, i, a, k: w(*a, **k), "again")
f = torch.Tensor.__dict__["float"]
print(type(f.__wrapped__).__name__)
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "method_descriptor"


def test_two_groups_layer_on_one_attribute_and_restore_in_any_order() -> None:
    class Owner:
        def method(self) -> list[str]:
            return ["original"]

    original = Owner.__dict__["method"]
    for first, second in (("a", "b"), ("b", "a")):
        reg = Registry()
        reg.wrap(Owner, "method", lambda w, i, a, k: ["a", *w(*a, **k)], "a")
        reg.wrap(Owner, "method", lambda w, i, a, k: ["b", *w(*a, **k)], "b")
        reg.wrap(Owner, "method", lambda w, i, a, k: ["again", *w(*a, **k)], "a")  # same group: no new layer
        assert Owner().method() == ["b", "a", "original"]
        reg.restore(first)
        assert Owner().method() == [second, "original"]
        reg.restore(second)
        assert Owner.__dict__["method"] is original


def test_wrapt_c_extension_is_in_use_and_its_absence_is_said() -> None:
    from safetorch._patch import wrapt_c_extension

    assert wrapt_c_extension()
    proc = run_python("import warnings, torch, safetorch", env={"WRAPT_DISABLE_EXTENSIONS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "wrapt's C extension is not in use" in proc.stderr


def test_a_plain_replacement_inspects_pickles_and_restores_as_the_original() -> None:
    import inspect
    import pickle

    train = torch.nn.Module.__dict__["train"]
    assert is_patch(train) and train.__wrapped__ is not train
    assert (train.__name__, train.__qualname__, train.__module__) == ("train", "Module.train",
                                                                      "torch.nn.modules.module")
    original = train.__wrapped__
    assert inspect.signature(torch.nn.Module.train) == inspect.signature(original)
    assert pickle.loads(pickle.dumps(train)) is train  # by reference: torch.nn.modules.module.Module.train
    backward = torch.autograd.backward
    assert is_patch(backward) and pickle.loads(pickle.dumps(backward)) is backward
    safetorch.uninstall()
    assert torch.nn.Module.__dict__["train"] is original
    safetorch.install()
    assert torch.nn.Module.__dict__["train"] is not original


def test_a_plain_replacement_is_the_first_layer_or_none() -> None:
    class Owner:
        def method(self) -> int:
            return 1

    reg = Registry()
    reg.wrap(Owner, "method", lambda w, i, a, k: w(*a, **k) + 1, "wrapt")
    with pytest.raises(ValueError, match="first patch"):
        reg.replace(Owner, "method", lambda original: original, "plain")
    reg.restore()
    plain = reg.replace(Owner, "method", lambda original: lambda self: original(self) + 10, "plain")
    assert Owner().method() == 11 and is_patch(plain) and plain.__wrapped__ is not plain
    reg.restore()
    assert Owner().method() == 1 and not is_patch(Owner.__dict__["method"])


def test_patched_tensor_methods_introspect_as_torchs() -> None:
    """``inspect.signature`` of a bound patched method, its docs and ``__objclass__`` are torch's own."""
    import inspect

    x = torch.ones(2, requires_grad=True)
    patched = (inspect.signature(x.register_hook), x.float.__doc__, torch.Tensor.float.__objclass__,
               inspect.isroutine(torch.Tensor.float), inspect.ismethoddescriptor(torch.Tensor.float))
    safetorch.uninstall()
    try:
        plain = (inspect.signature(x.register_hook), x.float.__doc__, torch.Tensor.float.__objclass__,
                 inspect.isroutine(torch.Tensor.float), inspect.ismethoddescriptor(torch.Tensor.float))
    finally:
        safetorch.install()
    assert patched == plain and str(patched[0]) == "(hook)"
    import pydoc

    shown = pydoc.render_doc(torch.Tensor.float)
    assert "self.float()`` is equivalent to ``self.to(torch.float32)``" in shown and "safetorch" not in shown


def test_functions_the_program_imported_before_safetorch_are_checked_and_restored() -> None:
    code = r"""
import torch
from torch.nn.utils import clip_grad_norm_
from torch.nn.functional import dropout
from torch.autograd import backward
import safetorch
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
opt.zero_grad()
scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
clip_grad_norm_(model.parameters(), 1.0)
backward((torch.ones(1, requires_grad=True) * float("nan")).sum())
print("checked", [s.code for s in safetorch._report.findings()])
safetorch.uninstall()
print("restored", clip_grad_norm_ is torch.nn.utils.clip_grad.clip_grad_norm_,
      dropout is torch.nn.functional.dropout, backward is torch.autograd.backward)
"""
    proc = run_python(code, env={"SAFETORCH_REPORT": "0"})
    assert proc.returncode == 0, proc.stderr
    assert "checked ['ST012', 'ST006']" in proc.stdout
    assert "restored True True True" in proc.stdout
