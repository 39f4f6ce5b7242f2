"""`install()` and `uninstall()`: which checks are in force, through the one registry.

Design rules: idempotent (a second install adds no layer; a second uninstall does nothing); an install with other
arguments switches checks on and off to match; the environment is read once, explicit arguments override it, and
``SAFETORCH_DISABLE=1`` is the kill switch that no call overrides.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import sys
import threading
import warnings
from collections.abc import Iterable
from types import ModuleType, TracebackType
from typing import Any

from . import _callsite, _config, _notebook, _report, _run, _unseen
from ._exceptions import SafetorchConfigWarning, SafetorchError, SafetorchWarning
from ._patch import registry, wrapt_c_extension
from ._tracebacks import hide_own_frames, without_own_frames

__all__ = ["checks", "install", "installed_checks", "uninstall"]

def checks() -> dict[str, str]:
    """Rule code -> its module under safetorch.checks, from the rule table (each check declares its own rule)."""
    from ._rules import RULES

    return {code: rule.module for code, rule in RULES.items()}


_CORE = "core"
_installed: set[str] = set()
_env_config: _config.Config | None = None
_atexit_registered = False
_lock = threading.RLock()


def _environment() -> _config.Config:
    global _env_config
    if _env_config is None:
        _env_config = _config.load()
    return _env_config


def _check_module(code: str) -> ModuleType:
    return importlib.import_module(f"safetorch.checks.{checks()[code]}")


def _teardown(code: str) -> None:
    """Restore a check's patches, and let it clean up what it attached to objects (ST003's module guards). A check
    whose module cannot even be imported has nothing to clean up."""
    _installed.discard(code)
    registry.restore(code)
    try:
        module = _check_module(code)
    except Exception:
        return
    cleanup = getattr(module, "uninstall", None)
    if cleanup is not None:
        cleanup()


def _annotate(exc: BaseException, tb: TracebackType | None) -> TracebackType | None:
    """An uncaught finding's traceback ends on the user's line; another error gets the checks' crash notes. Either
    shows no safetorch frame (`_without_own_frames`): the excepthook and IPython's handler print what this returns."""
    tb = _without_own_frames(exc, tb)
    if isinstance(exc, (SafetorchError, SafetorchWarning)):  # strict mode, or a `-W error` filter
        return _report.prune_traceback(tb)
    if hasattr(exc, "add_note"):  # PEP 678, Python 3.11+
        for note in _crash_notes(exc):
            exc.add_note(note)
    return tb


def _crash_notes(exc: BaseException) -> list[str]:
    """What the installed checks say about an uncaught error that is not a finding (their ``crash_notes``)."""
    found: list[str] = []
    for code in installed_checks():
        notes = getattr(_check_module(code), "crash_notes", None)
        found.extend(notes(exc) if notes is not None else ())
    return found


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """Show an uncaught SafetorchError with a traceback that ends on the user's line, then defer to the original.
    Every traceback it prints shows no safetorch frame: on Python 3.10 a patch's bare ``raise`` keeps the patch's
    own frame (`safetorch._tracebacks`), taken out here, in the exception and in those it was raised from."""
    notes: list[str] = []
    try:
        tb = _annotate(exc, tb)
        if not hasattr(exc, "add_note") and not isinstance(exc, (SafetorchError, SafetorchWarning)):
            notes = _crash_notes(exc)  # Python 3.10 has no PEP 678 notes: printed after the traceback instead
    except Exception:
        pass
    (_original_excepthook or sys.__excepthook__)(exc_type, exc, tb)
    for note in notes:
        print(note, file=sys.stderr)


def _without_own_frames(exc: BaseException, tb: TracebackType | None) -> TracebackType | None:
    """``tb`` (``exc``'s traceback) without safetorch's frames, and the same for ``exc`` and the exceptions it was
    raised from or during (a bounded walk of ``__cause__``/``__context__``)."""
    tb = without_own_frames(tb)
    seen: set[int] = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen and len(seen) < 64:
        seen.add(id(node))
        hide_own_frames(node)
        node = node.__cause__ or node.__context__
    return tb


_original_excepthook = None


def install(strict: bool | None = None, ignore: Iterable[str] | str | None = None,
            select: Iterable[str] | str | None = None) -> None:
    """Install every check not ignored. Explicit arguments override the environment (SAFETORCH_STRICT,
    SAFETORCH_IGNORE, SAFETORCH_SELECT), which overrides ``[tool.safetorch]`` in the nearest ``pyproject.toml``.

    ``ignore`` takes rule codes or names (``["ST004", "empty-cache-loop"]`` or ``"ST004,ST007"``); ``select``
    likewise, and then only those rules are on. An unknown one raises ValueError naming the valid rules. Calling it
    again changes the configuration without wrapping twice. With ``SAFETORCH_DISABLE=1`` in the environment it
    patches nothing.
    """
    global _atexit_registered, _original_excepthook
    cfg = _environment().with_overrides(strict=strict, ignore=ignore, select=select)
    with _lock:
        _config.current = cfg
        if cfg.disabled:
            return
        _run.start()  # join the run of the environment (a parent's, torchrun's job), or start one
        wanted = {code for code in checks() if code not in cfg.off}
        for code in sorted(_installed - wanted):
            _teardown(code)
        for code in sorted(wanted - _installed):
            try:
                _check_module(code).install(registry)
                _installed.add(code)
            except Exception as exc:  # a torch without one of the targets must not stop the others
                try:
                    _teardown(code)
                finally:
                    _report.internal_error(code, exc, "could not be installed")
        _rebind_early_imports()
        _unseen.skip_own_frames()
        if _CORE not in registry.groups():
            if not wrapt_c_extension():
                warnings.warn("safetorch: wrapt's C extension is not in use (WRAPT_DISABLE_EXTENSIONS, or a build "
                              "without it): findings cannot be attributed to your lines. Reinstall wrapt with its "
                              "C extension.", SafetorchConfigWarning, stacklevel=2)
            _original_excepthook = sys.excepthook
            registry.set(sys, "excepthook", _excepthook, _CORE)
            _follow_job()
            _notebook.install_handler(_annotate)  # IPython does not use sys.excepthook
        if not _atexit_registered:
            atexit.register(_report.exit_summary)
            _atexit_registered = True


def _group_made(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    with contextlib.suppress(Exception):
        _run.joined_group()
    return result


def _group_ends(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with contextlib.suppress(Exception):
        _run.joined_group()  # keeps the job's store past the group, and publishes what waited for it
    return wrapped(*args, **kwargs)


def _follow_job() -> None:
    """A job's ranks share their findings through its c10d store (`_run`): from the process group's creation (what
    was found before it is published then) until the program's exit, which outlives ``destroy_process_group``."""
    try:
        import torch.distributed as dist

        if dist.is_available():
            registry.wrap(dist, "init_process_group", _group_made, _CORE)
            registry.wrap(dist, "destroy_process_group", _group_ends, _CORE)
            if dist.is_initialized():  # installed after the group was made
                _run.joined_group()
    except Exception as exc:
        _report.internal_error("core", exc, "could not follow the job's process group")


def _rebind_early_imports() -> None:
    """Names the program bound from torch before safetorch was installed (``from torch.nn.utils import
    clip_grad_norm_`` above ``import safetorch``) still hold torch's unchecked functions: in the program's own
    modules (``__main__`` and modules outside the installed libraries), rebind them to the checked ones, through the
    registry (restored with the check that patched the function, and by `uninstall`)."""
    try:
        functions = {id(original): (original, installed, group)
                     for original, installed, group in registry.module_functions()}
        for module, attribute, original in early_bindings({key: entry[0] for key, entry in functions.items()}):
            _, installed, group = functions[id(original)]
            registry.set(module, attribute, installed, group)
    except Exception as exc:  # a module with an odd __dict__ must not stop the install
        _report.internal_error("core", exc, "could not look at names imported before safetorch")


def early_bindings(originals: dict[int, Any]) -> list[tuple[ModuleType, str, Any]]:
    """(module, name, function) for each name of the program's own modules that holds one of ``originals`` (id ->
    torch's function): a scan of every module, for an install, not for a step."""
    found: list[tuple[ModuleType, str, Any]] = []
    if not originals:
        return found
    from ._report import is_library as _library

    for name, module in list(sys.modules.items()):
        if not isinstance(module, ModuleType) or name.startswith(("torch", "safetorch", "wrapt")):
            continue
        code_file = getattr(module, "__file__", None)
        if name != "__main__" and (code_file is None or _library(_FileCode(code_file))):
            continue
        for attribute, value in list(vars(module).items()):
            original = originals.get(id(value))
            if original is not None and original is value:
                found.append((module, attribute, value))
    return found


class _FileCode:
    """What `_library` reads of a code object: its file name."""

    def __init__(self, filename: str) -> None:
        self.co_filename = filename


def uninstall() -> None:
    """Remove every patch: each touched attribute is again the very object it was before. Harmless when repeated."""
    with _lock:
        for code in installed_checks():
            _teardown(code)
        registry.restore()
        _notebook.uninstall_handler()
        _callsite.clear()
        _report.clear_caches()


def installed_checks() -> list[str]:
    """The rule codes whose checks are installed now."""
    return sorted(_installed)
