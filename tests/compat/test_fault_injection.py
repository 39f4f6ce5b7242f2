"""Every check made to fail internally: the program prints exactly what it prints without safetorch, and each
failing check says so once."""

from __future__ import annotations

import os
import textwrap

import pytest

from ..conftest import run_python

PROGRAM = textwrap.dedent("""\
    import warnings
    import torch
    import torch.nn as nn
    from torch.autograd import Variable

    warnings.simplefilter("ignore", UserWarning)  # torch's own notices; safetorch's internal ones are RuntimeWarnings
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    criterion = nn.MSELoss(size_average=False)           # ST002's logic runs
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4).double().float(), torch.randn(16, 1)   # ST001's logic runs
    for epoch in range(3):
        model.train()
        loss = criterion(model(x), y)
        opt.zero_grad()
        loss.backward()                                  # ST006's logic runs
        opt.step()
        shifted = 1.0 + loss                             # ST004's logic runs
        model.eval()
        val = model(Variable(x, volatile=True))          # ST003's and ST005's logic run
        for _ in range(12):
            torch.cuda.empty_cache()                     # ST007's logic runs
        print(epoch, repr(loss.item()), repr(shifted.item()), repr(val.sum().item()))
""")

INJECT = textwrap.dedent("""\
    import safetorch
    from safetorch import _callsite
    from safetorch.checks import (empty_cache_loop, eval_mode_grad, legacy_reduction, non_finite_loss,
                                  volatile_variable)

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    _callsite._discarded_slow = boom          # ST001
    _callsite._is_accumulation = boom         # ST004
    legacy_reduction._legacy_message = boom   # ST002
    eval_mode_grad._inspect = boom            # ST003
    volatile_variable.report = boom           # ST005
    non_finite_loss._deferred.FORCED = True   # ST006, on the accelerator path (the CPU's inline test cannot fail):
    non_finite_loss._deferred.check = boom    # queuing the loss fails
    empty_cache_loop._new_site = boom         # ST007
""")


@pytest.mark.slow
def test_every_check_failing_leaves_the_output_unchanged(tmp_path: os.PathLike[str]) -> None:
    script = os.path.join(tmp_path, "train.py")
    with open(script, "w") as fh:
        fh.write(PROGRAM)
    plain = run_python(f"import runpy; runpy.run_path({script!r})")
    broken = run_python(INJECT + f"import runpy; runpy.run_path({script!r})")
    assert plain.returncode == 0, plain.stderr
    assert broken.returncode == 0, broken.stderr
    assert broken.stdout == plain.stdout and plain.stdout.count("\n") == 3
    internal = [ln for ln in broken.stderr.splitlines() if "SafetorchInternalWarning" in ln]
    codes = sorted(ln.split("check ")[1][:5] for ln in internal)
    # ST018's decision is queued through the same broken `_deferred.check` as ST006's: it says so too.
    assert codes == ["ST001", "ST002", "ST003", "ST004", "ST005", "ST006", "ST007", "ST018"]
