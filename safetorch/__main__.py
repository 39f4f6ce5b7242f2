"""``python -m safetorch [--strict] [--ignore CODES] script.py [args…]`` or ``… -m module [args…]``.

Runs a program with every check installed and no change to its code, the way ``python -m cProfile`` does: the
program sees its own ``sys.argv``, runs as ``__main__`` (so ``if __name__ == "__main__":`` blocks and spawned
workers behave as without the runner), and its exit code passes through.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = """\
usage: python -m safetorch [--strict] [--ignore CODES] [--report PATH|0] script.py [args ...]
       python -m safetorch [options] -m module [args ...]

Run a PyTorch program with safetorch's checks installed, without changing its code.

options:
  --strict          every finding raises safetorch.SafetorchError at its line (SAFETORCH_STRICT=1)
  --ignore CODES    switch rules off: codes or names, comma-separated, e.g. ST004,empty-cache-loop
                    (SAFETORCH_IGNORE)
  --report PATH|0   also write the exit summary as JSON to PATH, or 0: no summary (SAFETORCH_REPORT)
  -m module         run a library module as a script, like python -m
  -h, --help        show this help

environment (read once; the options above override it):
  SAFETORCH_STRICT=1                  findings raise SafetorchError
  SAFETORCH_DISABLE=1                 patch nothing: the program runs exactly as without safetorch
  SAFETORCH_IGNORE=ST004,ST007        rules to switch off
  SAFETORCH_REPORT=0 | path.json      no exit summary | also write it as JSON

rules: ST001 discarded conversion, ST002 legacy size_average/reduce, ST003 eval-mode forward with autograd on,
       ST004 loss accumulated with its graph, ST005 Variable(volatile=True), ST006 non-finite loss at backward,
       ST007 empty_cache() in a loop, ST008 a model trained while in eval mode
"""


def _fail(message: str) -> int:
    print(f"safetorch: {message}\n", file=sys.stderr)
    print(USAGE, file=sys.stderr, end="")
    return 2


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    strict = False
    ignore: str | None = None
    report: str | None = None
    module: str | None = None
    while args and args[0].startswith("-"):
        opt = args.pop(0)
        if opt in ("-h", "--help"):
            print(USAGE, end="")
            return 0
        if opt == "--strict":
            strict = True
        elif opt == "--ignore" or opt.startswith("--ignore="):
            ignore = opt.split("=", 1)[1] if "=" in opt else (args.pop(0) if args else "")
        elif opt == "--report" or opt.startswith("--report="):
            report = opt.split("=", 1)[1] if "=" in opt else (args.pop(0) if args else "1")
        elif opt == "-m":
            if not args:
                return _fail("-m needs a module name")
            module = args.pop(0)
            break
        else:
            return _fail(f"unknown option {opt!r}")
    if module is None and not args:
        return _fail("no script to run")

    # Children started with the same interpreter (spawned workers that import safetorch) see the same settings.
    if strict:
        os.environ["SAFETORCH_STRICT"] = "1"
    if ignore is not None:
        os.environ["SAFETORCH_IGNORE"] = ignore

    import dataclasses

    import safetorch
    from safetorch import _config

    try:
        safetorch.install(strict=strict or None, ignore=ignore)
    except ValueError as exc:
        return _fail(str(exc).removeprefix("safetorch: "))
    if report is not None:
        _config.current = dataclasses.replace(_config.current, report=_config.parse_report(report))

    if module is not None:
        sys.argv = [module, *args]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = args[0]
        if not os.path.exists(script):
            return _fail(f"can't open file {script!r}: no such file")
        sys.argv = args
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
