"""One `Config`, read once: each setting comes from the first of these that sets it — explicit arguments
(`install()`, the runner's options), the environment (``SAFETORCH_*``), ``[tool.safetorch]`` in the nearest
``pyproject.toml``, the defaults.

Design rule: reading the environment or a ``pyproject.toml`` never raises. A value that cannot be understood gives
one `SafetorchConfigWarning` and is ignored; an explicit bad argument to `install()` raises `ValueError`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

from ._exceptions import SafetorchConfigWarning


def _rules() -> ModuleType:
    """The rule table, imported at first use: it is collected from the check modules, which import the reporter,
    which imports this module."""
    from . import _rules as rules

    return rules


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


#: How findings are shown: ``text`` (each warning in full, a one-line summary at exit), ``concise`` (warnings in one
#: line too), ``json`` / ``sarif`` (the report as a document at exit), ``github`` (workflow commands at exit).
FORMATS = ("text", "concise", "json", "sarif", "github")


@dataclass(frozen=True)
class Config:
    strict: bool = False
    disabled: bool = False
    #: Rules switched off (codes). With `select`, every rule not selected is in here too.
    ignore: frozenset[str] = field(default_factory=frozenset)
    #: True: print the exit summary; False: don't; a string: also write the report to that path.
    report: bool | str = True
    #: Only these rules are on (None: all).
    select: frozenset[str] | None = None
    format: str = "text"
    #: The ``pyproject.toml`` whose ``[tool.safetorch]`` was read, if any.
    pyproject: str | None = None

    def with_overrides(self, strict: bool | None = None, ignore: Iterable[str] | str | None = None,
                       select: Iterable[str] | str | None = None) -> Config:
        cfg = self
        if strict is not None:
            if not isinstance(strict, bool):  # install(strict="false") must not switch strict mode on
                raise ValueError(f"safetorch: strict= takes True, False or None (the environment's "
                                 f"SAFETORCH_STRICT), not {strict!r}")
            cfg = replace(cfg, strict=strict)
        if ignore is not None:
            cfg = replace(cfg, ignore=parse_ignore_argument(ignore))
        if select is not None:
            selected = parse_ignore_argument(select, "select=")
            if not selected:
                raise ValueError("safetorch: select= names no rule (None: every rule)")
            # what is selected here, an ignore from a lower layer (environment, pyproject) does not undo
            cfg = replace(cfg, select=selected, ignore=cfg.ignore if ignore is not None else cfg.ignore - selected)
        return cfg

    @property
    def off(self) -> frozenset[str]:
        """The codes not installed: those ignored, and when there is a selection, those not selected."""
        if self.select is None:
            return self.ignore
        return self.ignore | (frozenset(_rules().RULES) - self.select)


def _flag(name: str, environ: dict[str, str] | os._Environ[str]) -> bool:
    raw = environ.get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value not in _FALSE:
        _warn(f"{name}={raw!r} is not understood (use 1 or 0); it is ignored")
    return False


def _warn(message: str) -> None:
    """Warn about the configuration at the program's line that reached safetorch (its ``import safetorch`` or
    ``install()``), as other libraries' warnings point at their caller: the first frame outside this package, the
    import machinery and ``runpy``. No fixed ``stacklevel`` says where that is: the depth from here depends on the
    path taken (an import, ``install()``, the runner, a pyproject read). Where no such frame is (``python -m
    safetorch``), the outermost frame of this package stands for it."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, outermost = sys._getframe(1), None
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith("<"):  # "<frozen importlib._bootstrap>", "<frozen runpy>"; "<string>" is the user's
            if not filename.startswith(("<frozen importlib", "<frozen runpy")):
                break
        elif os.path.abspath(filename).startswith(package):
            outermost = frame
        elif not (("importlib" in filename and "_bootstrap" in filename) or os.path.basename(filename) == "runpy.py"):
            break
        frame = frame.f_back
    frame = frame or outermost
    if frame is None:
        warnings.warn(f"safetorch: {message}", SafetorchConfigWarning, stacklevel=2)
        return
    # As warnings.warn does, without module_globals: a loader that cannot serve the source (``python -c``'s
    # BuiltinImporter) would raise from inside the warning.
    module_globals = frame.f_globals
    warnings.warn_explicit(f"safetorch: {message}", SafetorchConfigWarning, frame.f_code.co_filename, frame.f_lineno,
                           module=module_globals.get("__name__", "<string>"),
                           registry=module_globals.setdefault("__warningregistry__", {}))


def _split(value: str) -> list[str]:
    return [t for t in value.replace(";", ",").replace(" ", ",").split(",") if t.strip()]


def parse_ignore_argument(ignore: Iterable[str] | str, what: str = "ignore=") -> frozenset[str]:
    """Codes or names given to `install(ignore=...)` (or ``select=``); an unknown one raises ValueError naming the
    valid ones."""
    if isinstance(ignore, str):
        tokens = _split(ignore)
    else:
        try:
            tokens = list(ignore)
        except TypeError:
            tokens = [ignore]
    codes = set()
    for token in tokens:
        if not isinstance(token, str):
            raise TypeError(f"safetorch: {what} takes rule codes or names, as a string ('ST004,ST007') or an "
                            f"iterable of strings, not {type(token).__name__} {token!r}; valid rules are "
                            f"{_rules().valid_tokens()}")
        code = _rules().resolve(token)
        if code is None:
            raise ValueError(f"safetorch: unknown rule {token!r} in {what}; valid rules are {_rules().valid_tokens()}")
        codes.add(code)
    return frozenset(codes)


def parse_report(raw: str) -> bool | str:
    """SAFETORCH_REPORT: 1 (or empty) prints the exit summary, 0 silences it, anything else is a JSON path."""
    value = raw.strip()
    if value.lower() in _TRUE or value == "":
        return True
    if value.lower() in _FALSE:
        return False
    return os.path.abspath(value)  # now: the program may change its working directory before the report is written


def _codes(tokens: Iterable[str], where: str, warn: Callable[[str], None] | None = None) -> frozenset[str]:
    codes = set()
    for token in tokens:
        code = _rules().resolve(token) if isinstance(token, str) else None
        if code is None:
            (warn or _warn)(f"{where} names an unknown rule {token!r}; it is ignored. Valid: {_rules().valid_tokens()}")
        else:
            codes.add(code)
    return frozenset(codes)


def _format(raw: str, where: str, warn: Callable[[str], None] | None = None) -> str | None:
    value = raw.strip().lower()
    if value in FORMATS:
        return value
    (warn or _warn)(f"{where}={raw!r} is not a format ({', '.join(FORMATS)}); it is ignored")
    return None


def from_environ(environ: dict[str, str] | os._Environ[str] | None = None, base: Config | None = None) -> Config:
    """Read the SAFETORCH_* variables over ``base`` (the defaults, or what a ``pyproject.toml`` set). Never raises:
    bad values warn once each and are ignored."""
    env = os.environ if environ is None else environ
    cfg = Config() if base is None else base
    changes: dict[str, Any] = {}
    if "SAFETORCH_IGNORE" in env:
        changes["ignore"] = _codes(_split(env["SAFETORCH_IGNORE"]), "SAFETORCH_IGNORE")
    if env.get("SAFETORCH_SELECT", "").strip():
        selected = _codes(_split(env["SAFETORCH_SELECT"]), "SAFETORCH_SELECT")
        if selected:
            changes["select"] = selected
            if "SAFETORCH_IGNORE" not in env:  # what this layer selects, a lower layer's ignore does not undo
                changes["ignore"] = cfg.ignore - selected
        else:
            _warn("SAFETORCH_SELECT names no rule; every rule stays on")
    if "SAFETORCH_REPORT" in env:
        changes["report"] = parse_report(env["SAFETORCH_REPORT"])
    if "SAFETORCH_STRICT" in env:
        changes["strict"] = _flag("SAFETORCH_STRICT", env)
    if env.get("SAFETORCH_FORMAT", "").strip():
        fmt = _format(env["SAFETORCH_FORMAT"], "SAFETORCH_FORMAT")
        if fmt is not None:
            changes["format"] = fmt
    changes["disabled"] = _flag("SAFETORCH_DISABLE", env)
    return replace(cfg, **changes)


#: ``[tool.safetorch]`` keys, each with the kind of value it takes.
KEYS = {"ignore": "a list of rule codes or names", "select": "a list of rule codes or names",
        "strict": "true or false", "report": "true, false or a path", "format": " | ".join(FORMATS)}

#: The ``pyproject.toml`` the run's first process read, passed to its children so that they read the same one.
PYPROJECT_ENV = "SAFETORCH_PYPROJECT"


def find_pyproject(start: str | None = None) -> str | None:
    """The nearest ``pyproject.toml`` with a ``[tool.safetorch]`` table, from ``start`` (the program's directory,
    or the working directory) up to the file system's root, as ruff and pytest find theirs."""
    try:
        directory = os.path.abspath(start or os.getcwd())
    except OSError:  # the working directory was deleted
        return None
    while True:
        candidate = os.path.join(directory, "pyproject.toml")
        if os.path.isfile(candidate) and _table(candidate) is not None:
            return candidate
        parent = os.path.dirname(directory)
        if parent == directory:
            return None
        directory = parent


def _table(path: str) -> dict[str, Any] | None:
    """The file's ``[tool.safetorch]`` table; None when it has none, or cannot be read (then it says so)."""
    mentions = b"safetorch" in _read(path)
    try:
        import tomllib
    except ImportError:  # Python 3.10: tomli, when installed
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            if mentions:
                _warn_at(path, None, f"{path}: Python 3.10 reads pyproject.toml only with tomli installed "
                                     "(pip install tomli); its [tool.safetorch] is ignored")
            return None
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, ValueError) as exc:
        if mentions:
            _warn_at(path, None, f"{path} could not be read ({type(exc).__name__}: {exc}); its [tool.safetorch] "
                                 "is ignored")
        return None
    tool = data.get("tool")
    table = tool.get("safetorch") if isinstance(tool, dict) else None
    if table is not None and not isinstance(table, dict):
        _warn_at(path, None, f"{path}: tool.safetorch must be a table ([tool.safetorch]), not {table!r}; it is "
                             "ignored")
        return None
    return table


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _tokens(value: Any) -> list[Any] | None:
    if isinstance(value, str):
        return list(_split(value))
    if isinstance(value, list):
        return value
    return None


def _warn_at(path: str, key: str | None, message: str) -> None:
    """A warning about ``path``'s ``[tool.safetorch]``, at the line of ``key`` (or of the table): the file and line a
    user opens to fix it."""
    lineno, inside = 1, False
    for number, line in enumerate(_read(path).decode("utf-8", "replace").splitlines(), 1):
        text = line.strip()
        if text.startswith("["):
            inside = text.replace(" ", "") == "[tool.safetorch]"
            if inside:
                lineno = number
        elif inside and key is not None and re.match(rf"[\"']?{re.escape(key)}[\"']?\s*=", text):
            lineno = number
            break
    if (path, lineno, message) in _said:  # the runner reads the file again, once it knows the script
        return
    _said.add((path, lineno, message))
    warnings.warn_explicit(f"safetorch: {message}", SafetorchConfigWarning, path, lineno)


_said: set[tuple[str, int, str]] = set()


def from_pyproject(path: str) -> Config:
    """The settings of ``path``'s ``[tool.safetorch]`` over the defaults. Never raises: an unknown key or a value
    of the wrong kind warns, naming the file, and is ignored; a relative ``report`` path is the file's directory's."""
    table = _table(path) or {}
    where = f"{path} [tool.safetorch]"
    changes: dict[str, Any] = {"pyproject": path}
    for key, value in table.items():
        if key not in KEYS:
            _warn_at(path, key, f"{where}: unknown key {key!r}; it is ignored. Known keys: {', '.join(KEYS)}")
            continue
        if key in ("ignore", "select"):
            tokens = _tokens(value)
            if tokens is None:
                _warn_at(path, key, f"{where}: {key} takes {KEYS[key]}, not {value!r}; it is ignored")
                continue
            codes = _codes(tokens, f"{where} {key}", functools.partial(_warn_at, path, key))
            if key == "select" and not codes:
                _warn_at(path, key, f"{where}: select names no rule; every rule stays on")
                continue
            changes[key] = codes
        elif key == "strict":
            if isinstance(value, bool):
                changes[key] = value
            else:
                _warn_at(path, key, f"{where}: strict takes true or false, not {value!r}; it is ignored")
        elif key == "report":
            if isinstance(value, bool):
                changes[key] = value
            elif isinstance(value, str) and value.strip():
                parsed = parse_report(value) if value.strip().lower() in _TRUE | _FALSE else value
                changes[key] = parsed if isinstance(parsed, bool) else os.path.join(os.path.dirname(path), value)
            else:
                _warn_at(path, key, f"{where}: report takes {KEYS[key]}, not {value!r}; it is ignored")
        elif key == "format":
            fmt = _format(value, f"{where}: format", functools.partial(_warn_at, path, key)) \
                if isinstance(value, str) else None
            if fmt is not None:
                changes[key] = fmt
            elif not isinstance(value, str):
                _warn_at(path, key, f"{where}: format takes {KEYS[key]}, not {value!r}; it is ignored")
    return replace(Config(), **changes)


def _starts() -> list[str]:
    """Where to look for the ``pyproject.toml``: the program's directory (a script's, as ruff starts from the file),
    unless the program is an installed tool (pytest, torchrun: ``__main__`` in site-packages), then the working
    directory (as pytest starts from it)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv else None)
    starts = []
    if path and os.path.isfile(path):
        directory = os.path.dirname(os.path.abspath(path))
        installed = {"site-packages", "dist-packages"} & set(directory.split(os.sep)) or any(
            directory.startswith(os.path.join(prefix, "")) for prefix in {sys.prefix, sys.exec_prefix})
        if not installed:
            starts.append(directory)
    with contextlib.suppress(OSError):  # a working directory that was deleted has no pyproject.toml
        starts.append(os.getcwd())
    return starts


def load(environ: dict[str, str] | os._Environ[str] | None = None, start: str | None = None) -> Config:
    """The configuration before explicit arguments: the environment over the nearest ``[tool.safetorch]`` over the
    defaults. ``SAFETORCH_PYPROJECT`` names the file instead (the runner sets it for the run's processes, from its
    script); ``SAFETORCH_PYPROJECT=0`` reads none."""
    env = os.environ if environ is None else environ
    given = env.get(PYPROJECT_ENV)
    if given is not None:
        path = None if given.strip() in _FALSE else os.path.abspath(given)
        if path is not None and not os.path.isfile(path):
            _warn(f"{PYPROJECT_ENV}={given!r} is no file; no [tool.safetorch] is read")
            path = None
    else:
        path = None
        for directory in [start] if start else _starts():
            path = find_pyproject(directory)
            if path is not None:
                break

    base = from_pyproject(path) if path else Config()
    return from_environ(env, base)


#: The working directory the program started in: the report's relative paths are relative to it, wherever the
#: program has moved since.
def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:  # started in a directory that was deleted: paths stay as the program names them
        return os.environ.get("PWD") or os.sep


START_DIR = _cwd()

#: The configuration in force: set by `safetorch.install()`, read by the reporter.
current = Config()
