"""ST013: F.dropout without training= in the forward of an eval-mode module."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import safetorch
from safetorch import EvalModeGradWarning, FunctionalDropoutInEvalWarning, SafetorchError

from .conftest import findings


class Forgetful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.fc(x), 0.5)  # the line


class Careful(nn.Module):
    def __init__(self, mc: bool = False) -> None:
        super().__init__()
        self.fc, self.drop, self.mc = nn.Linear(8, 8), nn.Dropout(0.5), mc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.fc(x))
        h = F.dropout(h, 0.5, self.training)
        h = F.dropout2d(h.view(1, 8, 1, 1), p=0.1, training=self.training).view(1, 8)
        h = F.dropout(h, p=0.0)  # p=0 drops nothing, in any mode
        return F.dropout(h, 0.5, training=True) if self.mc else h  # MC dropout, on purpose


def _line(marker: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(Forgetful.forward)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def test_forgotten_training_warns_at_the_dropout_line_once_in_eval() -> None:
    model = Forgetful()
    x = torch.ones(1, 8)
    with findings() as got:
        model(x)  # training mode: dropping is right
        model.eval()
        model(x)
        model(x)
    # the two eval-mode forwards without no_grad are ST003's too, at their own line: another rule's finding
    got = [w for w in got if w.category is not EvalModeGradWarning]
    assert [(w.category, w.filename, w.lineno) for w in got] == [(FunctionalDropoutInEvalWarning, __file__,
                                                                  _line("# the line"))]
    message = str(got[0].message)
    assert message.startswith("ST013 `F.dropout(self.fc(x), 0.5)` in Forgetful.forward() keeps dropping after")
    assert "Pass training=self.training (or use nn.Dropout)" in message


def test_the_numbers_are_torchs() -> None:
    model = Forgetful().eval()
    torch.manual_seed(0)
    with findings():
        on = model(torch.ones(1, 8))
    safetorch.uninstall()
    torch.manual_seed(0)
    off = model(torch.ones(1, 8))
    safetorch.install()
    assert torch.equal(on, off)


@pytest.mark.parametrize("mc", [False, True])
def test_look_alikes_stay_silent(mc: bool) -> None:
    model = Careful(mc)
    with findings() as got:
        model(torch.ones(1, 8))
        model.eval()
        model(torch.ones(1, 8))
        F.dropout(torch.ones(4), 0.5)  # not in a module's forward
    assert got == []


def test_multi_head_attention_in_eval_stays_silent() -> None:
    mha = nn.MultiheadAttention(8, 2, dropout=0.5).eval()
    x = torch.ones(3, 1, 8)
    with findings() as got:
        mha(x, x, x)
    assert got == []


def test_strict_mode_raises() -> None:
    safetorch.install(strict=True)
    with pytest.raises(SafetorchError) as info:
        Forgetful().eval()(torch.ones(1, 8))
    assert (info.value.code, info.value.lineno) == ("ST013", _line("# the line"))


class _Scriptable(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5, self.training) + F.dropout2d(x, p=0.0) + nn.functional.dropout(x, training=False)


@pytest.mark.python
def test_torchscript_compiles_forwards_that_call_the_replaced_functions() -> None:
    # TorchScript compiles what a scripted forward calls from its source and resolves names in its globals.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.10+ deprecates torch.jit.script
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(_Scriptable().eval())
        dropout = torch.jit.script(nn.Dropout(0.5).eval())
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(scripted(x), 3 * x)
    assert torch.equal(dropout(x), x)
    assert F.dropout is not F.dropout.__wrapped__  # the replacement stands, and pickles as torch's name
    assert F.dropout.__module__ == "torch.nn.functional" and F.dropout.__qualname__ == "dropout"


def test_a_tensor_p_is_not_read() -> None:
    class TensorP(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.dropout(x, torch.tensor(0.5))

    with findings() as got:
        TensorP().eval()(torch.ones(4))
    assert got == []


class CausalSelfAttention(nn.Module):
    """The shape of karpathy/nanoGPT's model.py before #240: the flash-attention path passes the module's dropout rate
    to scaled_dot_product_attention whatever its mode (the fix: `self.dropout if self.training else 0`)."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.n_head, self.dropout, self.fixed = 2, 0.5, fixed
        self.c_attn, self.c_proj = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.fixed:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                               dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


SDPA_LINE = CausalSelfAttention.forward.__code__.co_firstlineno + 8


def test_nanogpt_240_attention_dropout_at_evaluation_warns_at_the_attention_line() -> None:
    torch.manual_seed(0)
    model = CausalSelfAttention().eval()
    x = torch.randn(2, 4, 8)
    with findings() as got, torch.no_grad():
        a, b = model(x), model(x)
    assert [(w.category, w.filename, w.lineno) for w in got] == [(FunctionalDropoutInEvalWarning, __file__, SDPA_LINE)]
    message = str(got[0].message)
    assert message.startswith("ST013 `F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout, "
                              "is_causal=True)` in CausalSelfAttention.forward() keeps dropping attention weights "
                              "after .eval()")
    assert message.endswith("Write: dropout_p=self.dropout if self.training else 0.0 (safetorch explain ST013)")
    assert not torch.equal(a, b)  # what it is about: two evaluations of one input differ


def test_attention_dropout_in_training_or_gated_by_the_mode_is_silent() -> None:
    x = torch.randn(2, 4, 8)
    with findings() as got:
        CausalSelfAttention()(x).sum().backward()  # training: dropout wanted
        fixed = CausalSelfAttention(fixed=True).eval()
        with torch.no_grad():
            assert torch.equal(fixed(x), fixed(x))
        F.scaled_dot_product_attention(x, x, x, dropout_p=0.1)  # no module: a function's own choice
    assert got == []


def test_torchscript_scripts_a_forward_that_calls_attention() -> None:
    class Attend(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.10+ deprecates torch.jit.script
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(Attend())
    q = torch.randn(1, 2, 3, 4)
    assert torch.equal(scripted(q), Attend()(q))


_TRAINING_PAYS_NOTHING = '''
import sys, warnings
import torch, torch.nn as nn, torch.nn.functional as F
from torch.nn.functional import dropout as early_dropout  # bound before safetorch is installed
import safetorch

class Forgetful(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.1)
    def forward(self, x):
        h = F.dropout(self.drop(self.fc(x)), 0.5)
        return early_dropout(h, 0.2)

own = safetorch.__file__.rsplit("/", 1)[0]
entered = []
def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(own):
        entered.append(frame.f_code.co_name)
def steps(model, n=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sys.setprofile(profile)
    try:
        for _ in range(n):
            model(torch.ones(2, 8)).sum().backward()
            opt.step()
    finally:
        sys.setprofile(None)

model = Forgetful()
steps(model)
print("training", entered.count("dropout"), "torch's" if not hasattr(F.dropout, "__wrapped__") else "patched")
with warnings.catch_warnings(record=True) as got:
    warnings.simplefilter("always")
    model.eval()
    with torch.no_grad():
        model(torch.ones(2, 8))
print("eval", [str(w.message)[:5] for w in got if issubclass(w.category, safetorch.SafetorchWarning)])
model.train()
entered.clear()
steps(model)
print("training again", entered.count("dropout"), early_dropout is F.dropout, hasattr(early_dropout, "__wrapped__"))
'''


def test_a_training_step_s_dropout_never_enters_safetorch_and_an_evaluation_is_still_looked_at() -> None:
    """The replacements stand only while a module the program put in eval mode is in it (a fresh process: the
    test session holds eval-mode models of its own)."""
    from .conftest import run_python

    proc = run_python(_TRAINING_PAYS_NOTHING)
    assert proc.returncode == 0, proc.stderr
    expected = ["training 0 torch's", "eval ['ST013', 'ST013']", "training again 0 True False"]
    assert proc.stdout.splitlines() == expected, proc.stdout
