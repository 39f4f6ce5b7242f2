"""ST005: Variable(..., volatile=True) is reported at the user's line instead of torch's anonymous warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.autograd import Variable

import safetorch
from safetorch import SafetorchError, VolatileVariableWarning

from .conftest import findings, lineno


def test_volatile_keyword_and_positional() -> None:
    x = torch.ones(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        v = Variable(x, volatile=True); first = lineno()  # noqa: E702
        p = Variable(x, False, True); second = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in caught] == [
        (VolatileVariableWarning, __file__, first), (VolatileVariableWarning, __file__, second)]
    assert str(caught[0].message).startswith("ST005 Variable(..., volatile=True) has no effect since torch 0.4")
    assert "Write: `with torch.no_grad():`" in str(caught[0].message)
    assert torch.equal(v, x) and torch.equal(p, x) and not v.requires_grad


def test_other_uses_are_silent_and_unchanged() -> None:
    x = torch.ones(2)
    with findings() as got:
        a = Variable(x)
        b = Variable(x, requires_grad=True)
        c = Variable(x, volatile=False)
    assert got == []
    assert b.requires_grad and not a.requires_grad and not c.requires_grad
    assert isinstance(x, Variable)  # the metaclass's isinstance is untouched


def test_strict_mode_raises() -> None:
    safetorch.install(strict=True)
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        Variable(torch.ones(2), volatile=True)
    assert (info.value.code, info.value.lineno) == ("ST005", line)
