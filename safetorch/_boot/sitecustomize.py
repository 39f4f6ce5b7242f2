"""Put on ``PYTHONPATH`` by ``python -m safetorch``: every Python the program starts (multiprocessing's spawn and
forkserver workers, ``mp.spawn``, spawn-context DataLoader workers, ``subprocess`` running ``python``) installs
safetorch with the runner's configuration, from the environment it inherits, as coverage.py measures
subprocesses. Then the ``sitecustomize`` this one hides, if any, runs as it would have.

Only the runner's own interpreter installs (its ``sys.prefix`` and version, in ``SAFETORCH_RUNNER_PYTHON``): another
Python the program starts (a tool of another virtual environment, another version) gets nothing from this hook, and
says nothing."""

import importlib.machinery
import importlib.util
import os
import sys


def _same_python() -> bool:
    runner = os.environ.get("SAFETORCH_RUNNER_PYTHON")
    return runner is None or runner == f"{sys.prefix}{os.pathsep}{sys.implementation.cache_tag}"


if os.environ.get("SAFETORCH_RUNNER") == "1" and _same_python():
    try:
        import safetorch  # noqa: F401  (installs from SAFETORCH_STRICT / SAFETORCH_IGNORE / SAFETORCH_RUN_DIR)
    except Exception as exc:  # never stop the child from starting
        print(f"safetorch: could not be installed in this child process ({type(exc).__name__}: {exc})",
              file=sys.stderr)


def _next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_next_sitecustomize()
