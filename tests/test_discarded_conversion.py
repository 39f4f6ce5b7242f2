"""ST001: a discarded out-of-place conversion warns at the user's line; every use of the result stays silent."""

from __future__ import annotations

import copy
import dis
import io
import multiprocessing
import pickle
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import safetorch
from safetorch import DiscardedConversionWarning, SafetorchError
from safetorch.checks import discarded_conversion
from safetorch.checks.discarded_conversion import METHODS

from .conftest import clean_env, findings, lineno


def _text(w: warnings.WarningMessage) -> str:
    """A finding's message without the pointer to the rule's page the reporter ends it with, where it does."""
    return re.sub(r" \(safetorch explain ST\d+\)$", "", str(w.message))

# (method, args) for every wrapped method that runs on a CPU-only build.
CPU_CALLS = [
    ("cpu", ()), ("to", (torch.float64,)), ("to", ("meta",)), ("float", ()), ("double", ()), ("half", ()),
    ("bfloat16", ()), ("long", ()), ("int", ()), ("short", ()), ("bool", ()), ("byte", ()), ("char", ()),
    ("type", (torch.float64,)), ("detach", ()), ("contiguous", ()), ("clone", ()),
    ("type_as", (torch.zeros(1, dtype=torch.float64),)), ("cfloat", ()), ("cdouble", ()), ("chalf", ()),
    ("to_dense", ()), ("to_sparse", ()),
]


def test_every_cpu_method_is_covered_here() -> None:
    # cuda/xpu/mps/pin_memory need a device; they are covered by test_cuda_discarded when one is there.
    present = {m for m in METHODS if hasattr(torch.Tensor, m)}
    assert present - {m for m, _ in CPU_CALLS} <= {"cuda", "xpu", "mps", "pin_memory"}


@pytest.mark.parametrize(("method", "args"), CPU_CALLS, ids=[f"{m}{i}" for i, (m, _) in enumerate(CPU_CALLS)])
def test_discarded_result_warns_at_this_line(method: str, args: tuple[object, ...]) -> None:
    tensor = torch.ones(2, 3)
    with findings() as got:
        getattr(tensor, method)(*args); line = lineno()  # noqa: E702
    assert len(got) == 1
    w = got[0]
    assert w.category is DiscardedConversionWarning
    assert w.filename == __file__ and w.lineno == line
    assert str(w.message).startswith("ST001 ")


def test_message_names_the_variable_and_the_fix() -> None:
    tensor = torch.zeros(2, 3, 10, 10, dtype=torch.int64)
    with findings() as got:
        tensor.float()
    assert str(got[0].message) == (
        "ST001 tensor.float() returns a copy and its result is discarded; tensor is unchanged. "
        "Write: tensor = tensor.float() (safetorch explain ST001)"
    )


def test_a_conversion_that_returned_the_tensor_itself_says_so() -> None:
    """``.cpu()`` of a CPU tensor, ``.float()`` of a float one, ``.contiguous()`` of a contiguous one return the very
    tensor: discarded, the line does nothing here, and throws a copy away on another device or dtype."""
    x = torch.ones(2, 3)
    with findings() as got:
        x.cpu()
        line = lineno() - 1
        x.float()
        x.to("cpu")
        x.to(torch.float32)
        x.contiguous()
        torch.ones(2).cpu()
    assert [(w.category, w.filename) for w in got] == [(DiscardedConversionWarning, __file__)] * 6
    assert [w.lineno for w in got] == [line, *range(line + 2, line + 7)]
    assert str(got[0].message) == (
        "ST001 x.cpu() returned x itself and its result is discarded: here the line does nothing, but on a tensor on "
        "another device it returns a copy and x stays unchanged. Write: x = x.cpu() (safetorch explain ST001)")
    assert [_text(w).split(": here", 1)[0] for w in got[1:]] == [
        "ST001 x.float() returned x itself and its result is discarded",
        'ST001 x.to("cpu") returned x itself and its result is discarded',
        "ST001 x.to(torch.float32) returned x itself and its result is discarded",
        "ST001 x.contiguous() returned x itself and its result is discarded",
        "ST001 torch.ones(2).cpu() returned the tensor itself and its result is discarded"]
    assert [_text(w).split("but on a tensor ", 1)[1].split(" it returns a copy")[0] for w in got[1:]] == [
        "of another dtype", "on another device or of another dtype", "on another device or of another dtype",
        "that is not contiguous", "on another device"]
    assert _text(got[1]).endswith("Write: x = x.float()")
    assert _text(got[5]).endswith("the tensor stays unchanged. Assign the result to a name and use that: "
                                  "<name> = torch.ones(2).cpu()")


def test_a_parameter_s_conversion_tells_itself_from_a_copy() -> None:
    """A leaf that requires grad: its copy's graph holds it (on 3.12+ the reference count alone cannot tell)."""
    p = torch.nn.Parameter(torch.ones(2, 3))
    with findings() as got:
        p.float()
        p.double()
        p.cpu()
        p.t().contiguous()
    assert [_text(w).split(" and its result")[0] for w in got] == [
        "ST001 p.float() returned p itself", "ST001 p.double() returns a copy", "ST001 p.cpu() returned p itself",
        "ST001 p.t().contiguous() returns a copy"]


def test_the_same_methods_that_made_a_copy_say_it_returns_a_copy() -> None:
    x = torch.ones(2, 3, dtype=torch.int64)
    y = torch.ones(3, 2).t()  # not contiguous
    with findings() as got:
        x.float()
        x.to(torch.float32)
        y.contiguous()
    assert [_text(w) for w in got] == [
        "ST001 x.float() returns a copy and its result is discarded; x is unchanged. Write: x = x.float()",
        "ST001 x.to(torch.float32) returns a copy and its result is discarded; x is unchanged. "
        "Write: x = x.to(torch.float32)",
        "ST001 y.contiguous() returns a copy and its result is discarded; y is unchanged. Write: y = y.contiguous()"]


def _dtype_crash(x: torch.Tensor) -> RuntimeError:
    """The error of a double-precision layer given ``x`` (a float tensor), raised where the layer's frame holds it."""
    try:
        torch.nn.Linear(2, 2).double()(x)
    except RuntimeError as exc:
        return exc
    raise AssertionError("no dtype mismatch")


def test_a_crash_note_leaves_out_a_conversion_that_returned_the_tensor_itself() -> None:
    """It left the tensor where it already was: it cannot have caused a later device or dtype mismatch."""
    x = torch.ones(1, 2)
    with findings():
        x.float()
        x.double(); line = lineno()  # noqa: E702
    notes = discarded_conversion.crash_notes(_dtype_crash(x))
    assert [note.split(" discarded a conversion earlier")[0] for note in notes] == [f"safetorch: {__file__}:{line}"]


def test_a_crash_note_names_only_a_conversion_of_a_tensor_of_the_failing_operation() -> None:
    """A discarded conversion of another tensor (``y.half()`` above an unrelated dtype crash) is not its cause."""
    x, y = torch.ones(1, 2), torch.ones(3)
    with findings() as got:
        y.half()
    assert len(got) == 1
    assert discarded_conversion.crash_notes(_dtype_crash(x)) == []
    with findings():
        x.view(2).double(); line = lineno()  # noqa: E702  # a view of x: not the tensor the layer was given
        x.double(); line = lineno()  # noqa: E702
    notes = discarded_conversion.crash_notes(_dtype_crash(x))
    assert [note.split(" discarded a conversion earlier")[0] for note in notes] == [f"safetorch: {__file__}:{line}"]


def test_a_conversion_that_returns_the_tensor_itself_still_returns_it() -> None:
    x = torch.ones(2, 3)
    with findings():
        kept = [x.cpu(), x.float(), x.to("cpu"), x.contiguous()]
    assert all(k is x for k in kept)
    assert x.dtype == torch.float32 and x.device.type == "cpu"


def test_message_names_an_attribute_chain_and_keeps_arguments() -> None:
    class Holder:
        scale = torch.ones(2)

    self = Holder()
    with findings() as got:
        self.scale.to(torch.float64, copy=True)
    assert str(got[0].message).endswith("self.scale is unchanged. Write: self.scale = self.scale.to(torch.float64, "
                                        "copy=True) (safetorch explain ST001)")


def test_message_for_a_call_through_the_class() -> None:
    x = torch.ones(2)
    with findings() as got:
        torch.Tensor.double(x)
    assert "Write: x = torch.Tensor.double(x)" in str(got[0].message)


def test_message_for_a_receiver_that_is_not_a_name() -> None:
    def make() -> torch.Tensor:
        return torch.ones(2)

    with findings() as got:
        make().double()
    assert _text(got[0]) == (
        "ST001 make().double() returns a copy and its result is discarded; the tensor is unchanged. Assign the result "
        "to a name and use that: <name> = make().double()")


def test_an_item_of_a_dict_or_list_is_assigned_back() -> None:
    d, out, xs = {"a": torch.ones(2, dtype=torch.int64)}, [torch.ones(2)], [torch.ones(2), torch.ones(2)]

    class Batch:
        def __init__(self) -> None:
            self.cache = {"img": torch.ones(2)}

    self = Batch()
    with findings() as got:
        d["a"].float()
        out[0].double()
        out[-1].half()
        self.cache["img"].to(torch.float64)
        for i in range(2):
            xs[i].bool()
    assert [_text(w).split("Write: ")[1] for w in got] == [
        'd["a"] = d["a"].float()', "out[0] = out[0].double()", "out[-1] = out[-1].half()",
        'self.cache["img"] = self.cache["img"].to(torch.float64)', "xs[i] = xs[i].bool()"]
    assert _text(got[0]) == ('ST001 d["a"].float() returns a copy and its result is discarded; d["a"] is '
                                   'unchanged. Write: d["a"] = d["a"].float()')


def test_what_cannot_take_the_result_gets_a_placeholder_not_a_variable() -> None:
    """An item of a tensor is a view (assigning to it copies back into the tensor's dtype), a tuple takes no item
    assignment, an attribute of a tensor is no variable of the program's."""
    t, pair, x = torch.ones(2, 3), (torch.ones(2), torch.ones(2)), torch.ones(2)
    with findings() as got:
        t[0].double()
        pair[0].double()
        x.data.double()
        t[1:].double()
    assert [_text(w).split("; ", 1)[1] for w in got] == [
        f"the tensor is unchanged. Assign the result to a name and use that: <name> = {call}"
        for call in ("t[0].double()", "pair[0].double()", "x.data.double()", "t[1:].double()")]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="a call over several lines is read from co_positions() (3.11+)")
def test_a_call_over_several_lines_is_quoted_on_one_line() -> None:
    x = torch.ones(2)
    with findings() as got:
        x.to(  # the dtype the loss needs
            torch.float64,
        ); line = lineno() - 2  # noqa: E702
        x.to(device="cpu",
             dtype=torch.float16)
    assert [w.lineno for w in got] == [line, line + 3]
    assert [_text(w) for w in got] == [
        "ST001 x.to(torch.float64) returns a copy and its result is discarded; x is unchanged. "
        "Write: x = x.to(torch.float64)",
        'ST001 x.to(device="cpu", dtype=torch.float16) returns a copy and its result is discarded; x is unchanged. '
        'Write: x = x.to(device="cpu", dtype=torch.float16)']


@pytest.mark.skipif(sys.version_info < (3, 11), reason="a call over several lines is read from co_positions() (3.11+)")
def test_a_conversion_chain_split_over_three_lines_is_found_at_its_last_call() -> None:
    """From 3.11 the position of a method call written on a line of its own starts at the method's name (`float()`),
    which once read as a call of the builtin `float` (a key function), and the finding was lost."""
    x = torch.ones(2)
    with findings() as got:
        (x
         .double()
         .float()); line = lineno()  # noqa: E702
        (
            x[0]
            .to(torch.float64)
        )
    assert [(w.category, w.lineno) for w in got] == [(DiscardedConversionWarning, line),
                                                     (DiscardedConversionWarning, line + 3)]
    assert _text(got[0]) == ("ST001 x.double().float() returns a copy and its result is discarded; the tensor is "
                             "unchanged. Assign the result to a name and use that: <name> = x.double().float()")
    assert _text(got[1]).startswith("ST001 x[0].to(torch.float64) returns a copy and its result is discarded")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="a call over several lines is read from co_positions() (3.11+)")
def test_a_long_call_shows_its_arguments_as_an_ellipsis() -> None:
    activations_of_the_second_encoder_block = torch.ones(2)
    with findings() as got:
        activations_of_the_second_encoder_block.to(dtype=torch.float64, non_blocking=False, copy=True,
                                                   memory_format=torch.preserve_format)
    assert _text(got[0]).endswith(
        "activations_of_the_second_encoder_block is unchanged. Write: activations_of_the_second_encoder_block = "
        "activations_of_the_second_encoder_block.to(...)")


def test_parameter_is_checked() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    with findings() as got:
        p.double(); line = lineno()  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(DiscardedConversionWarning, line)]


def _identity(v: torch.Tensor) -> torch.Tensor:
    return v


def test_every_used_form_is_silent() -> None:
    x = torch.ones(2, 3)
    with findings() as got:
        a = x.float()
        b, c = x.double(), x.long()
        d = x.float().sum()
        x.float().add_(1)  # chained: the discarded value is add_'s, not float's
        e = _identity(x.double())
        f = [t.float() for t in (x, x)]
        g = {k: x.double() for k in "ab"}
        h = list(t.half() for t in (x,))
        i = x.float() if a is not None else x.double()
        j = (lambda t: t.to(torch.float64))(x)
        k = (x.clone(),)
        print(x.detach().shape)
        assert x.contiguous() is not None
        _ = x.cpu()

        def returns() -> torch.Tensor:
            return x.bfloat16()

        lo = returns()
    assert got == []
    assert all(v is not None for v in (a, b, c, d, e, f, g, h, i, j, k, lo))


def test_module_methods_are_silent() -> None:
    model = torch.nn.Linear(3, 2)
    with findings() as got:
        model.double()
        model.float()
        model.to(torch.float64)
        model.half()
        model.cpu()
    assert got == []
    assert model.weight.dtype == torch.float16


def test_strict_mode_raises_on_this_line() -> None:
    safetorch.install(strict=True)
    x = torch.ones(2)
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        x.double()
    assert info.value.code == "ST001"
    assert (info.value.filename, info.value.lineno) == (__file__, line)
    assert str(info.value).startswith("ST001 x.double() returns a copy")
    assert isinstance(info.value, RuntimeError)


def test_once_per_call_site_in_a_loop() -> None:
    x = torch.ones(2)
    with findings() as got:
        for _ in range(5):
            x.float()
        x.float()  # another call site
    assert len(got) == 2
    from safetorch._report import findings as sites

    assert [s.count for s in sites()] == [5, 1]


def test_results_are_unchanged() -> None:
    x = torch.randn(4, 5)
    safetorch.uninstall()
    expected = [x.double(), x.to(torch.float16), x.type(torch.int32), x.detach(), x.clone()]
    safetorch.install()
    got = [x.double(), x.to(torch.float16), x.type(torch.int32), x.detach(), x.clone()]
    for a, b in zip(expected, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert x.type() == "torch.FloatTensor"  # a string, not a tensor: never a finding


def test_torch_errors_pass_through_unchanged() -> None:
    x = torch.ones(2)
    with pytest.raises(TypeError) as ours:
        x.to(object())
    safetorch.uninstall()
    with pytest.raises(TypeError) as theirs:
        x.to(object())
    assert str(ours.value) == str(theirs.value)


def test_internal_failure_is_swallowed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object) -> bool:
        raise KeyError("boom")

    # What both paths ask of a discarded call (a patched method's, and on 3.12+ a site's the bytecode showed)
    monkeypatch.setattr(discarded_conversion, "calls_method", boom)
    x = torch.ones(2)
    with findings() as got:
        y = x.double()
        x.float()
        z = x.double() * 2
    assert [w.category for w in got] == [safetorch.SafetorchInternalWarning]
    assert "ST001" in str(got[0].message)
    assert torch.equal(z, y * 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_discarded() -> None:
    tensor = torch.zeros(2, 3)
    with findings() as got:
        tensor.cuda(); line = lineno()  # noqa: E702
    assert str(got[0].message) == (
        "ST001 tensor.cuda() returns a copy and its result is discarded; tensor is unchanged. "
        "Write: tensor = tensor.cuda()"
    )
    assert got[0].lineno == line
    assert tensor.device.type == "cpu"


# --- serialisation -------------------------------------------------------------------------------------------


class Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.convert = torch.Tensor.double
        self.bound = torch.ones(2).float
        self.loss_fn = F.mse_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.convert(self.lin(x))


def test_patched_method_pickles_by_reference() -> None:
    data = pickle.dumps(torch.Tensor.float)
    assert b"safetorch" not in data and b"wrapt" not in data
    loaded = pickle.loads(data)
    assert loaded(torch.ones(1, dtype=torch.int64)).dtype == torch.float32
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        assert pickle.loads(pickle.dumps(torch.ones(2).double, proto))().dtype == torch.float64


def test_model_holding_patched_callables_copies_and_saves() -> None:
    model = Holder()
    clone = copy.deepcopy(model)
    assert clone.convert is model.convert or clone.convert(torch.ones(1)).dtype == torch.float64
    x = torch.ones(1, 2)
    assert torch.equal(clone(x), model(x))
    again = pickle.loads(pickle.dumps(model))
    assert torch.equal(again(x), model(x))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x), model(x))


def _convert_in_worker(fn: object) -> str:
    return str(fn(torch.ones(2, dtype=torch.int64)).dtype)  # type: ignore[operator]


def test_patched_method_crosses_into_a_spawned_worker() -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        assert pool.apply(_convert_in_worker, (torch.Tensor.double,)) == "torch.float64"


def test_torch_compile_sees_no_graph_break() -> None:
    import torch._dynamo

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.double().float().contiguous().clone().detach()
        return y.to(torch.float64).sum() + x.type(torch.float32).half().float().sum()

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(torch.randn(8))
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    x = torch.randn(8)
    assert torch.equal(compiled(x), fn(x))


def test_two_functions_with_a_conversion_at_the_same_offset() -> None:
    # The hot path knows a call site by its offset and its code object: a site that uses its result must not make
    # another function's discard at the same offset look used, nor the other way round.
    def uses(x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return y

    def discards(x: torch.Tensor) -> torch.Tensor:
        x.float(); line = lineno()  # noqa: E702
        return x, line  # type: ignore[return-value]

    def float_call(function: object) -> int:
        ins = list(dis.get_instructions(function))  # type: ignore[arg-type]
        at = next(i for i, op in enumerate(ins) if op.argval == "float")
        return next(op.offset for op in ins[at:] if op.opname.startswith("CALL"))

    assert float_call(uses) == float_call(discards)
    x = torch.ones(2, dtype=torch.int64)
    with findings() as got:
        for _ in range(3):
            assert uses(x).dtype == torch.float32
            _, line = discards(x)
            assert uses(x).dtype == torch.float32
    assert [(w.category, w.lineno) for w in got] == [(DiscardedConversionWarning, line)]


@pytest.mark.parametrize("method", ["cuda", "to"])
def test_the_device_conversions_run_on_the_cpu_through_a_fake_device_method(method: str) -> None:
    """ST001's ``x.cuda()`` / ``x.to("cuda")`` lines, without CUDA: the same patch, over a method that returns a
    copy as CUDA's would."""

    class OnDevice(torch.Tensor):
        pass

    def to_device(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        copy = torch.Tensor.clone(self)
        return copy

    setattr(OnDevice, method, discarded_conversion._Conversion.create(to_device, OnDevice, method))
    x = torch.ones(2).as_subclass(OnDevice)
    with findings() as got:
        kept = x.cuda() if method == "cuda" else x.to("cuda")
        if method == "cuda":
            x.cuda()
            line = lineno() - 1
        else:
            x.to("cuda")
            line = lineno() - 1
    assert isinstance(kept, torch.Tensor)
    call = "x.cuda()" if method == "cuda" else 'x.to("cuda")'
    assert [(w.category, w.lineno, str(w.message)) for w in got] == [
        (DiscardedConversionWarning, line,
         f"ST001 {call} returns a copy and its result is discarded; x is unchanged. Write: x = {call} "
         "(safetorch explain ST001)")]


SHAPE_CALLS = [("view", (3, 2)), ("reshape", (-1,)), ("permute", (1, 0)), ("transpose", (0, 1)), ("squeeze", ()),
               ("unsqueeze", (0,)), ("flatten", ()), ("t", ()), ("expand", (4, 2, 3))]


def test_every_shape_method_is_covered_here() -> None:
    from safetorch.checks.discarded_conversion import SHAPES

    assert set(SHAPES) == {m for m, _ in SHAPE_CALLS}


def _discard_view(x: torch.Tensor) -> int:
    x.view(3, 2)
    return lineno() - 1


def _discard_reshape(x: torch.Tensor) -> int:
    x.reshape(-1)
    return lineno() - 1


def _discard_permute(x: torch.Tensor) -> int:
    x.permute(1, 0)
    return lineno() - 1


def _discard_transpose(x: torch.Tensor) -> int:
    x.transpose(0, 1)
    return lineno() - 1


def _discard_squeeze(x: torch.Tensor) -> int:
    x.squeeze()
    return lineno() - 1


def _discard_unsqueeze(x: torch.Tensor) -> int:
    x.unsqueeze(0)
    return lineno() - 1


def _discard_flatten(x: torch.Tensor) -> int:
    x.flatten()
    return lineno() - 1


def _discard_t(x: torch.Tensor) -> int:
    x.t()
    return lineno() - 1


def _discard_expand(x: torch.Tensor) -> int:
    x.expand(4, 2, 3)
    return lineno() - 1


_SHAPE_LINES = {
    "x.view(3, 2)": _discard_view,
    "x.reshape(-1)": _discard_reshape,
    "x.permute(1, 0)": _discard_permute,
    "x.transpose(0, 1)": _discard_transpose,
    "x.squeeze()": _discard_squeeze,
    "x.unsqueeze(0)": _discard_unsqueeze,
    "x.flatten()": _discard_flatten,
    "x.t()": _discard_t,
    "x.expand(4, 2, 3)": _discard_expand,
}


@pytest.mark.parametrize("call", _SHAPE_LINES)
def test_a_discarded_shape_method_warns_at_this_line_with_the_fix(call: str) -> None:
    x = torch.ones(2, 3)
    with findings() as got:
        line = _SHAPE_LINES[call](x)
    assert [(w.category, w.filename, w.lineno) for w in got] == [(DiscardedConversionWarning, __file__, line)]
    assert _text(got[0]) == (f"ST001 {call} returns a new tensor of the new shape and its result is discarded; "
                             f"x keeps its shape. Write: x = {call}")
    assert x.shape == (2, 3)


def test_used_shape_methods_in_place_forms_and_torch_s_own_calls_are_silent_with_the_same_numbers() -> None:
    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        x = torch.randn(4, 2, 8)
        attention = torch.nn.MultiheadAttention(8, 2)  # torch's Python code reshapes and transposes throughout
        out, _ = attention(x, x, x)
        y = out.view(8, 8).t().reshape(-1).unsqueeze(0)
        z = x.permute(2, 0, 1).flatten(1).transpose(0, 1).expand(2, 8, 8).squeeze()
        x.squeeze_()  # in place: not a shape method of this rule
        x.unsqueeze_(0)
        print(x.view(-1).shape)
        return [y, z, x]

    with findings() as got:
        on = run()
    assert got == []
    safetorch.uninstall()
    off = run()
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_a_discarded_reshape_is_no_crash_note_for_a_device_mismatch() -> None:
    x = torch.ones(2, 3)
    with findings():
        x.view(3, 2)
    notes = discarded_conversion.crash_notes(RuntimeError("Expected all tensors to be on the same device"))
    assert notes == []


# -- Python 3.12+: the shape methods stay torch's own; their discarded calls are found in the bytecode ---------------

MONITORED = pytest.mark.skipif(sys.version_info < (3, 12), reason="3.10/3.11 have no sys.monitoring: the shape "
                               "methods are patched there (docs/limitations.md)")


class _Block(torch.nn.Module):
    """A forward written as models write it: every shape call's result used, and one discarded call that is no
    tensor method (its code object is watched, and the call stops being reported to safetorch after its first)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, c // 2).permute(2, 0, 3, 1, 4).unbind(0)
        att = (q @ k.transpose(-2, -1)).softmax(-1)
        self.seen.append(t)
        return (att @ v).transpose(1, 2).reshape(b, t, c).flatten(1).unsqueeze(0).squeeze(0).t().t().expand(b, -1)


@MONITORED
def test_a_forward_s_shape_calls_never_enter_safetorch() -> None:
    block, x = _Block(), torch.randn(2, 4, 8)
    assert discarded_conversion._monitor.watching()
    for name in discarded_conversion.SHAPES:
        assert getattr(torch.Tensor, name) is getattr(torch._C.TensorBase, name), name  # torch's own method
    block(x)  # the first forward: each code object is read once
    entered: list[str] = []
    own = safetorch.__file__.rsplit("/", 1)[0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(own):
            entered.append(frame.f_code.co_name)

    with findings() as got:
        sys.setprofile(profile)
        try:
            for _ in range(3):
                out = block(x)
        finally:
            sys.setprofile(None)
    assert entered == [] and got == []
    safetorch.uninstall()
    try:
        assert torch.equal(block(x), out)
    finally:
        safetorch.install()


@MONITORED
def test_torch_s_own_conversions_never_enter_safetorch() -> None:
    """``clip_grad_norm_`` calls ``.to()`` once per parameter, and a forward converts (``x.float()``, ``mask.to(x)``):
    on 3.12+ every conversion stays torch's own method, and only a discarded call in the program's code is looked at.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    x = torch.randn(8, 4, dtype=torch.float64)

    def step() -> torch.Tensor:
        loss = model(x.float().to(torch.float32)).pow(2).mean()
        loss.backward()
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)

    for name in discarded_conversion.METHODS:
        if hasattr(torch._C.TensorBase, name):
            assert getattr(torch.Tensor, name) is getattr(torch._C.TensorBase, name), name
    step()  # the first call: each code object is read once
    entered: list[str] = []
    own = safetorch.__file__.rsplit("/", 1)[0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(own):
            entered.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    with findings() as got:
        sys.setprofile(profile)
        try:
            norms = [step() for _ in range(3)]
        finally:
            sys.setprofile(None)
    assert [e for e in entered if "discarded_conversion" in e or "_monitor" in e or "_callsite" in e] == []
    assert got == []
    assert all(torch.isfinite(n) for n in norms)


def _discard_view_in_a_loop(xs: list[torch.Tensor]) -> int:
    for x in xs:
        x.view(-1)
    return lineno() - 1


@MONITORED
def test_a_discarded_shape_call_is_found_again_after_uninstall_and_install() -> None:
    xs = [torch.ones(2, 3)] * 2
    with findings() as got:
        line = _discard_view_in_a_loop(xs)
    assert [(w.filename, w.lineno) for w in got] == [(__file__, line)]
    safetorch.uninstall()
    assert not discarded_conversion._monitor.watching()
    with findings() as got:
        _discard_view_in_a_loop(xs)  # its start was seen and disabled: nothing watches it now
    assert got == []
    safetorch.install()
    from safetorch import _report

    _report.reset()
    with findings() as got:
        _discard_view_in_a_loop(xs)
    assert [(w.filename, w.lineno) for w in got] == [(__file__, line)]


def test_a_discarded_shape_call_in_the_module_that_imports_safetorch_is_found_in_its_running_frame(
        tmp_path: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text("import numpy as np\nimport torch\nimport safetorch\n\nx = torch.ones(4, 4)\na = np.ones(4)\n"
                      "for i in range(3):\n    a.view()\n    x.view(2, 8)\n    f = x.transpose\n    f(0, 1)\n"
                      "print('done', x.shape)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env=clean_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "done torch.Size([4, 4])" in proc.stdout
    assert f"{script}:9: DiscardedConversionWarning: ST001 x.view(2, 8) returns a new tensor of the new shape " \
           "and its result is discarded; x keeps its shape. Write: x = x.view(2, 8)" in proc.stderr, proc.stderr
    assert f"{script}:11: DiscardedConversionWarning: ST001 tensor.transpose() returns a new tensor of the new " \
           "shape" in proc.stderr, proc.stderr
    assert proc.stderr.count("DiscardedConversionWarning:") == 2, proc.stderr


@MONITORED
def test_strict_mode_raises_at_the_discarded_shape_call_with_no_frame_of_safetorch() -> None:
    safetorch.install(strict=True)
    x = torch.ones(2, 3)
    line = lineno() + 2
    with pytest.raises(SafetorchError, match=r"^ST001 x\.t\(\) returns a new tensor") as info:
        x.t()
    frames = [(tb.tb_frame.f_code.co_filename, tb.tb_lineno) for tb in _walk(info.value.__traceback__)]
    assert frames[-1] == (__file__, line)
    assert not any("/safetorch/" in f for f, _ in frames), frames


def _walk(tb: Any) -> Iterator[Any]:
    while tb is not None:
        yield tb
        tb = tb.tb_next


@MONITORED
def test_with_no_monitoring_tool_id_free_the_shape_methods_are_patched_and_still_found() -> None:
    safetorch.uninstall()
    taken = [tool for tool in (3, 4) if sys.monitoring.get_tool(tool) is None]
    for tool in taken:
        sys.monitoring.use_tool_id(tool, "another tool")
    try:
        safetorch.install()
        assert not discarded_conversion._monitor.watching()
        assert getattr(torch.Tensor.view, "__safetorch_patch__", False)
        x = torch.ones(2, 3)
        with findings() as got:
            x.view(3, 2); line = lineno()  # noqa: E702
        assert [(w.category, w.lineno) for w in got] == [(DiscardedConversionWarning, line)]
    finally:
        safetorch.uninstall()
        for tool in taken:
            sys.monitoring.free_tool_id(tool)
        safetorch.install()
    assert discarded_conversion._monitor.watching()


def test_a_shape_call_echoed_but_quieted_by_a_semicolon_is_a_discard(tmp_path: Any) -> None:
    """A notebook's last line ``x.view(3, 2);``: compiled to be echoed, and the ``;`` shows nothing, so the result
    is thrown away. Found as the patched methods find it, on the Pythons where the shape methods are not patched."""
    cell = tmp_path / "cell.py"
    cell.write_text("x.view(3, 2);\n")
    x = torch.ones(2, 3)
    with findings() as got:
        exec(compile(cell.read_text(), str(cell), "single"), {"x": x})
    assert [(w.category, w.filename, w.lineno, _text(w)) for w in got] == [
        (DiscardedConversionWarning, str(cell), 1,
         "ST001 x.view(3, 2) returns a new tensor of the new shape and its result is discarded; x keeps its shape. "
         "Write: x = x.view(3, 2)")]
