"""ST006: a NaN/Inf loss reaching backward(), reported at the backward line, on CPU directly and on CUDA later."""

from __future__ import annotations

import itertools
import math
import textwrap

import pytest
import torch

import safetorch
from safetorch import NonFiniteLossWarning, SafetorchError, _backward, _deferred
from safetorch._callsite import Spot

from .conftest import findings, lineno, run_python


def test_nan_loss_warns_at_the_backward_line() -> None:
    w = torch.randn(3, requires_grad=True)
    loss = (w * float("nan")).sum()
    with findings() as got:
        loss.backward(); line = lineno()  # noqa: E702
    assert [(w_.category, w_.filename, w_.lineno) for w_ in got] == [(NonFiniteLossWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST006 loss is nan when backward() starts from it")
    for cause in ("learning rate", "log(0)", "division by zero", "bad data"):
        assert cause in message


def test_inf_and_autograd_backward_and_a_vector() -> None:
    w = torch.randn(3, requires_grad=True)
    with findings() as got:
        torch.autograd.backward((w.abs() * float("inf")).sum()); first = lineno()  # noqa: E702
        v = w * torch.tensor([1.0, float("nan"), float("inf")])
        v.backward(torch.ones(3)); second = lineno()  # noqa: E702
    assert [w_.lineno for w_ in got] == [first, second]
    assert "is inf" in str(got[0].message)
    assert "has 1 NaN and 1 infinite values among its 3 elements" in str(got[1].message)


def test_finite_losses_and_gradients_are_untouched() -> None:
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    with findings() as got:
        (w * 2).sum().backward()
        torch.autograd.backward([(w ** 2).sum()])
    assert got == []
    assert torch.equal(w.grad, torch.full((3,), 2.0) + 2 * w.detach())


def test_a_finite_vector_backward_is_silent() -> None:
    # item() raises for a tensor of more than one element: the full finiteness test takes over, silently.
    w = torch.ones(3, requires_grad=True)
    with findings() as got:
        (w * 2).backward(torch.ones(3))
        (w[:0] * 2).backward(torch.ones(0))
    assert got == []
    assert torch.equal(w.grad, torch.full((3,), 2.0))


def test_strict_mode_raises_before_backward_runs() -> None:
    safetorch.install(strict=True)
    w = torch.randn(3, requires_grad=True)
    loss = (w * float("nan")).sum()
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        loss.backward()
    assert (info.value.code, info.value.lineno) == ("ST006", line)
    assert w.grad is None


# The accelerator path, run on CPU tensors (`device_path`: a fake device one check behind the host): the lines a GPU
# run executes.

def _step(w: torch.Tensor, scale: float) -> None:
    (w * scale).sum().backward()


@pytest.mark.usefixtures("device_path")
def test_device_path_reports_a_nan_loss_at_its_backward_line_once_the_device_has_computed_it() -> None:
    w = torch.randn(3, requires_grad=True)
    with findings() as got:
        loss = (w * float("nan")).sum()
        loss.backward(); line = lineno()  # noqa: E702
        assert got == []  # queued: the device has not computed it yet, and nothing waits for it
        (w * 2).sum().backward()  # the event of the NaN's check completes when the next one is recorded
        assert got == []
        (w * 3).sum().backward()  # polled here
    assert [(w_.category, w_.filename, w_.lineno) for w_ in got] == [(NonFiniteLossWarning, __file__, line)]
    assert str(got[0].message).startswith("ST006 loss is nan when backward() starts from it: its gradients will be NaN")


@pytest.mark.usefixtures("device_path")
def test_device_path_vector_and_autograd_backward_and_infinity() -> None:
    w = torch.randn(3, requires_grad=True)
    with findings() as got:
        v = w * torch.tensor([1.0, float("nan"), float("inf")])
        v.backward(torch.ones(3)); first = lineno()  # noqa: E702
        torch.autograd.backward((w.abs() * float("inf")).sum()); second = lineno()  # noqa: E702
        _deferred.poll(wait=True)
    assert [(w_.lineno, str(w_.message).split(" when")[0]) for w_ in got] == [
        (first, "ST006 v has NaN or infinite values among its 3 elements"),
        (second, "ST006 the tensor given to torch.autograd.backward is inf")]


@pytest.mark.usefixtures("device_path")
def test_device_path_finite_losses_give_the_same_gradients_and_never_word_a_message(monkeypatch) -> None:
    from safetorch.checks import non_finite_loss

    def never(*args: object) -> str:
        raise AssertionError("a name or a line was worked out for a finite loss")

    monkeypatch.setattr(non_finite_loss, "_name", never)
    monkeypatch.setattr(non_finite_loss, "_message", never)
    monkeypatch.setattr(Spot, "f_lineno", property(never))
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    with findings() as got:
        for scale in range(1, 200):
            _step(w, float(scale))
        (w * 2).backward(torch.ones(3))
        _deferred.poll(wait=True)
    assert got == []
    assert torch.equal(w.grad, torch.full((3,), float(sum(range(1, 200)) + 2)))


@pytest.mark.usefixtures("device_path")
def test_device_path_never_reads_a_slot_before_its_event_completed() -> None:
    _deferred.force_cpu(True, lag=10)
    w = torch.randn(3, requires_grad=True)
    with findings() as got:
        (w * float("nan")).sum().backward(); line = lineno()  # noqa: E702
        for _ in range(9):
            _step(w, 1.0)
        assert got == []  # nine events recorded after it: the device is ten behind
        _step(w, 1.0)  # the tenth completes the NaN's check; this backward's poll ran before it was recorded
        assert got == []
        _step(w, 1.0)
    assert [w_.lineno for w_ in got] == [line]


@pytest.mark.usefixtures("device_path")
def test_device_path_drops_a_check_rather_than_wait_when_every_slot_is_in_flight(monkeypatch) -> None:
    _deferred.force_cpu(True, lag=10_000)
    monkeypatch.setattr(_backward, "_schedule", itertools.repeat(True))  # every backward looked at
    w = torch.randn(3, requires_grad=True)
    before = _deferred.dropped
    with findings() as got:
        for _ in range(_deferred.RING):
            _step(w, 1.0)
        (w * float("nan")).sum().backward()  # no slot free, none completed: not checked, and nothing waited
        assert _deferred.dropped == before + 1
        _deferred.poll(wait=True)  # what was queued is still read
    assert got == []
    assert w.grad is not None and torch.isnan(w.grad).all()


@pytest.mark.usefixtures("device_path")
def test_device_path_strict_mode_raises_at_the_backward_that_reads_it_naming_the_bad_line() -> None:
    safetorch.install(strict=True)
    w = torch.randn(3, requires_grad=True)
    (w * float("nan")).sum().backward(); line = lineno()  # noqa: E702
    _step(w, 1.0)
    with pytest.raises(SafetorchError) as info:
        _step(w, 1.0)
    assert (info.value.code, info.value.filename, info.value.lineno) == ("ST006", __file__, line)


@pytest.mark.usefixtures("device_path")
def test_device_path_looks_at_the_first_backwards_then_one_in_thirty_two() -> None:
    _deferred.force_cpu(True, lag=0)  # a device that keeps up: what is looked at is read at the next look
    w = torch.randn(3, requires_grad=True)
    with findings() as before:
        for _ in range(_deferred.FIRST):
            _step(w, 1.0)
        (w * float("nan")).sum().backward()  # backward 65: not looked at (an isolated NaN goes unseen)
        for _ in range(_deferred.EVERY - 2):
            _step(w, 1.0)
        _deferred.poll(wait=True)
    assert before == []
    with findings() as got:
        for _ in range(3):  # a loss that stays NaN, as a diverged one does: backward 96 is looked at
            (w * float("nan")).sum().backward(); line = lineno()  # noqa: E702
        _deferred.poll(wait=True)
    assert [w_.lineno for w_ in got] == [line]


def test_the_cpu_looks_at_the_same_backwards_as_a_device_and_finds_a_diverged_loss_at_its_line() -> None:
    """On the CPU too, the first 64 backwards, then one in 32: a loss's item() at every backward was a third of what
    safetorch added to a tiny model's step. A diverged loss stays NaN and is reported at the looked-at backward's
    line, as it happens (no device to wait for)."""
    w = torch.randn(3, requires_grad=True)
    with findings() as before:
        for _ in range(_deferred.FIRST):
            _step(w, 1.0)
        (w * float("nan")).sum().backward()  # backward 65: not looked at
        for _ in range(_deferred.EVERY - 2):
            _step(w, 1.0)
    with findings() as got:
        (w * float("nan")).sum().backward()  # backward 96: looked at
        line = lineno() - 1
    assert before == []
    assert [(w_.category.__name__, w_.lineno) for w_ in got] == [("NonFiniteLossWarning", line)]


def test_device_path_reports_at_exit_what_the_device_computed_last() -> None:
    code = textwrap.dedent("""\
        import torch, safetorch
        w = torch.randn(3, requires_grad=True)
        (w * 2).sum().backward()
        (w.abs() * float("inf")).sum().backward()
    """)
    result = run_python(code, env={"SAFETORCH_DEFERRED_CPU": "1"})
    assert result.returncode == 0, result.stderr
    assert "<string>:4: NonFiniteLossWarning: ST006 the loss is inf when backward() starts from it" in result.stderr
    assert "ST006" in result.stderr.split("safetorch:")[-1]  # and the exit summary counts it


def test_cuda_adapter_pins_its_ring_once_and_records_on_the_tensors_stream(monkeypatch) -> None:
    """The thin CUDA adapter, with torch's CUDA calls replaced by fakes (the real ones run in bench/gpu.sh)."""
    calls: list[tuple[str, object]] = []
    zeros = torch.zeros

    class Event:
        def __init__(self) -> None:
            self.done = False

        def record(self, stream: object = None) -> None:
            calls.append(("record", stream))

        def query(self) -> bool:
            calls.append(("query", self.done))
            return self.done

        def synchronize(self) -> None:
            calls.append(("synchronize", None))
            self.done = True

    def pinned_zeros(*shape: object, pin_memory: bool = False, **kwargs: object) -> torch.Tensor:
        calls.append(("buffer", pin_memory))
        return zeros(*shape, **kwargs)

    monkeypatch.setattr(torch, "zeros", pinned_zeros)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    monkeypatch.setattr(_deferred, "_Fake", _deferred._Cuda)  # CPU tensors get the CUDA adapter
    monkeypatch.setattr(_deferred, "FORCED", True)
    monkeypatch.setattr(_deferred, "_rings", {})
    seen: list[float] = []
    for loss in (torch.tensor(1.5), torch.tensor(float("nan"))):
        assert _deferred.check(loss, lambda value, payload: seen.append(value), None, "test")
    _deferred.poll()
    assert seen == []  # not completed: not read
    _deferred.poll(wait=True)
    assert seen[0] == 1.5 and math.isnan(seen[1])
    assert calls[0] == ("buffer", True) and calls.count(("buffer", True)) == 1
    assert [c for c in calls if c[0] == "record"] == [("record", "stream of cpu")] * 2
    assert calls.index(("query", False)) < calls.index(("synchronize", None))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_reports_without_synchronising_at_the_next_backward() -> None:
    model = torch.nn.Linear(4, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, device="cuda")
    with findings() as got:
        loss = model(x).sum() * float("nan")
        loss.backward(); line = lineno()  # noqa: E702
        assert _deferred.pending  # queued on the device, not read
        torch.cuda.synchronize()
        opt.zero_grad()
        model(x).sum().backward()  # the next backward reads the completed check
    assert [(w_.category, w_.lineno) for w_ in got] == [(NonFiniteLossWarning, line)]
