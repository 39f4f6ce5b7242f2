"""Every rule's finding under a warning filter set to "error" (``-W error::safetorch.SafetorchWarning``): the
warning is raised as an exception out of the user's line, never reported as an internal failure of the check.

The rule tests record warnings with ``simplefilter("always")``; this file is their raise path, end to end: one
pitfall per rule, run under ``simplefilter("error", SafetorchWarning)``. The traceback must end on the user's line
once pruned (as the excepthook does), and the user's line must be the one that made the mistake.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import fakehub  # tests/site-packages: a library, put on the path by conftest
import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.autograd import Variable

import safetorch
from safetorch import _report

from .conftest import lineno, one_rank_group


def st001() -> int:
    x = torch.ones(2)
    x.double(); return lineno()  # noqa: E702


def st002() -> int:
    nn.MSELoss(size_average=False); return lineno()  # noqa: E702


def st003() -> int:
    model = nn.Linear(2, 2).eval()
    for _ in range(2):
        model(torch.ones(1, 2)); line = lineno()  # noqa: E702
    return line


def st004() -> int:
    w = torch.ones(2, requires_grad=True)
    total = 0.0
    for _ in range(2):
        loss = (w * 2).sum()
        loss.backward()
        total += loss; line = lineno()  # noqa: E702
    return line


def st005() -> int:
    Variable(torch.ones(2), volatile=True); return lineno()  # noqa: E702


def st006() -> int:
    w = torch.ones(2, requires_grad=True)
    loss = (w * float("nan")).sum()
    loss.backward(); return lineno()  # noqa: E702


def st007() -> int:
    for _ in range(20):
        torch.cuda.empty_cache(); line = lineno()  # noqa: E702
    return line


def st008() -> int:
    model = fakehub.from_pretrained()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(2, 6)).sum().backward()
        opt.step(); line = lineno()  # noqa: E702  (the finding names the forward's line; it raises here)
    return line


def st009() -> int:
    logits = torch.ones(2, 3, requires_grad=True)
    nn.functional.cross_entropy(logits.softmax(1), torch.zeros(2, dtype=torch.long)); return lineno()  # noqa: E702


def st010() -> int:
    model = nn.Linear(2, 2).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step(); return lineno()  # noqa: E702


def st011() -> int:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
        opt.step(); line = lineno()  # noqa: E702
    return line


def st012() -> int:
    model = nn.Linear(2, 2)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0); return lineno()  # noqa: E702


def st013() -> int:
    class Forgetful(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(x, 0.5)  # the finding's line, in the forward: it raises here

    Forgetful().eval()(torch.ones(2))
    return lineno() - 4


def st014() -> int:
    model = nn.Linear(2, 2)
    state = {f"module.{k}": v for k, v in model.state_dict().items()}
    model.load_state_dict(state, strict=False); return lineno()  # noqa: E702


def st015() -> int:
    model = nn.Linear(2, 2)
    model.requires_grad = False
    torch.optim.SGD(model.parameters(), lr=0.1); return lineno()  # noqa: E702


def st016() -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from safetorch import _ddp
    from safetorch.checks import replicas_diverged

    from .test_replicas_diverged import _Twin

    store = _Twin(differ_from=1)  # a second rank whose replica differs
    original, replicas_diverged._store = replicas_diverged._store, lambda: store  # type: ignore[assignment]
    try:
        with one_rank_group():
            ddp = DDP(nn.Linear(2, 2))
            _ddp.live[id(ddp)].ranks = (0, 1)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            ddp(torch.ones(1, 2)).sum().backward()
            opt.step(); return lineno()  # noqa: E702
    finally:
        replicas_diverged._store = original  # type: ignore[assignment]


def st017() -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    with one_rank_group():
        ddp = DDP(nn.Linear(2, 2))
        ddp.double(); return lineno()  # noqa: E702


def st018() -> int:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = [p.detach().clone() for p in model.parameters()]

    def put_back(*args: Any) -> None:
        with torch.no_grad():
            for p, q in zip(model.parameters(), start, strict=True):
                p.copy_(q)

    opt.register_step_post_hook(put_back)
    model(torch.ones(1, 2)).sum().backward()
    opt.step(); return lineno()  # noqa: E702


def st019() -> int:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    model(torch.randn(4, 2)).sum().backward()
    opt.step()
    for _ in range(6):  # evaluated in training mode, with autograd on
        model(torch.randn(4, 2)); line = lineno()  # noqa: E702
    return line


def st020() -> int:
    gen, loss_net = nn.Linear(2, 2), nn.Linear(2, 2)  # loss_net: never frozen, in no optimizer
    opt = torch.optim.SGD(gen.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss_net(gen(torch.ones(1, 2))).sum().backward()
        opt.step(); line = lineno()  # noqa: E702  (the finding names the backward's line; it raises here)
    return line


def st021() -> int:
    loss = torch.ones(1).float()  # a call site safetorch reads: the function's comparisons are read with it
    line = lineno() + 1
    if loss.item() == float("nan"):
        pass
    return line


def st022() -> int:
    buf, kept = np.zeros(2, dtype=np.float32), []
    for k in range(3):
        buf[:] = k
        kept.append(torch.from_numpy(buf)); line = lineno()  # noqa: E702
    return line


PITFALLS: dict[str, Callable[[], int]] = {code: globals()[code.lower()] for code in safetorch.RULES}


@pytest.fixture
def errors() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", safetorch.SafetorchWarning)
        yield


@pytest.mark.parametrize("code", sorted(PITFALLS))
def test_the_finding_raises_out_of_the_users_line(code: str, errors: None) -> None:
    rule = safetorch.RULES[code]
    with pytest.raises(rule.category) as info:
        PITFALLS[code]()
    assert str(info.value).startswith(code)
    tb: Any = _report.prune_traceback(info.value.__traceback__)
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_filename == __file__
    assert tb.tb_frame.f_code.co_name == {"ST013": "forward"}.get(code, code.lower())
    assert torch.is_grad_enabled()
    assert not any(s.code == code and not s.shown for s in _report.findings())  # raised counts as shown


def test_every_rule_has_a_pitfall_here() -> None:
    assert set(PITFALLS) == set(safetorch.RULES)
