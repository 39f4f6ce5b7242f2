"""The reporter, config and install under hostile conditions: no finding lost, none swallowed, no memory that grows.

Each test is a probe a user or an adversary ran; most run a fresh interpreter, as the program would.
"""

from __future__ import annotations

import json
import os
import stat
import textwrap
import warnings
from typing import Any

import pytest
import torch

import safetorch
from safetorch import DiscardedConversionWarning, EvalModeGradWarning, _callsite, _report

from .conftest import findings, lineno, run_python

PROGRAM = textwrap.dedent("""\
    import torch
    import safetorch
    x = torch.ones(2)
    for _ in range(2):
        x.double()
    print("after")
""")


def _script(tmp_path: Any, source: str = PROGRAM, name: str = "prog.py") -> str:
    path = os.path.join(str(tmp_path), name)
    with open(path, "w") as fh:
        fh.write(source)
    return path


def _run_file(path: str, *options: str, env: dict[str, str] | None = None) -> Any:
    import subprocess
    import sys

    from .conftest import ROOT

    full = {k: v for k, v in os.environ.items() if not k.startswith("SAFETORCH_")}
    full.update(env or {})
    full["PYTHONPATH"] = ROOT
    return subprocess.run([sys.executable, *options, path], capture_output=True, text=True, env=full, timeout=300)


@pytest.mark.parametrize("option", ["error:ST", "error", "error::UserWarning"])
def test_W_error_raises_the_finding_at_the_users_line(tmp_path: Any, option: str) -> None:
    path = _script(tmp_path)
    proc = _run_file(path, "-W", option)
    assert proc.returncode == 1
    assert "after" not in proc.stdout
    lines = proc.stderr.splitlines()
    error = next(i for i, ln in enumerate(lines) if ln.startswith("safetorch.DiscardedConversionWarning: ST001"))
    frames = [ln for ln in lines[:error] if ln.startswith('  File "')]
    assert frames[-1] == f'  File "{path}", line 5, in <module>'
    assert "failed internally" not in proc.stderr


def test_W_error_applies_to_st003_and_grad_mode_survives() -> None:
    proc = run_python(textwrap.dedent("""\
        import warnings, torch, safetorch
        warnings.simplefilter("error", safetorch.SafetorchWarning)
        model = torch.nn.Linear(2, 2).eval()
        try:
            for _ in range(2):
                model(torch.ones(1, 2))
        except safetorch.EvalModeGradWarning as w:
            print("raised", str(w)[:5], torch.is_grad_enabled())
        """))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "raised ST003 True"


def test_a_bad_environment_value_under_W_error_says_so() -> None:
    proc = run_python("import safetorch", env={"SAFETORCH_STRICT": "maybe"})
    assert proc.returncode == 0 and "SAFETORCH_STRICT='maybe' is not understood" in proc.stderr
    strict = run_python("import warnings; warnings.simplefilter('error'); import safetorch",
                        env={"SAFETORCH_STRICT": "maybe"})
    assert strict.returncode == 1
    assert "SafetorchConfigWarning: safetorch: SAFETORCH_STRICT='maybe' is not understood" in strict.stderr


def test_exec_code_without_a_module_name_gets_its_warning() -> None:
    with findings() as got:
        exec(compile("import torch\nx = torch.ones(2)\nx.double()\n", "f.py", "exec"), {})
    assert [(w.category, w.filename, w.lineno) for w in got] == [(DiscardedConversionWarning, "f.py", 3)]


def test_a_finding_first_hit_under_an_ignore_filter_is_shown_at_its_next_hit() -> None:
    def convert(t: torch.Tensor) -> None:
        t.double(); convert.line = lineno()  # type: ignore[attr-defined]  # noqa: E702

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(torch.ones(2))
    with findings() as got:
        convert(torch.ones(2))
        convert(torch.ones(2))
    assert [(w.category, w.lineno) for w in got] == [(DiscardedConversionWarning, convert.line)]  # type: ignore
    assert _report.findings()[0].count == 3


def test_a_user_file_named_like_generated_code_is_reported() -> None:
    with findings() as got:
        exec(compile("import torch\ntorch.ones(2).double()\n", "<torch_gen>", "exec"), {"__name__": "gen"})
    assert [(w.category, w.filename, w.lineno) for w in got] == [(DiscardedConversionWarning, "<torch_gen>", 2)]


@pytest.mark.parametrize("where", ["missing directory", "a directory", "read-only file"])
def test_an_unwritable_report_says_so_and_keeps_the_summary(tmp_path: Any, where: str) -> None:
    path = _script(tmp_path)
    target = {"missing directory": os.path.join(str(tmp_path), "nope", "r.json"), "a directory": str(tmp_path),
              "read-only file": os.path.join(str(tmp_path), "ro.json")}[where]
    if where == "read-only file":
        with open(target, "w") as fh:
            fh.write("old")
        os.chmod(target, stat.S_IRUSR)
        if os.access(target, os.W_OK):  # root writes anyway
            pytest.skip("this user can write read-only files")
    proc = _run_file(path, env={"SAFETORCH_REPORT": target})
    assert proc.returncode == 0, proc.stderr
    assert f"safetorch: the report {target!r} could not be written" in proc.stderr
    assert "safetorch: 1 finding(s) at 2 occurrence(s)" in proc.stderr


def test_the_report_is_written_with_no_findings_and_in_strict_mode(tmp_path: Any) -> None:
    clean = _script(tmp_path, "import torch, safetorch\nx = torch.ones(2).double()\n", "clean.py")
    report = os.path.join(str(tmp_path), "r.json")
    proc = _run_file(clean, env={"SAFETORCH_REPORT": report})
    assert proc.returncode == 0 and proc.stderr == ""
    with open(report) as fh:
        assert json.load(fh) == []
    proc = _run_file(_script(tmp_path), env={"SAFETORCH_REPORT": report, "SAFETORCH_STRICT": "1"})
    assert proc.returncode == 1
    with open(report) as fh:
        data = json.load(fh)
    assert [(d["code"], d["line"], d["count"]) for d in data] == [("ST001", 5, 1)]


@pytest.mark.parametrize("strict", ["false", "0", 1, "yes"])
def test_install_refuses_a_strict_that_is_not_a_bool(strict: Any) -> None:
    with pytest.raises(ValueError, match="strict= takes True, False or None"):
        safetorch.install(strict=strict)
    assert safetorch._config.current.strict is False


@pytest.mark.parametrize("ignore", [123, [1], ["ST001", None]])
def test_install_refuses_an_ignore_that_is_not_strings(ignore: Any) -> None:
    with pytest.raises(TypeError, match=r"ignore= takes rule codes or names.*valid rules are ST001 \(discarded"):
        safetorch.install(ignore=ignore)


def test_a_check_that_cannot_import_is_skipped_alone() -> None:
    proc = run_python(textwrap.dedent("""\
        import sys, warnings
        warnings.simplefilter("always")
        sys.modules["safetorch.checks.volatile_variable"] = None  # as if an API it needs were missing
        import safetorch
        print(",".join(safetorch.installed_checks()))
        """))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ",".join(code for code in safetorch.RULES if code != "ST005")
    assert proc.stderr.count("SafetorchInternalWarning") == 1
    assert "check volatile_variable could not be imported (ModuleNotFoundError: import of " \
        "safetorch.checks.volatile_variable halted" in proc.stderr


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc")
def test_many_generated_call_sites_keep_bounded_memory() -> None:
    """Generated code (or a long notebook) makes a new call site per cell: the caches must not keep them all. Each
    site is a fresh code object, as each exec'd cell is; unbounded caches kept about 2 KiB per site."""
    scope = {"x": torch.ones(2), "__name__": "generated"}
    base = compile("y = x.float()", "generated.py", "exec")
    for i in range(1000):  # warm up the allocator and the caches
        exec(base.replace(co_name=f"warm{i}"), scope)
    before = _rss()
    for i in range(200_000):
        exec(base.replace(co_name=f"site{i}"), scope)
    grown = _rss() - before
    assert grown < 96 * 2**20, f"{grown / 2**20:.0f} MiB"
    assert len(_callsite._discarded) <= _callsite.MAX_ANSWERS + 1
    assert len(_callsite._code_infos) <= _callsite.MAX_CODE_INFOS + 1
    safetorch.uninstall()
    assert not _callsite._discarded and not _callsite._code_infos and not _report._internal_codes
    safetorch.install()


def test_a_key_function_is_not_a_discarded_call() -> None:
    ts = [torch.ones(1), torch.zeros(1)]
    with findings() as got:
        ts.sort(key=torch.Tensor.float)
        for _ in map(torch.Tensor.float, ts):
            pass
        any(map(torch.Tensor.bool, ts))
        sorted(ts, key=torch.Tensor.double)
    assert got == []
    with findings() as got:
        ts[0].float(); line = lineno()  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(DiscardedConversionWarning, line)]


def test_a_backward_under_fake_tensor_mode_is_silent() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with findings() as got, FakeTensorMode():
        w = torch.randn(3, requires_grad=True)
        (w * 2).sum().backward()
    assert got == []


def test_eval_mode_findings_under_warning_filters_follow_them() -> None:
    model = torch.nn.Linear(2, 2).eval()

    def evaluate() -> None:
        for _ in range(2):
            model(torch.ones(1, 2)); evaluate.line = lineno()  # type: ignore[attr-defined]  # noqa: E702

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=EvalModeGradWarning)
        evaluate()
    with findings() as got:
        evaluate()
    assert [(w.category, w.lineno) for w in got] == [(EvalModeGradWarning, evaluate.line)]  # type: ignore


def test_torch_function_dispatch_on_a_patched_method_behaves_as_without_safetorch() -> None:
    """A subclass that handles torch.Tensor.float specially, by equality (or a dict), as torch's own do."""
    handled: list[Any] = []

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func == torch.Tensor.float or func in {torch._C.TensorBase.float: 1}:
                handled.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    t = torch.ones(2, dtype=torch.float64).as_subclass(Logged)
    y = t.float()
    assert len(handled) == 1 and type(y) is Logged and y.dtype == torch.float32
    assert torch.Tensor.float == torch._C.TensorBase.float  # equal to the original, which torch's allow-lists hold


def test_patched_class_attributes_are_one_object_and_dispatch_by_identity_works() -> None:
    """``torch.Tensor.float is torch.Tensor.float``, as without safetorch, for every attribute safetorch patches on
    a class; a subclass dispatching on ``func is torch.Tensor.float`` (captured after import) sees its method."""
    from safetorch._patch import registry

    for owner, name in registry.touched():
        if isinstance(owner, type):
            assert getattr(owner, name) is getattr(owner, name), (owner, name)
    float_method = torch.Tensor.float
    seen: list[str] = []

    class ByIdentity(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is float_method:
                seen.append("float")
                return torch.zeros(3)  # handled here, as a subclass with its own float() would
            return super().__torch_function__(func, types, args, kwargs or {})

    t = torch.ones(2, dtype=torch.float64).as_subclass(ByIdentity)
    assert torch.equal(t.float(), torch.zeros(3)) and seen == ["float"]
    assert torch.equal(torch.Tensor.float(t), torch.zeros(3)) and seen == ["float", "float"]
    assert t.double().dtype == torch.float64 and seen == ["float", "float"]


def test_torchs_own_dispatch_tables_keyed_by_the_original_methods_still_match() -> None:
    """MaskedTensor registers its handlers under torch.Tensor.contiguous & co. when torch is imported, before any
    patch: a patched method must hash and compare as the original to be found there."""
    from torch.masked import masked_tensor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The PyTorch API of MaskedTensors is in prototype stage"
        mt = masked_tensor(torch.ones(2, 3), torch.tensor([[True, False, True]] * 2))
        assert type(mt.contiguous()).__name__ == "MaskedTensor"
        assert type(mt.to(torch.float64)).__name__ == "MaskedTensor"
        assert torch.equal(mt.detach().get_mask(), mt.get_mask())


def test_every_way_of_calling_autograd_backward_reaches_torch_with_its_arguments() -> None:
    """The backward patch has torch's own parameters: positional, keyword, deprecated and ``inputs=`` calls give the
    same gradients as torch's function, and its errors are torch's."""
    from safetorch import _backward

    assert torch.autograd.backward.__code__ is _backward._dispatch_known(None).__code__
    w, v = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)

    def grads(call: Any) -> list[Any]:
        w.grad = v.grad = None
        call((w * v * 2).sum())
        return [None if t.grad is None else t.grad.tolist() for t in (w, v)]

    both, only_w = [[2.0] * 3, [2.0] * 3], [[2.0] * 3, None]
    assert grads(lambda y: torch.autograd.backward(y)) == both
    assert grads(lambda y: torch.autograd.backward(tensors=y, grad_tensors=torch.tensor(3.0))) == [[6.0] * 3] * 2
    assert grads(lambda y: torch.autograd.backward([y], None, True, False, None, [w])) == only_w
    assert grads(lambda y: y.backward(inputs=[w])) == only_w
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates grad_variables
        assert grads(lambda y: torch.autograd.backward(y, grad_variables=torch.tensor(0.5))) == [[1.0] * 3] * 2
    with pytest.raises(TypeError, match="unexpected keyword argument 'gradient'"):
        torch.autograd.backward((w * 2).sum(), gradient=None)
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.autograd.backward(torch.ones(2).sum())


def test_a_backward_with_other_parameters_than_torchs_known_ones_is_patched_with_args_and_kwargs() -> None:
    """Should torch change ``autograd.backward``'s parameters, the patch passes whatever it is given."""
    from safetorch import _backward

    seen: list[Any] = []

    def backward(tensors: Any, *, grad: Any = None, inputs: Any = None) -> str:
        seen.append((tensors, grad, inputs))
        return "torch's"

    patched = _backward._dispatch(backward)
    assert patched.__code__ is _backward._dispatch_any(None).__code__
    assert patched("t", grad="g") == "torch's" and patched(tensors="u") == "torch's"
    assert seen == [("t", "g", None), ("u", None, None)]
