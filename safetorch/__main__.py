"""``python -m safetorch [--strict] [--ignore CODES] script.py [args…]`` or ``… -m module [args…]``.

Runs a program with every check installed and no change to its code, the way ``python -m cProfile`` does: the
program sees its own ``sys.argv``, runs as ``__main__`` (so ``if __name__ == "__main__":`` blocks and spawned
workers behave as without the runner), and its exit code passes through.
"""

from __future__ import annotations

import argparse
import os
import sys

from safetorch import _launch

_ENVIRONMENT = """\
environment (read once; the options above override it):
  SAFETORCH_STRICT=1                  findings raise SafetorchError
  SAFETORCH_DISABLE=1                 patch nothing: the program runs exactly as without safetorch
  SAFETORCH_IGNORE=ST004,ST007        rules to switch off
  SAFETORCH_REPORT=0 | path.json      no exit summary | also write it as JSON
"""


def _prog() -> str:
    """``python -m safetorch`` or the console script's name, whichever way the runner was started."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m safetorch" if name in ("", "__main__.py", "-m", "-c") else name


def _parser() -> argparse.ArgumentParser:
    from safetorch._rules import RULES

    rules = "rules:\n" + "\n".join(f"  {r.code} {r.name:<22} {r.summary}" for r in RULES.values())
    parser = argparse.ArgumentParser(
        prog=_prog(), formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [--strict] [--ignore CODES] [--report PATH|0] script.py [args ...]\n"
              "       %(prog)s [options] -m module [args ...]",
        description="Run a PyTorch program with safetorch's checks installed, without changing its code.",
        epilog=_ENVIRONMENT + "\n" + rules)
    parser.add_argument("--strict", action="store_true",
                        help="every finding raises safetorch.SafetorchError at its line (SAFETORCH_STRICT=1)")
    parser.add_argument("--ignore", metavar="CODES",
                        help="switch rules off: codes or names, comma-separated, e.g. ST004,empty-cache-loop "
                             "(SAFETORCH_IGNORE)")
    parser.add_argument("--report", metavar="PATH|0",
                        help="also write the exit summary as JSON to PATH, or 0: no summary (SAFETORCH_REPORT)")
    parser.add_argument("-m", dest="module", metavar="module", nargs=argparse.REMAINDER,
                        help="run a library module as a script, like python -m (the rest are its arguments)")
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="script.py [args ...]",
                        help="the script to run and its arguments")
    return parser


def _fail(message: str) -> int:
    print(f"{_prog()}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
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
    boot = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")
    os.environ["SAFETORCH_RUNNER"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (boot, os.environ.get("PYTHONPATH", "")) if p)

    import dataclasses

    import safetorch
    from safetorch import _config

    try:
        safetorch.install(strict=ns.strict or None, ignore=ns.ignore)
    except (ValueError, TypeError) as exc:
        return _fail(str(exc).removeprefix("safetorch: "))
    if ns.report is not None:
        _config.current = dataclasses.replace(_config.current, report=_config.parse_report(ns.report))
    return _launch.run(module, args)


if __name__ == "__main__":
    sys.exit(main())
