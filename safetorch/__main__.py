"""``python -m safetorch [options] [--] script.py [args…]`` or ``… -m module [args…]``; ``safetorch rules``,
``safetorch explain ST003``, ``safetorch fix train.py`` (`safetorch._fix`), ``safetorch --version``.

Runs a program with every check installed and no change to its code, the way ``python -m cProfile`` does: the
program sees its own ``sys.argv``, runs as ``__main__`` (so ``if __name__ == "__main__":`` blocks and spawned
workers behave as without the runner). A program that fails exits with its own status; one that succeeds exits 1
when anything was found, as a linter does in CI (``--exit-zero``: 0).
"""

from __future__ import annotations

import argparse
import os
import sys

from safetorch import _launch

_ENVIRONMENT = """\
configuration (each setting from the first that sets it: these options, the environment, [tool.safetorch] in the
nearest pyproject.toml, the defaults):
  SAFETORCH_STRICT=1                  findings raise SafetorchError
  SAFETORCH_DISABLE=1                 patch nothing: the program runs exactly as without safetorch
  SAFETORCH_IGNORE=ST004,ST007        rules to switch off
  SAFETORCH_SELECT=ST001,ST003        only these rules
  SAFETORCH_REPORT=0 | path.json      no exit summary | also write the report to that file
  SAFETORCH_FORMAT=concise            text, concise, json, sarif or github

exit status: the program's own when it fails; otherwise 1 when anything was found (0 with --exit-zero).
"""

_USAGE = """\
%(prog)s [options] [--] script.py [args ...]
       %(prog)s [options] -m module [args ...]
       %(prog)s fix [--write [--no-verify]] [--check] [--verify] [--from REPORT.json] [script.py [args ...]]
       %(prog)s rules | explain CODE | --version"""


def _prog() -> str:
    """``python -m safetorch`` or the console script's name, whichever way the runner was started."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m safetorch" if name in ("", "__main__.py", "-m", "-c") else name


def _rule_table() -> str:
    from safetorch._rules import RULES

    width = max(len(r.name) for r in RULES.values())
    return "\n".join(f"{r.code}  {r.name:<{width}}  {r.summary}" for r in RULES.values())


def _parser() -> argparse.ArgumentParser:
    from safetorch import _config

    parser = argparse.ArgumentParser(
        prog=_prog(), formatter_class=argparse.RawDescriptionHelpFormatter, usage=_USAGE,
        description="Run a PyTorch program with safetorch's checks installed, without changing its code.",
        epilog=_ENVIRONMENT + "\nrules (safetorch explain CODE for one):\n" + "\n".join(
            "  " + line for line in _rule_table().splitlines()))
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--strict", action="store_true",
                        help="every finding raises safetorch.SafetorchError at its line (SAFETORCH_STRICT=1)")
    parser.add_argument("--ignore", metavar="CODES",
                        help="switch rules off: codes or names, comma-separated, e.g. ST004,empty-cache-loop "
                             "(SAFETORCH_IGNORE)")
    parser.add_argument("--select", metavar="CODES",
                        help="only these rules: codes or names, comma-separated (SAFETORCH_SELECT)")
    parser.add_argument("--report", metavar="PATH|0",
                        help="also write the report to PATH (JSON; SARIF with --format sarif), or 0: no summary "
                             "(SAFETORCH_REPORT)")
    parser.add_argument("--format", choices=_config.FORMATS,
                        help="text: warnings in full, one line per finding at exit (the default); concise: one "
                             "line per warning, its fix included; json / sarif: the report on stdout at exit, which "
                             "it owns: the program's own stdout goes to stderr (with --report PATH the document "
                             "goes to PATH and the program keeps its stdout); github: workflow commands, "
                             "annotations on a pull request (SAFETORCH_FORMAT)")
    parser.add_argument("--exit-zero", action="store_true",
                        help="exit 0 when the program succeeded, whatever was found")
    parser.add_argument("-m", dest="module", metavar="module", nargs=argparse.REMAINDER,
                        help="run a library module as a script, like python -m (the rest are its arguments)")
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="script.py [args ...]",
                        help="the script to run and its arguments")
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("safetorch")
    except PackageNotFoundError:
        return "0+unknown"


def _fail(message: str) -> int:
    print(f"{_prog()}: error: {message}", file=sys.stderr)
    return 2


def _rules_command(argv: list[str]) -> int:
    if argv:
        return _fail(f"rules takes no arguments, got {' '.join(argv)!r}")
    print(_rule_table())
    return 0


def _explain_command(argv: list[str]) -> int:
    from safetorch import _docs
    from safetorch._rules import resolve, valid_tokens

    if len(argv) != 1:
        return _fail("explain takes one rule, a code or a name: explain ST003")
    code = resolve(argv[0])
    if code is None:
        return _fail(f"unknown rule {argv[0]!r}; valid rules are {valid_tokens()}")
    page = _docs.page(code)
    if page is None:
        return _fail(f"the page of {code} is not installed with this copy of safetorch (docs/rules/{code}.md)")
    try:
        print(page.rstrip("\n"), flush=True)
    except BrokenPipeError:  # `safetorch explain ST003 | head`
        sys.stdout = None  # type: ignore[assignment]  (nothing more to flush at exit)
    return 0


def _own_stdout(fmt: str, report: bool | str) -> None:
    """Under ``--format json|sarif`` with no ``--report`` file the document owns stdout, as ruff's does: the
    program's own stdout goes to stderr for the whole run (file descriptor 1 itself, so that its subprocesses, spawned
    workers and C extensions follow), and the document is written at exit to the stdout the runner was given.
    ``python -m safetorch --format json train.py > findings.json`` is then a valid document, whatever it prints."""
    from safetorch import _report

    if fmt not in ("json", "sarif") or report is not True:
        return  # text, concise, github; a --report file; or no report at all (--report 0)
    try:
        sys.stdout.flush()
        saved = os.dup(1)  # not inheritable: the program's children never see it
        os.dup2(2, 1)
    except (OSError, AttributeError, ValueError):
        return  # no stdout or stderr to speak of: the document goes where sys.stdout goes
    _report.document_fd = saved
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:  # buffered for the file stdout was; on stderr now, its lines come as they are printed
        try:
            reconfigure(line_buffering=True)
        except (OSError, ValueError):
            pass


def _join_threads() -> None:
    """Wait for the program's non-daemon threads, as the interpreter does at exit (it would, after this returns)."""
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon and thread.is_alive():
            thread.join()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "rules":
        return _rules_command(argv[1:])
    if argv and argv[0] == "explain":
        return _explain_command(argv[1:])
    if argv and argv[0] == "fix":
        from safetorch import _fix

        return _fix.main(argv[1:], _prog())
    parser = _parser()
    ns = parser.parse_args(argv)
    if ns.program and ns.program[0] == "--":  # `safetorch --strict -- train.py`: the rest is the program's
        ns.program = ns.program[1:]
    from safetorch import _config, _rules

    for option, value in (("--ignore", ns.ignore), ("--select", ns.select)):
        for token in _config._split(value or ""):
            if _rules.resolve(token) is None:
                return _fail(f"{option}: unknown rule {token!r}; valid rules are {_rules.valid_tokens()}")
    if ns.select is not None and not _config._split(ns.select):
        return _fail(f"--select names no rule; valid rules are {_rules.valid_tokens()}")

    module = ns.module[0] if ns.module else None
    args = ns.module[1:] if ns.module else ns.program
    if ns.module is not None and not ns.module:
        return _fail("-m needs a module name")
    if module is None and not args:
        return _fail("no script to run (see --help)")
    if module is None and not os.path.exists(args[0]):
        return _fail(f"can't open file {args[0]!r}: no such file")
    if module is not None and not _launch.importable(module):
        return _fail(f"no module named {module!r}")
    # Every Python the program starts installs safetorch with the same settings and reports into this run: the
    # start-up hook in safetorch/_boot (a sitecustomize, which chains to any other) sees SAFETORCH_RUNNER.
    if ns.strict:
        os.environ["SAFETORCH_STRICT"] = "1"
    if ns.ignore is not None:
        os.environ["SAFETORCH_IGNORE"] = ns.ignore
    if ns.select is not None:
        os.environ["SAFETORCH_SELECT"] = ns.select
    if ns.format is not None:
        os.environ["SAFETORCH_FORMAT"] = ns.format
    boot = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")
    os.environ["SAFETORCH_RUNNER"] = "1"
    os.environ["SAFETORCH_RUNNER_PYTHON"] = f"{sys.prefix}{os.pathsep}{sys.implementation.cache_tag}"  # see _boot
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (boot, os.environ.get("PYTHONPATH", "")) if p)

    if _config.PYPROJECT_ENV not in os.environ:
        # [tool.safetorch] as a plain run finds it, from the script (a directory or zip: from itself), for every
        # process of the run
        found = None
        if module is None:
            target = os.path.abspath(args[0])
            found = _config.find_pyproject(target if os.path.isdir(target) else os.path.dirname(target))
        os.environ[_config.PYPROJECT_ENV] = found or _config.find_pyproject(os.getcwd()) or "0"  # 0: none, for all

    import dataclasses

    import safetorch
    from safetorch import _report, _run

    try:
        safetorch.install(strict=ns.strict or None, ignore=ns.ignore, select=ns.select)
    except (ValueError, TypeError) as exc:
        return _fail(str(exc).removeprefix("safetorch: "))
    if ns.report is not None:
        _config.current = dataclasses.replace(_config.current, report=_config.parse_report(ns.report))
    if ns.format is not None:
        _config.current = dataclasses.replace(_config.current, format=ns.format)
    trace = os.environ.pop("SAFETORCH_FIX_TRACE", None)  # `safetorch fix`'s run: what ran, for the fixes' width
    if trace:
        from safetorch import _fixtrace

        _fixtrace.start(trace)
    _own_stdout(_config.current.format, _config.current.report)
    try:
        status = _launch.run(module, args)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise  # the program's own failure wins
        status = 0
    if status == 0 and not ns.exit_zero:
        _join_threads()  # what they find counts, as Python waits for them before it exits
    # Under torchrun a rank's non-zero status is a crash to the agent (it tears the job down, or restarts it):
    # there the program's own status stands, and CI reads the report.
    if status == 0 and not ns.exit_zero and not _config.current.disabled and not _run.torchrun() \
            and _report.found_in_run():
        _report.failing_exit = True
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
