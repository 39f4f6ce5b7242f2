"""The user-facing tools driven as a user would: the runner, the exit report, the pytest plugin, torchrun."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import safetorch

from .conftest import ROOT, shows_safetorch
from .conftest import clean_env as _env
from .conftest import run_runner as _run

SCRIPT = textwrap.dedent("""\
    import sys
    import torch
    print("argv", sys.argv[1:], __name__)
    x = torch.ones(2)
    x.double()
    if __name__ == "__main__":
        print("main block")
    raise SystemExit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
""")


def _plain(args: list[str], cwd: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The same program run by ``python`` itself, in the same environment: what the runner must be identical to."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=_env(**env),
                          timeout=300)


@pytest.fixture
def script(tmp_path: os.PathLike[str]) -> str:
    path = os.path.join(tmp_path, "prog.py")
    with open(path, "w") as fh:
        fh.write(SCRIPT)
    return path


def test_script_gets_its_own_argv_main_and_exit_code(script: str, tmp_path: str) -> None:
    proc = _run([script, "3", "--flag"], cwd=str(tmp_path))
    assert proc.returncode == 3
    assert "argv ['3', '--flag'] __main__" in proc.stdout and "main block" in proc.stdout
    assert f"{script}:5: DiscardedConversionWarning: ST001 x.double()" in proc.stderr


def test_exit_report_text_and_json(script: str, tmp_path: str) -> None:
    report = os.path.join(tmp_path, "findings.json")
    proc = _run(["--report", report, script], cwd=str(tmp_path))
    assert proc.returncode == 1  # the program succeeded, and something was found
    assert re.search(rf"safetorch: 1 finding\(s\) at 1 occurrence\(s\)\n  ST001 {re.escape(script)}:5 \(x1\): "
                     r"x.double\(\) returns a copy", proc.stderr)
    with open(report) as fh:
        data = json.load(fh)
    assert [(d["code"], d["file"], d["line"], d["count"]) for d in data] == [("ST001", script, 5, 1)]
    assert data[0]["message"].startswith("ST001 x.double()")
    quiet = _run(["--report", "0", script], cwd=str(tmp_path))
    assert "finding(s)" not in quiet.stderr and "DiscardedConversionWarning" in quiet.stderr


def test_strict_stops_on_the_first_finding(script: str, tmp_path: str) -> None:
    proc = _run(["--strict", script, "0"], cwd=str(tmp_path))
    assert proc.returncode == 1
    assert "main block" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    error = next(i for i, ln in enumerate(lines) if ln.startswith("safetorch.SafetorchError: "))
    assert lines[error].startswith("safetorch.SafetorchError: ST001 x.double() returns a copy")
    frames = [ln for ln in lines[:error] if ln.startswith('  File "')]
    assert frames == [f'  File "{script}", line 5, in <module>']  # neither the runner's frames nor torch's
    assert lines[error + 1] == "safetorch: 1 finding(s) at 1 occurrence(s)"


def test_ignore_and_bad_ignore(script: str, tmp_path: str) -> None:
    assert "ST001" not in _run(["--ignore", "ST001", script], cwd=str(tmp_path)).stderr
    bad = _run(["--ignore", "ST123", script], cwd=str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.startswith("python -m safetorch: error: --ignore: unknown rule 'ST123'")
    assert len(bad.stderr.splitlines()) == 1


def test_module_form(tmp_path: str) -> None:
    pkg = os.path.join(tmp_path, "mypkg")
    os.makedirs(pkg)
    with open(os.path.join(pkg, "__init__.py"), "w"):
        pass
    with open(os.path.join(pkg, "train.py"), "w") as fh:
        fh.write(SCRIPT)
    proc = _run(["-m", "mypkg.train", "4"], cwd=str(tmp_path))
    assert proc.returncode == 4
    assert "argv ['4'] __main__" in proc.stdout and "main block" in proc.stdout
    assert "train.py:5: DiscardedConversionWarning" in proc.stderr


def test_help_and_console_script(tmp_path: str) -> None:
    proc = _run(["--help"], cwd=str(tmp_path))
    assert proc.returncode == 0
    for word in ("--strict", "--ignore", "-m module", "SAFETORCH_DISABLE", "SAFETORCH_REPORT"):
        assert word in proc.stdout
    assert proc.stdout.startswith("usage: python -m safetorch [options] [--] script.py [args ...]")
    for code, rule in safetorch.RULES.items():  # the rule list comes from the rule table
        assert re.search(rf"^  {code}  {re.escape(rule.name)} +{re.escape(rule.summary)}$", proc.stdout, re.M)
    # the console script of the Python running the tests (a virtual environment's, where it is not activated)
    beside = os.path.join(os.path.dirname(sys.executable), "safetorch")
    exe = beside if os.path.exists(beside) else shutil.which("safetorch")
    if exe is None:
        pytest.skip("the console script is not installed (pip install -e .)")
    console = subprocess.run([exe, "--help"], capture_output=True, text=True).stdout
    assert console == proc.stdout.replace("python -m safetorch", "safetorch")


def test_one_line_errors_and_tracebacks_without_the_runner(tmp_path: str) -> None:
    missing = _run(["nope.py"], cwd=str(tmp_path))
    assert (missing.returncode, missing.stderr) == (2, "python -m safetorch: error: can't open file 'nope.py': "
                                                       "no such file\n")
    module = _run(["-m", "nope"], cwd=str(tmp_path))
    assert (module.returncode, module.stderr) == (2, "python -m safetorch: error: no module named 'nope'\n")
    with open(os.path.join(tmp_path, "bad.py"), "w") as fh:
        fh.write("x = (\n")
    syntax = _run(["bad.py"], cwd=str(tmp_path))
    bad = os.path.join(os.path.realpath(tmp_path), "bad.py")
    assert syntax.returncode == 1 and syntax.stderr.startswith(f'  File "{bad}", line 1')  # as python prints it
    assert "runpy" not in syntax.stderr and not shows_safetorch(syntax.stderr)
    with open(os.path.join(tmp_path, "boom.py"), "w") as fh:
        fh.write("def f():\n    raise ValueError('boom')\nf()\n")
    boom = _run(["boom.py"], cwd=str(tmp_path))
    assert boom.returncode == 1
    assert boom.stderr.splitlines()[:2] == ["Traceback (most recent call last):",
                                            f'  File "{os.path.realpath(tmp_path)}/boom.py", line 3, in <module>']
    assert boom.stderr.splitlines()[-1] == "ValueError: boom"


@pytest.mark.slow
def test_spawned_workers_behave_as_without_the_runner(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "spawn.py")
    with open(path, "w") as fh:
        fh.write(textwrap.dedent("""\
            import multiprocessing as mp
            import torch

            def work(n):
                return float(torch.ones(n).double().sum())

            if __name__ == "__main__":
                with mp.get_context("spawn").Pool(2) as pool:
                    print(pool.map(work, [1, 2, 3]))
        """))
    proc = _run([path], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[1.0, 2.0, 3.0]"


# --- the program runs as `python script.py` / `python -m module` runs it ------------------------------------------

PROBE = textwrap.dedent("""\
    import builtins, inspect, json, os, pickle, sys, warnings

    class Thing:
        pass

    answer: int = 42  # a module annotation: kept by the runner on every Python (3.14 computes them, PEP 649)

    def spec(s):
        return None if s is None else [s.name, s.origin, s.cached, s.parent, type(s.loader).__name__]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("careful")
    main = sys.modules["__main__"]
    print(json.dumps({
        "__file__": __file__, "argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "__spec__": spec(__spec__),
        "__name__": __name__, "__package__": __package__, "__cached__": __cached__, "__doc__": __doc__,
        "__loader__": [type(__loader__).__name__, getattr(__loader__, "name", None), getattr(__loader__, "path", None)],
        "__builtins__ is builtins": __builtins__ is builtins,
        "annotations": {k: getattr(v, "__name__", repr(v)) for k, v in inspect.get_annotations(main).items()},
        "sys.modules['__main__'] runs this code": vars(main) is globals(),
        "dunders": sorted(k for k in globals() if k.startswith("__")),
        "co_filename": sys._getframe().f_code.co_filename,
        "warning": [caught[0].filename, caught[0].lineno],
        "pickled": type(pickle.loads(pickle.dumps(Thing()))).__module__,
    }))
""")


def _tree(tmp_path: str) -> str:
    """tmp/work (the current directory), tmp/scripts/probe.py, tmp/pkg/mod.py and tmp/app/__main__.py (a directory
    python runs): one probe, started every way python starts a program."""
    root = os.path.realpath(tmp_path)  # the current directory as the program reads it: os.getcwd() resolves links
    for sub, name in (("scripts", "probe.py"), ("pkg", "mod.py"), ("pkg", "__init__.py"), ("app", "__main__.py")):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
        with open(os.path.join(root, sub, name), "w") as fh:
            fh.write("" if name == "__init__.py" else PROBE)
    os.makedirs(os.path.join(root, "work"))
    return root


@pytest.mark.python
@pytest.mark.parametrize("cwd, start, env", [
    ("scripts", ["probe.py"], {}),  # a relative path in the current directory: __file__ was relative, dirname ""
    ("work", ["../scripts/probe.py"], {}),  # a relative path in another directory
    ("work", ["{root}/scripts/probe.py"], {}),  # an absolute path
    ("work", ["../scripts/probe.py"], {"PYTHONSAFEPATH": "1"}),  # python -P: no sys.path[0] at all
    ("work", ["../app"], {}),  # a directory with a __main__.py
    (".", ["-m", "pkg.mod"], {}),
    ("work", ["-m", "pkg.mod"], {}),  # not importable from there: both fail the same way
], ids=["relative", "relative-elsewhere", "absolute", "safe-path", "directory", "module", "module-elsewhere"])
def test_the_program_sees_what_a_plain_python_run_shows_it(tmp_path: str, cwd: str, start: list[str],
                                                           env: dict[str, str]) -> None:
    """__file__, sys.argv, sys.path, __spec__, __loader__, __package__, the __main__ in sys.modules, the file name
    of warnings and code: all as `python ...` itself sets them."""
    root = _tree(tmp_path)
    args = [a.format(root=root) for a in start] + ["1", "--two"]
    plain, runner = _plain(args, cwd=os.path.join(root, cwd), **env), _run(args, cwd=os.path.join(root, cwd), **env)
    if cwd == "work" and start[0] == "-m":
        assert plain.returncode == 1 and "No module named 'pkg'" in plain.stderr
        assert runner.returncode == 2 and "no module named 'pkg.mod'" in runner.stderr  # the runner's one line
        return
    assert (plain.returncode, runner.returncode) == (0, 0), runner.stderr
    seen, expected = json.loads(runner.stdout), json.loads(plain.stdout)
    assert seen == expected
    assert seen["sys.modules['__main__'] runs this code"] and seen["pickled"] == "__main__"
    assert seen["annotations"] == {"answer": "int"}


def test_the_console_script_starts_the_program_as_python_does(tmp_path: str) -> None:
    """`safetorch script.py`: the console script's own directory is not the program's sys.path[0]."""
    # the console script of the Python running the tests (a virtual environment's, where it is not activated)
    beside = os.path.join(os.path.dirname(sys.executable), "safetorch")
    exe = beside if os.path.exists(beside) else shutil.which("safetorch")
    if exe is None:
        pytest.skip("the console script is not installed (pip install -e .)")
    root = _tree(tmp_path)
    cwd = os.path.join(root, "work")
    runner = subprocess.run([exe, "../scripts/probe.py", "1"], capture_output=True, text=True, cwd=cwd, env=_env(),
                            timeout=300)
    assert runner.returncode == 0, runner.stderr
    assert json.loads(runner.stdout) == json.loads(_plain(["../scripts/probe.py", "1"], cwd=cwd).stdout)


CHDIR = textwrap.dedent("""\
    import os
    os.chdir(os.path.dirname(__file__))
    with open("data.txt") as fh:
        print(fh.read())
""")


def test_a_script_that_moves_to_its_own_directory(tmp_path: str) -> None:
    """`os.chdir(os.path.dirname(__file__))`, started by a relative path from the script's directory."""
    with open(os.path.join(tmp_path, "chdir.py"), "w") as fh:
        fh.write(CHDIR)
    with open(os.path.join(tmp_path, "data.txt"), "w") as fh:
        fh.write("found it")
    proc = _run(["chdir.py"], cwd=str(tmp_path))
    assert (proc.returncode, proc.stdout.strip()) == (0, "found it"), proc.stderr


PICKLES = textwrap.dedent("""\
    import atexit, copy, io, multiprocessing as mp, pickle
    import torch

    class Point:
        def __init__(self, x, y):
            self.x, self.y = x, y

    def double(p):
        return Point(p.x * 2, float(torch.tensor(p.y).double() * 2))

    def at_exit():  # after the program returned: __main__ is still the program's
        print("at exit", pickle.loads(pickle.dumps(Point(5, 6))).x, flush=True)

    if __name__ == "__main__":
        atexit.register(at_exit)
        p = pickle.loads(pickle.dumps(Point(1, 2)))
        print("pickle", type(p).__qualname__, p.x, p.y, pickle.loads(pickle.dumps(double)) is double)
        buf = io.BytesIO()
        torch.save({"p": p}, buf)
        buf.seek(0)
        print("torch.save", torch.load(buf, weights_only=False)["p"].x)
        print("deepcopy", copy.deepcopy(p).y)
        ctx = mp.get_context("spawn")
        with ctx.Pool(2) as pool:
            print("pool", [(q.x, q.y) for q in pool.map(double, [Point(1, 2), Point(3, 4)])])
        queue = ctx.Queue()
        worker = ctx.Process(target=queue.put, args=(Point(7, 8),))
        worker.start()
        got = queue.get(timeout=240)
        worker.join()
        print("process", type(got).__qualname__, got.x, worker.exitcode)
""")


@pytest.mark.slow
def test_script_defined_classes_and_functions_pickle_and_cross_into_spawned_workers(tmp_path: str) -> None:
    """pickle finds the script's classes in sys.modules['__main__'] (during the run and at exit), and spawned
    workers rebuild that __main__ from the script: the same output as a plain run, from another directory."""
    os.makedirs(os.path.join(tmp_path, "src"))
    with open(os.path.join(tmp_path, "src", "pickles.py"), "w") as fh:
        fh.write(PICKLES)
    plain, runner = (f([os.path.join("src", "pickles.py")], cwd=str(tmp_path)) for f in (_plain, _run))
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert runner.returncode == 0, runner.stderr[-3000:]
    assert runner.stdout == plain.stdout
    assert "pool [(2, 4.0), (6, 8.0)]" in runner.stdout and "process Point 7 0" in runner.stdout
    assert runner.stdout.endswith("at exit 5\n")


FAILS = textwrap.dedent("""\
    import warnings

    def check(n):
        warnings.warn(f"n is {n}")
        if n > 1:
            raise ValueError(f"n is {n}")

    check(1)
    check(2)
""")


@pytest.mark.parametrize("path", ["fails.py", os.path.join("..", "here", "fails.py"), "{tmp}/here/fails.py"])
def test_warnings_and_tracebacks_name_the_files_python_names(tmp_path: str, path: str) -> None:
    """What the user reads on stderr, a warning's file:line and every frame of the traceback, is what `python`
    prints (an absolute path, joined to the current directory unnormalized), without a frame of the runner."""
    tmp = os.path.realpath(tmp_path)
    os.makedirs(os.path.join(tmp, "here"))
    os.makedirs(os.path.join(tmp, "there"))
    with open(os.path.join(tmp, "here", "fails.py"), "w") as fh:
        fh.write(FAILS)
    cwd = os.path.join(tmp, "here" if path == "fails.py" else "there")
    args = [path.format(tmp=tmp)]
    plain, runner = _plain(args, cwd=cwd), _run(args, cwd=cwd)
    assert (plain.returncode, runner.returncode) == (1, 1)
    assert runner.stderr == plain.stderr
    shown = os.path.join(cwd, path) if not os.path.isabs(args[0]) else args[0]
    assert f'  File "{shown}", line 9, in <module>' in runner.stderr
    assert runner.stderr.startswith(f"{shown}:4: UserWarning: n is 1\n")


def test_the_demo_fires_every_rule_once_on_its_line() -> None:
    demo = os.path.join("examples", "demo.py")
    proc = _run([demo], cwd=ROOT, SAFETORCH_REPORT="0")
    assert proc.returncode == 1, proc.stderr  # it succeeded, with findings
    with open(os.path.join(ROOT, demo)) as fh:
        marked = {m.group(1): n for n, line in enumerate(fh, 1) if (m := re.search(r"# (ST0\d\d):", line))}
    shown = re.escape(os.path.join(os.path.realpath(ROOT), demo))  # absolute, as `python examples/demo.py` shows it
    fired = re.findall(rf"^{shown}:(\d+): \w+Warning: (ST0\d\d) ", proc.stderr, re.M)
    assert sorted((code, int(line)) for line, code in fired) == sorted(marked.items())
    assert set(marked) == set(safetorch.RULES) - {"ST016", "ST017"}  # those need a job of several ranks


HOOKED_DEMO = textwrap.dedent("""\
    import collections, json, runpy, sys
    import torch
    from torch.nn.modules import module as nn_module
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    calls = collections.Counter()
    order = sys.argv[1]

    def user_hooks(when):
        late = []

        def post(m, a, out):
            calls.update([when + " post"])
            if m.training and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: calls.update([when + " grad"]))  # a backward hook
            if len(late) < 3:  # step pre-hooks registered during the run: after the ones standing then
                late.append(register_optimizer_step_pre_hook(lambda o, a, k: calls.update([when + " late step"])))

        nn_module.register_module_forward_pre_hook(lambda m, a: calls.update([when + " pre"]))
        nn_module.register_module_forward_hook(post)
        register_optimizer_step_pre_hook(lambda o, a, k: calls.update([when + " step"]))

    if order == "user first":
        user_hooks("first")
    import safetorch
    if order == "safetorch first":
        user_hooks("after")
    runpy.run_path("examples/demo.py", run_name="__main__")
    print(json.dumps(calls))
""")


@pytest.mark.slow
@pytest.mark.parametrize("order", ["user first", "safetorch first"])
def test_user_hooks_before_and_after_ours_over_the_demo_that_fires_every_rule(order: str) -> None:
    """The user's module forward pre/post hooks, step pre-hooks and tensor backward hooks, registered before
    safetorch's and after them (step pre-hooks registered during the run stand after the ones safetorch has put in
    place by then): every rule fires, nothing raises, every hook is called."""
    proc = subprocess.run([sys.executable, "-c", HOOKED_DEMO, order], capture_output=True, text=True, cwd=ROOT,
                          env=_env(SAFETORCH_REPORT="0"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fired = set(re.findall(r"^examples/demo\.py:\d+: \w+Warning: (ST0\d\d) ", proc.stderr, re.M))
    expected = set(safetorch.RULES) - {"ST016", "ST017"}  # those need a job of several ranks
    assert fired == expected, sorted(expected ^ fired)
    calls = json.loads(proc.stdout.strip().splitlines()[-1])
    when = "first" if order == "user first" else "after"
    for kind in ("pre", "post", "step", "grad", "late step"):
        assert calls.get(f"{when} {kind}", 0) > 0, (kind, calls)
    assert calls[f"{when} pre"] == calls[f"{when} post"]


# --- pytest plugin --------------------------------------------------------------------------------------------

TEST_FILE = textwrap.dedent("""\
    import torch

    def test_discards():
        x = torch.ones(2)
        x.double()
""")


def _pytest(tmp_path: str, *args: str, ini: str = "") -> subprocess.CompletedProcess[str]:
    with open(os.path.join(tmp_path, "test_user.py"), "w") as fh:
        fh.write(TEST_FILE)
    with open(os.path.join(tmp_path, "pytest.ini"), "w") as fh:
        fh.write("[pytest]\n" + ini)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=300)


def test_plugin_off_leaves_the_suite_as_it_was(tmp_path: str) -> None:
    proc = _pytest(tmp_path)
    assert proc.returncode == 0
    assert "ST001" not in proc.stdout and "1 passed" in proc.stdout


def test_plugin_reports_findings_in_the_warnings_summary(tmp_path: str) -> None:
    proc = _pytest(tmp_path, "--safetorch")
    assert proc.returncode == 0
    assert "test_user.py:5: DiscardedConversionWarning: ST001 x.double() returns a copy" in proc.stdout
    lines = proc.stdout.splitlines()
    section = next(i for i, ln in enumerate(lines) if "safetorch" in ln and ln.startswith("="))
    assert lines[section + 1] == "safetorch: 1 finding(s) at 1 occurrence(s)"
    assert "1 passed" in lines[-1] and section < len(lines) - 1  # the summary comes before pytest's last line
    assert "safetorch:" not in proc.stderr


@pytest.mark.slow
def test_plugin_strict_fails_the_test(tmp_path: str) -> None:
    for args, ini in ((("--safetorch-strict",), ""), ((), "safetorch_strict = true\n")):
        proc = _pytest(tmp_path, *args, ini=ini)
        assert proc.returncode == 1
        assert "SafetorchError: ST001 x.double() returns a copy" in proc.stdout
        # the failure ends on the test's line, and the short summary starts with the finding, not its type
        assert "test_user.py:5: SafetorchError" in proc.stdout
        assert "FAILED test_user.py::test_discards - ST001 x.double()" in proc.stdout


EVAL_TEST = textwrap.dedent("""\
    import torch

    def test_eval():
        m = torch.nn.Linear(2, 2).eval()
        for _ in range(2):
            m(torch.ones(1, 2))
""")


@pytest.mark.slow
def test_plugin_strict_failure_of_an_eval_forward_shows_no_torch_frame(tmp_path: str) -> None:
    with open(os.path.join(tmp_path, "test_eval.py"), "w") as fh:
        fh.write(EVAL_TEST)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--safetorch-strict",
                           "test_eval.py"], capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=300)
    assert proc.returncode == 1
    assert "test_eval.py:6: SafetorchError" in proc.stdout and "module.py" not in proc.stdout
    assert "ST001" in _pytest(tmp_path, ini="safetorch = true\n").stdout


# --- torchrun -------------------------------------------------------------------------------------------------

DDP_SCRIPT = textwrap.dedent("""\
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    x = torch.ones(8, 4)
    x.double()
    loss = model(x).sum()
    if rank == 1:
        loss = loss * float("nan")
    loss.backward()
    model.eval()
    for _ in range(3):  # the first eval forward is watched (run as written), the next ones keep no activations
        out = model(x)
    print(f"rank {rank} eval output requires grad: {out.requires_grad}")  # its graph, as written
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # a correct DDP loop: the step checks stay silent
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    plain = torch.nn.Linear(4, 1)
    plain.load_state_dict(model.state_dict(), strict=False)  # DDP's keys start with "module."
    dist.barrier()
    dist.destroy_process_group()
""")


DDP_EVAL_SCRIPT = textwrap.dedent("""\
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for epoch in range(3):
        model.train()
        for _ in range(4):  # gradient accumulation: the first micro-batch asks for no all-reduce
            opt.zero_grad()
            with model.no_sync():
                model(torch.randn(8, 6, generator=g)).pow(2).mean().backward()
            loss = model(torch.randn(8, 6, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        model.eval()
        for _ in range(3):  # an evaluation through the DDP wrapper without no_grad
            score = model(torch.randn(8, 6, generator=g)).mean().item()
    weights = " ".join(f"{p.double().sum().item():.17g}" for p in net.parameters())
    dist.barrier()
    for r in range(2):  # one line per rank, one rank at a time
        if r == rank:
            print(f"rank {rank} losses " + " ".join(f"{v:.17g}" for v in losses) + " weights " + weights, flush=True)
        dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_an_evaluation_through_ddp_without_no_grad_trains_bit_identically(tmp_path: str) -> None:
    """DDP's forward with autograd on prepares its reducer for a backward; safetorch's act keeps that forward as it
    is, so the next training step all-reduces exactly as without safetorch."""
    path = os.path.join(tmp_path, "ddp_eval.py")
    with open(path, "w") as fh:
        fh.write(DDP_EVAL_SCRIPT)
    runs = {}
    for name, extra in (("on", {}), ("off", {"SAFETORCH_DISABLE": "1"})):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "safetorch", path]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path,
                              env=_env(OMP_NUM_THREADS="1", **extra), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
        if name == "on":
            assert proc.stderr.count("EvalModeGradWarning: ST003 model (DistributedDataParallel)") == 1
    assert len(runs["on"]) == 2 and runs["on"] == runs["off"]


@pytest.mark.slow
def test_torchrun_prints_each_finding_once_for_the_job(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "ddp.py")
    with open(path, "w") as fh:
        fh.write(DDP_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "safetorch", path]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=_env(OMP_NUM_THREADS="1"),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stderr
    assert out.count("DiscardedConversionWarning: ST001 x.double()") == 1
    assert out.count("NonFiniteLossWarning: ST006 [rank 1] loss is nan") == 1
    assert "[rank 0]" not in out
    assert out.count("EvalModeGradWarning: ST003 model (DistributedDataParallel)") == 1  # DDP in eval mode
    assert proc.stdout.count("eval output requires grad: True") == 2
    assert out.count("StateDictLoadedNothingWarning: ST014 load_state_dict") == 1
    assert "ST010" not in out and "ST011" not in out


def test_another_python_the_program_starts_gets_nothing_from_the_runner_and_says_nothing(tmp_path: str) -> None:
    # A tool of another virtual environment (here: one without torch) starts with the runner's start-up hook on its
    # PYTHONPATH: it does not install safetorch there, and prints nothing of it.
    import venv

    other = os.path.join(tmp_path, "other-venv")
    venv.EnvBuilder(with_pip=False).create(other)
    other_python = os.path.join(other, "bin", "python")
    program = os.path.join(tmp_path, "starts_another.py")
    with open(program, "w") as fh:
        fh.write(textwrap.dedent(f"""\
            import subprocess, sys
            child = subprocess.run([{other_python!r}, "-c", "import sys; print('child', 'safetorch' in sys.modules)"],
                                   capture_output=True, text=True)
            print(child.stdout.strip(), repr(child.stderr))
            same = subprocess.run([sys.executable, "-c", "import sys; print('safetorch' in sys.modules)"],
                                  capture_output=True, text=True)
            print("same python", same.stdout.strip())
        """))
    proc = _run([program], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["child False ''", "same python True"]
