"""The two real posts this project comes from, replayed: every finding they should raise, on the right lines."""

from __future__ import annotations

import os
import textwrap

import torch
import torch as t
import torch.nn as nn
from torch.autograd import Variable
from torch.utils.data import DataLoader, TensorDataset

from safetorch import (
    DiscardedConversionWarning,
    EmptyCacheLoopWarning,
    EvalModeGradWarning,
    GraphAccumulationWarning,
    LegacyReductionWarning,
    NanComparisonWarning,
    SharedMemoryWarning,
    VolatileVariableWarning,
)

from .conftest import findings, lineno, run_python
from .test_eval_mode_grad import keeps_activations


def test_first_post_validation_loop() -> None:
    """The validation loop of the first post: legacy loss, volatile Variables, empty_cache, no no_grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 5, 1))
    data = TensorDataset(torch.randn(24, 3, 16, 16), torch.randint(0, 5, (24, 16, 16)).double())
    dataloader = DataLoader(data, batch_size=2)
    lines = {}
    graphs = []
    with findings() as got:
        criterion = nn.CrossEntropyLoss(size_average=False); lines["ST002"] = lineno()  # noqa: E702
        model.eval()
        for ii, batch in enumerate(dataloader):
            input, label = batch
            val_input1 = Variable(input, volatile=True); lines["ST005"] = lineno()  # noqa: E702
            val_input = val_input1.float()
            val_label = Variable(label.type(t.LongTensor), volatile=True); lines["ST005b"] = lineno()  # noqa: E702
            score, kept = keeps_activations(lambda: model(val_input)); lines["ST003"] = lineno()  # noqa: E702, B023
            graphs.append(kept)
            loss = criterion(score, val_label)
            if ii == 0:
                loss_mean = loss.item()
            loss_mean = 0.1 * loss.item() + 0.9 * loss_mean
            t.cuda.empty_cache(); lines["ST007"] = lineno()  # noqa: E702
    seen = [(w.category, w.lineno) for w in got]
    assert seen == [
        (LegacyReductionWarning, lines["ST002"]),
        (VolatileVariableWarning, lines["ST005"]),
        (VolatileVariableWarning, lines["ST005b"]),
        (EvalModeGradWarning, lines["ST003"]),
        (EmptyCacheLoopWarning, lines["ST007"]),
    ]
    assert all(w.filename == __file__ for w in got)
    assert criterion.reduction == "sum" and score.requires_grad  # the graph as written, without activations
    # the first forward at that line is watched (run as written); every later one kept no activations
    assert graphs == [True] + [False] * (len(graphs) - 1) and len(graphs) == 12
    # the summed per-pixel loss of the post: about H*W times the mean
    assert loss.item() > 16 * 16 * 0.5


def test_second_post_pitfalls() -> None:
    """The second post: Tensor.cuda() without assignment, and total_loss accumulated without .item()."""
    model = nn.Linear(4, 2).double()  # Module.double() is in place: fine
    tensor = torch.zeros(2, 4)
    lines = {}
    with findings() as got:
        model.double()
        tensor.double(); lines["ST001"] = lineno()  # noqa: E702
        tensor_double = tensor.double()
        total_loss = 0
        for _ in range(2):
            loss = model(tensor_double).sum()
            loss.backward()
            total_loss = total_loss + loss; lines["ST004"] = lineno()  # noqa: E702
        total = 0
        for _ in range(2):
            total = total + model(tensor_double).sum().item()  # the fix: silent
    assert [(w.category, w.lineno) for w in got] == [
        (DiscardedConversionWarning, lines["ST001"]),
        (GraphAccumulationWarning, lines["ST004"]),
    ]
    assert str(got[0].message).endswith("Write: tensor = tensor.double() (safetorch explain ST001)")
    assert str(got[1].message).endswith("Write: total_loss = total_loss + loss.item() (safetorch explain ST004)")


def _train_with_the_posts_nan_checks(model: nn.Module, x: torch.Tensor) -> int:
    """The post's loop (a function of its own: ST021 reads a function's code once, as it starts on 3.12+, or at its
    first backward)."""
    import numpy

    line = 0
    for _ in range(2):
        loss = model(x).pow(2).mean()
        if loss.item() == float("nan"):
            print("Loss value is NaN!")
        line = lineno() - 2
        if numpy.isnan(loss.item()):  # the post's advice: silent
            print("Loss value is NaN!")
        loss.backward()
    return line


def test_second_post_items_7_and_8_nan_checks_and_shared_memory() -> None:
    """Item 7: NaN cannot be found with `==` or `is` (the post's own check, `np.isnan(loss.item())`, is silent).
    Item 8: `torch.as_tensor(a)` of a NumPy array shares its memory: a change through the tensor changes the array."""
    import numpy

    model = nn.Linear(4, 1)
    x = torch.randn(8, 4)
    with findings() as got:
        line = _train_with_the_posts_nan_checks(model, x)
    assert [(w.category, w.lineno) for w in got] == [(NanComparisonWarning, line)]
    assert str(got[0].message).endswith("Write: math.isnan(loss.item()) (safetorch explain ST021)")

    a = numpy.array([1, 2, 3])
    with findings() as got:
        for _ in range(2):
            t = torch.as_tensor(a); line = lineno()  # noqa: E702
            t.mul_(2)  # changes a: the tensor is a's memory
            del t
    assert [(w.category, w.lineno) for w in got] == [(SharedMemoryWarning, line)]
    assert a.tolist() == [4, 8, 12]


def test_crash_note_names_the_discarded_conversion(tmp_path: os.PathLike[str]) -> None:
    script = os.path.join(tmp_path, "crash.py")
    with open(script, "w") as fh:
        fh.write(textwrap.dedent("""\
            import torch
            import safetorch
            model = torch.nn.Linear(3, 2).double()
            x = torch.randn(4, 3)
            x.double()
            model(x)
        """))
    proc = run_python(f"import runpy; runpy.run_path({script!r}, run_name='__main__')", env={"SAFETORCH_REPORT": "0"})
    assert proc.returncode == 1
    tail = proc.stderr.strip().splitlines()
    assert tail[-2].startswith("RuntimeError: mat1 and mat2 must have the same dtype")
    assert tail[-1] == (f"safetorch: {script}:5 discarded a conversion earlier, the usual cause of this error: "
                        "x.double() returns a copy and its result is discarded; x is unchanged. Write: x = x.double() "
                        "(safetorch explain ST001)")


def test_no_crash_note_for_other_errors(tmp_path: os.PathLike[str]) -> None:
    script = os.path.join(tmp_path, "other.py")
    with open(script, "w") as fh:
        fh.write("import torch, safetorch\nx = torch.ones(2)\nx.double()\nraise ValueError('unrelated')\n")
    proc = run_python(f"import runpy; runpy.run_path({script!r}, run_name='__main__')", env={"SAFETORCH_REPORT": "0"})
    assert proc.stderr.strip().splitlines()[-1] == "ValueError: unrelated"
