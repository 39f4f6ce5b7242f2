"""ST021: a comparison with NaN (``loss == float("nan")``, ``v is np.nan``, ``torch.eq(x, nan)``): always False.

The programs are written to files and imported, so that each finding's line is the line of the file's text.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from types import ModuleType

import pytest

import safetorch
from safetorch import NanComparisonWarning, SafetorchError
from safetorch.checks import nan_comparison

from .conftest import findings


def _load(tmp_path: os.PathLike[str], source: str, name: str = "nanprog") -> tuple[ModuleType, str]:
    path = os.path.join(tmp_path, f"{name}.py")
    with open(path, "w") as fh:
        fh.write(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module, path


def _line(path: str, text: str) -> int:
    with open(path) as fh:
        return next(n for n, line in enumerate(fh, 1) if text in line)


TRAIN = """
import math
import numpy as np
import torch

def train(steps):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if loss.item() == float("nan"):
            raise RuntimeError("the loss is NaN")
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()
"""


def test_the_seed_posts_loss_check_warns_at_its_line_with_the_fix(tmp_path: os.PathLike[str]) -> None:
    """Seed post 003, item 7: `==` (or `is`) cannot find a NaN. A training loop whose only torch call that safetorch
    reads a frame at is `backward()`."""
    module, path = _load(tmp_path, TRAIN)
    with findings() as got:
        module.train(3)
    line = _line(path, 'float("nan")')
    assert [(w.category, w.filename, w.lineno) for w in got] == [(NanComparisonWarning, path, line)]
    assert str(got[0].message).startswith(
        'ST021 `loss.item() == float("nan")` is always False: NaN equals nothing, itself included, so this NaN '
        "check never fires. Write: math.isnan(loss.item())")


FORMS = """
import math
import numpy as np
import torch

def check(loss, x, t):
    x = x.float()
    found = []
    if loss.item() == math.nan:
        found.append(1)
    if loss == float("nan"):
        found.append(2)
    if loss.item() is np.nan:
        found.append(3)
    if torch.eq(x, float("nan")).any():
        found.append(4)
    if (t == torch.nan).any():
        found.append(5)
    if not x.ne(np.nan).all():
        found.append(6)
    kept = [v for v in x.tolist() if v != float('NaN')]
    return found, kept
"""


@pytest.mark.parametrize(("text", "fix"), [
    ("loss.item() == math.nan", "math.isnan(loss.item())"),
    ('loss == float("nan")', "torch.isnan(loss)"),
    ("loss.item() is np.nan", "math.isnan(loss.item())"),
    ('torch.eq(x, float("nan"))', "torch.isnan(x)"),
    ("t == torch.nan", "torch.isnan(t)"),
    ("x.ne(np.nan)", "~torch.isnan(x)"),
    ("v != float('NaN')", "not math.isnan(v)"),
])
def test_every_spelling_warns_at_its_own_line(tmp_path: os.PathLike[str], text: str, fix: str) -> None:
    import torch

    module, path = _load(tmp_path, FORMS)
    nan = torch.tensor(float("nan"))
    with findings() as got:
        found, kept = module.check(nan, torch.tensor([1.0, float("nan")]), torch.tensor([float("nan")]))
    assert found == [] and len(kept) == 2  # none of the checks found the NaNs they were written for
    shown = {w.lineno: str(w.message) for w in got}
    assert all(w.category is NanComparisonWarning and w.filename == path for w in got)
    assert sorted(shown) == [_line(path, s) for s in ("math.nan:", '"nan"):', "np.nan:", "torch.eq(", "torch.nan)",
                                                       "x.ne(", "NaN')")]
    message = shown[_line(path, text)]
    assert message.startswith(f"ST021 `{text}` is ")
    assert f"so this NaN check never fires. Write: {fix} (" in message
    always = "True" if text.startswith(("x.ne", "v !=")) else "False"
    assert (f"is always {always}:" in message) or ("is False for every NaN a computation makes" in message)


LOOKALIKES = """
import math
import numpy as np
import torch

NAN = None

def check(loss, x, a, stats):
    x = x.float()
    found = []
    if x != x:
        found.append("x != x")
    if math.isnan(loss.item()):
        found.append("math.isnan")
    if torch.isnan(loss):
        found.append("torch.isnan")
    if np.isnan(a).any():
        found.append("np.isnan")
    if loss.item() == 1.5 or loss.item() == float("inf") or loss.item() > 1e9:
        found.append("other floats")
    if stats is None or stats is not None and stats.get("best", np.nan) is None:
        found.append("is None")
    clean = np.nan_to_num(a, nan=0.0)
    mean = np.nanmean(a)
    filled = np.where(np.isnan(a), 0.0, a)
    same = np.array_equal(a, a, equal_nan=True)
    mask = torch.full((2,), float("nan"))
    if torch.isclose(x, x, equal_nan=True).all() and same:
        found.append("isclose")
    return found, clean, mean, filled, mask
"""


def test_nan_aware_code_and_other_comparisons_are_silent(tmp_path: os.PathLike[str]) -> None:
    import numpy as np
    import torch

    module, _ = _load(tmp_path, LOOKALIKES)
    with findings() as got:
        found, *_ = module.check(torch.tensor(float("nan")), torch.tensor([float("nan")]), np.array([np.nan]), None)
    assert found == ["x != x", "math.isnan", "torch.isnan", "np.isnan", "is None", "isclose"]
    assert got == []


def test_a_code_object_is_read_once_however_often_it_runs(tmp_path: os.PathLike[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    module, _ = _load(tmp_path, TRAIN)
    read: list[str] = []
    scan = nan_comparison.scan
    monkeypatch.setattr(nan_comparison, "scan", lambda code, *rest: read.append(code.co_name) or scan(code, *rest))
    with findings() as got:
        module.train(20)
    assert read.count("train") == 1 and len(got) == 1


def test_strict_mode_raises_at_the_comparison(tmp_path: os.PathLike[str]) -> None:
    module, path = _load(tmp_path, TRAIN)
    safetorch.install(strict=True)
    with pytest.raises(SafetorchError) as info:
        module.train(1)
    assert info.value.code == "ST021" and info.value.lineno == _line(path, 'float("nan")')


def test_a_comment_silences_the_line(tmp_path: os.PathLike[str]) -> None:
    module, _ = _load(tmp_path, TRAIN.replace('float("nan"):', 'float("nan"):  # safetorch: ignore[ST021]'))
    with findings() as got:
        module.train(2)
    assert got == []


def test_off_after_uninstall(tmp_path: os.PathLike[str]) -> None:
    module, _ = _load(tmp_path, TRAIN)
    safetorch.uninstall()
    with findings() as got:
        module.train(2)
    assert got == []


def test_code_without_source_warns_at_its_line_without_an_internal_error() -> None:
    """Code compiled from a string (``python -c``, ``exec``, a generated training function) has no source to read:
    ST021 still finds the comparison in its bytecode and reports it at its line, with the fix, and no internal error
    (an IndexError on the empty source line, before)."""
    namespace: dict[str, object] = {}
    exec(compile(TRAIN, "<generated>", "exec"), namespace)
    line = TRAIN.splitlines().index('        if loss.item() == float("nan"):') + 1
    with findings() as got:
        namespace["train"](3)  # type: ignore[operator]
    assert [(w.category, w.filename, w.lineno) for w in got] == [(NanComparisonWarning, "<generated>", line)]
    assert str(got[0].message).startswith(
        "ST021 this line compares with NaN: always False, since NaN equals nothing, itself included, so this NaN "
        "check never fires. Write: torch.isnan(x) for a tensor, math.isnan(v) for a number")


NAMED_NAN = """
import numpy as np
import torch

def train(steps):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        nan = torch.isnan(loss).item()
        if nan == True:
            raise RuntimeError("the loss is NaN")
        NAN = int(torch.isnan(x).sum())
        if NAN != 0:
            raise RuntimeError("NaN in the inputs")
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()
"""


def test_a_local_variable_named_nan_that_holds_a_check_result_is_not_a_nan(tmp_path: os.PathLike[str]) -> None:
    """``nan = torch.isnan(loss).item()`` then ``if nan == True:`` (and a count called ``NAN`` compared with 0): the
    name is the program's own variable, assigned in the function from an ``isnan``, not a NaN written out. The check
    works and fires for a NaN loss; ST021 must stay silent (it reported `nan == True` with the fix
    `math.isnan(True)`, and `NAN != 0` with `not math.isnan(0)`)."""
    module, _ = _load(tmp_path, NAMED_NAN)
    with findings() as got:
        module.train(3)
    assert [(w.category.__name__, str(w.message)[:60]) for w in got] == []


SENTINEL = """
import numpy as np
import torch

def train(steps):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    best = np.nan  # no best loss yet
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if best is np.nan or loss.item() < best:
            best = loss.item()
    return best
"""


def test_an_identity_check_against_the_np_nan_sentinel_the_function_assigned_is_silent(
        tmp_path: os.PathLike[str]) -> None:
    """``best = np.nan`` as a "no value yet" sentinel, then ``if best is np.nan or loss < best:``: the name holds the
    very object ``np.nan`` until the first assignment, so the identity check is True exactly when it should be (the
    program records its best loss on the first step). No NaN a computation made is compared: the message "this NaN
    check never fires" is false for it."""
    module, _ = _load(tmp_path, SENTINEL)
    with findings() as got:
        best = module.train(3)
    assert best == best  # the sentinel was replaced on the first step
    assert [(w.category.__name__, str(w.message)[:60]) for w in got] == []
