"""The one reporter: every finding goes through `report`, every internal failure through `internal_error`.

Design rules:
- A finding is attributed to the user's line: the frame a check hands over, or the first frame above it that is
  not torch, wrapt or safetorch. A finding whose line is inside torch itself is torch's, not the user's: dropped.
- Warn once per call site (code, file, line); count every occurrence for the exit summary.
- In strict mode raise `SafetorchError` instead. Python appends the frames a raise passes through to the
  traceback; our own trailing frames are hidden from pytest (``__tracebackhide__``) and cut off by `prune_traceback`
  in the excepthook, so the traceback of an uncaught finding ends on the user's line.
- The message is built lazily, once per call site: reading source to word a message costs nothing on the hot path.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType, FrameType, TracebackType
from typing import Any

from . import _config, _notebook, _run
from ._exceptions import SafetorchError, SafetorchInternalWarning

__all__ = ["Site", "findings", "internal_error", "is_internal", "report", "report_at", "reset", "user_frame"]


_RULES: dict[str, Any] = {}


def _rule(code: str) -> Any:
    """The rule of a code. The table is read at first use: the check modules it is collected from import this one."""
    if not _RULES:
        from ._rules import RULES

        _RULES.update(RULES)
    return _RULES[code]


def _package_dir(module: str) -> str:
    mod = sys.modules.get(module) or __import__(module)
    path = getattr(mod, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else "\0"


_SAFETORCH_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_internal_dirs: tuple[str, ...] | None = None
_internal_codes: dict[int, tuple[CodeType, bool]] = {}


def _dirs() -> tuple[str, ...]:
    global _internal_dirs
    if _internal_dirs is None:
        import torch  # noqa: F401  (make sure both are importable before reading their paths)
        import wrapt  # noqa: F401

        _internal_dirs = (_SAFETORCH_DIR, _package_dir("torch"), _package_dir("wrapt"))
    return _internal_dirs


def is_internal(code: CodeType) -> bool:
    """True for code of torch, wrapt or safetorch (cached per code object)."""
    entry = _internal_codes.get(id(code))
    if entry is not None and entry[0] is code:
        return entry[1]
    answer = code.co_filename.startswith(_dirs()) or _generated_by_torch(code)
    if len(_internal_codes) > 1 << 16:  # bounded: generated code makes code objects without end
        _internal_codes.clear()
    _internal_codes[id(code)] = (code, answer)
    return answer


_LIBRARY_DIRS = tuple(
    os.path.abspath(p) + os.sep for p in {sysconfig.get_paths().get(k) for k in ("purelib", "platlib", "stdlib")} if p
)


_libraries: dict[str, bool] = {}


def is_library(code: Any) -> bool:
    """True for code of an installed library or the standard library: under this interpreter's library directories,
    or under any ``site-packages``/``dist-packages`` directory (another environment's, a ``--target`` install).
    Cached by file name: every eval() asks (a cached answer costs no call more)."""
    filename = code.co_filename
    answer = _libraries.get(filename)
    return is_library_file(filename) if answer is None else answer


def is_library_file(filename: str) -> bool:
    """`is_library` for the code of the file ``filename``."""
    answer = _libraries.get(filename)
    if answer is None:
        if filename.startswith("<"):  # ``<string>``, ``<stdin>``, a notebook's cell; ``<frozen runpy>`` is Python's
            answer = filename.startswith("<frozen")
        else:
            try:
                path = os.path.abspath(filename)
            except OSError:  # a relative name in a working directory that was deleted
                path = filename
            answer = path.startswith(_LIBRARY_DIRS) or any(
                f"{os.sep}{d}{os.sep}" in path for d in ("site-packages", "dist-packages"))
        if len(_libraries) < 4096:
            _libraries[filename] = answer
    return answer


def clear_caches() -> None:
    _internal_codes.clear()
    _off.clear()
    from . import _suppress

    _suppress.clear()


#: The file names of code that torch generates (fx's GraphModule code, dynamo's): the names torch gives them, not any
#: name with "torch" in it (a program's own ``<torch_gen>``, or torch.package's ``<torch_package_0>`` modules, which
#: hold the program's code).
_TORCH_GENERATED = ("<eval_with_key>", "<torch._dynamo")


def _generated_by_torch(code: CodeType) -> bool:
    return code.co_filename.startswith(_TORCH_GENERATED)


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The first frame, from ``frame`` outwards, that is not torch, wrapt or safetorch."""
    while frame is not None and is_internal(frame.f_code):
        frame = frame.f_back
    return frame


@dataclass
class Site:
    code: str
    filename: str
    lineno: int
    message: str
    count: int = 1
    rank: int | None = None
    #: Its warning was shown (or raised by a filter set to "error"). Until then, each occurrence tries again: a finding
    #: first hit inside ``catch_warnings(); simplefilter("ignore")`` is shown at its first hit outside.
    shown: bool = False
    #: The line carries ``# safetorch: ignore[<this code>]`` (or a bare ``# safetorch: ignore``): never shown, raised,
    #: summarised or written to the JSON report.
    suppressed: bool = False
    #: The warning filters the site was last found ignored under: ``warnings.filters`` itself (held, so that a new
    #: list cannot take its id), its length and first entry.
    ignored_under: tuple[Any, int, Any] | None = None
    #: This process printed its warning (in full, or in one line under ``format = "concise"``).
    warned: bool = False
    #: When it was first found (seconds since the epoch).
    first_seen: float = field(default_factory=time.time)
    #: The expression the finding is about, (line, column, end line, end column) as ``ast`` counts them, and its
    #: source text: what ``safetorch fix`` rewrites, and how it tells that the file still holds it. None before 3.11
    #: (no bytecode positions) and for a finding reported without its instruction.
    span: tuple[int, int, int, int] | None = None
    source: str | None = None


#: The rules switched off in the current thread or task by ``with safetorch.ignore(...)`` / ``@safetorch.ignore``.
scoped_off: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("safetorch_ignore", default=frozenset())


def explain_hint(code: str) -> str:
    """What every message ends with: where the rule's page is."""
    return f"(safetorch explain {code})"


def first_clause(code: str, message: str) -> str:
    """A message's first clause, without its code: the one line of a concise warning or of the exit summary."""
    text = message.splitlines()[0].removeprefix(code).strip()
    text = text.removesuffix(explain_hint(code)).rstrip()
    cut = min((i for i in (text.find("; "), text.find(". "), text.find(": ")) if i >= 20), default=len(text))
    return text[:cut].rstrip(".;")


#: Where a message's fix begins: its last "Write:", else the last clause that starts with what to do.
_WRITE = re.compile(r"(?:^|[.;:] )(Write:)")
_DO = re.compile(r"(?:^|[.;:] )((?:Write|Call|Pass|Build|Use|Move|Assign|Put|Remove|write|call|pass|use|load) )")


def fix_clause(code: str, message: str) -> str:
    """The fix a message names, from its "Write: …" (or the clause that says what to do) to its end, without the
    pointer to the rule's page; '' when it names none."""
    text = " ".join(message.split()).removeprefix(code).strip().removesuffix(explain_hint(code)).rstrip()
    found = list(_WRITE.finditer(text)) or list(_DO.finditer(text))
    if not found:
        return ""
    fix = text[found[-1].start(1):]
    return fix[:1].upper() + fix[1:]


def counted(code: str, count: int) -> str:
    """A site's count as the summary shows it: ``x3``, or ``seen at 7 sampled steps`` for a rule that looks only at
    sampled steps (its count is not every step's)."""
    _rule("ST001")  # the table, read
    rule = _RULES.get(code)
    if rule is not None and rule.sampled:
        return f"seen at {count} sampled step{'s' if count != 1 else ''}"
    return f"x{count}"


def concise_line(code: str, message: str) -> str:
    """A finding in one line: its code, its first clause, its fix, its rule's page."""
    head = first_clause(code, message)
    fix = fix_clause(code, message)
    if fix and fix not in head:
        head = f"{head}. {fix}"
    return f"{code} {head} {explain_hint(code)}"


def _one_line_showwarning(previous: Any) -> Any:
    """``warnings.showwarning`` while a concise warning is shown: the previous one (Python's, pytest's recorder,
    logging's), given an empty source line, so that the warning is the one line ``file:line: Category: message``."""

    def showwarning(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                    line: str | None = None) -> None:
        previous(message, category, filename, lineno, file, "")

    return showwarning


_show_lock = threading.RLock()  # reentrant: a showwarning that leads to another finding does not deadlock


def _warn_one_line(*args: Any, **kwargs: Any) -> None:
    """`warnings.warn_explicit`, shown without the source line below it (the concise format)."""
    __tracebackhide__ = True  # noqa: F841
    with _show_lock:
        previous = warnings.showwarning
        ours = warnings.showwarning = _one_line_showwarning(previous)
        try:
            warnings.warn_explicit(*args, **kwargs)
        finally:
            if warnings.showwarning is ours:  # not if the program replaced it meanwhile
                warnings.showwarning = previous


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


#: The process's rank and the job's size under torchrun (RANK / WORLD_SIZE); 0 and 1 otherwise.
_RANK = _env_int("RANK", 0)
_WORLD = _env_int("WORLD_SIZE", 1)

_sites: dict[tuple[str, str, int], Site] = {}
_internal_reported: set[str] = set()
_lock = threading.Lock()


def _forked() -> None:
    """A forked child starts with its parent's sites: it counts and reports its own (the parent showed those)."""
    _sites.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def report(code: str, frame: FrameType, message: str | Callable[[], str]) -> None:
    """Report finding ``code`` at ``frame``'s current line: warn once per call site, or raise in strict mode."""
    __tracebackhide__ = True  # noqa: F841  (pytest hides this frame)
    report_at(code, frame.f_code.co_filename, frame.f_lineno, frame.f_globals, message, (frame.f_code, frame.f_lasti))


def report_at(code: str, filename: str, lineno: int, module_globals: dict[str, Any],
              message: str | Callable[[], str], at: tuple[CodeType, int] | None = None) -> None:
    """`report` for a line remembered earlier (ST006 on CUDA reports a step after the line ran); ``at``, the code
    object and instruction offset of the call, gives the finding its exact expression (`Site.span`)."""
    __tracebackhide__ = True  # noqa: F841
    scoped = scoped_off.get()
    if scoped and code in scoped:
        return  # inside `with safetorch.ignore(code)` in this thread or task
    if rule_off(code, filename, lineno, module_globals):
        return  # a warnings filter names this rule here: it is off, as SAFETORCH_IGNORE would switch it off
    key = (code, filename, lineno)
    site = _sites.get(key)
    strict = _config.current.strict
    if site is not None:
        site.count += 1
        if (site.shown and not strict) or site.suppressed:
            return
    else:
        if suppressed(code, filename, lineno, module_globals):
            with _lock:
                _sites.setdefault(key, Site(code, filename, lineno, "", suppressed=True, shown=True))
            return
        text = message() if callable(message) else message
        if _WORLD > 1 and _rule(code).per_rank:
            text = f"{code} [rank {_RANK}] {text.removeprefix(code).lstrip()}"
        text = f"{text.rstrip()} {explain_hint(code)}"
        shown_as = _notebook.cell_name(filename) or filename  # `Cell In[5]` for a Jupyter cell
        where, source = _span(filename, lineno, module_globals, at)
        with _lock:
            site = _sites.setdefault(key, Site(code, shown_as, lineno, text, rank=_RANK if _WORLD > 1 else None,
                                               span=where, source=source))
        if not _run.torchrun() and not _run.claim(code, site.filename, lineno):
            site.shown = True  # another process of the run (a worker, the parent) shows this site's warning
        _run.record(code, site.filename, lineno, site.message, 1, site.first_seen,  # now: a child may os._exit
                    site.span, site.source)
    rule = _rule(code)
    if strict:  # every rank raises; the site stays in the summary and the JSON report
        site.shown = True
        raise SafetorchError(site.message, code=code, filename=site.filename, lineno=lineno)
    if site.shown:  # shown by another process of the run
        return
    if _RANK != 0 and not rule.per_rank:
        site.shown = True
        return  # under torchrun, rank 0 prints what every rank sees (this rank's summary, what only it saw)
    module = module_globals.get("__name__") or _module_name(filename)
    if _ignored(site, rule.category, module):
        return
    site.shown = site.warned = True  # before the call: a filter set to "error" raises the warning: it was shown
    concise = _config.current.format == "concise"
    (_warn_one_line if concise else warnings.warn_explicit)(
        concise_line(code, site.message) if concise else site.message,
        rule.category,
        site.filename,
        lineno,
        module=module,
        registry=module_globals.setdefault("__warningregistry__", {}),
        # No module_globals, as warnings.warn itself does: the loader lookup they trigger raises for `python -c`
        # ("'__main__' is not a built-in module") and for runpy'd modules; linecache finds files and notebook cells.
    )


def _span(filename: str, lineno: int, module_globals: dict[str, Any], at: tuple[CodeType, int] | None
          ) -> tuple[tuple[int, int, int, int] | None, str | None]:
    """The finding's expression and its source text, once per site (None, None when unknown, or not on its line)."""
    if at is None:
        return None, None
    try:
        from ._callsite import span, span_source

        where = span(*at, module_globals)
        if where is None or where[0] != lineno:
            return None, None
        return where, span_source(filename, where, module_globals)
    except Exception:  # a message's detail: the finding is reported without it
        return None, None


def suppressed(code: str, filename: str, lineno: int, module_globals: dict[str, Any]) -> bool:
    """True when a comment silences rule ``code`` at this line: ``# safetorch: ignore[ST001]`` (codes or names,
    comma-separated), a bare ``# safetorch: ignore``, or ``# noqa: ST001``, on any line of the statement that holds
    it or alone on the line directly above (`safetorch._suppress` says why). Read once per (file, line), when a
    finding is about to be reported. A failure to read the comments is an internal error: the finding is reported."""
    from . import _suppress

    try:
        return _suppress.suppressed(code, filename, lineno, module_globals)
    except Exception as exc:
        internal_error(code, exc, "could not read the suppression comments of a line")
        return False


def _module_name(filename: str) -> str:
    """What CPython's warnings use for code whose globals have no ``__name__`` (``exec(src, {})``): with
    ``module=None``, ``warn_explicit`` drops the warning."""
    name = filename or "<unknown>"
    return name[:-3] if name.lower().endswith(".py") else name


def _ignored(site: Site, category: type[Warning], module: str) -> bool:
    """True when the warning filters in force now would drop this site's warning (its ``ignore`` action), read the
    way ``warnings.warn_explicit`` reads them. Remembered per site until the filters change."""
    filters = warnings.filters
    under = site.ignored_under
    if under is not None and under[0] is filters and under[1] == len(filters) and (
            not filters or under[2] is filters[0]):
        return True
    action = warnings.defaultaction
    for act, msg, cat, mod, ln in filters:
        if ((msg is None or msg.match(site.message)) and issubclass(category, cat)
                and (mod is None or mod.match(module)) and (ln == 0 or site.lineno == ln)):
            action = act
            break
    if action == "ignore":
        site.ignored_under = (filters, len(filters), filters[0] if filters else None)
        return True
    site.ignored_under = None
    return False


#: Per call site and rule: (the filters list, its length, its first entry, the answer) of the last `rule_off`.
_off: dict[tuple[str, str, int], tuple[Any, int, Any, bool]] = {}
_CODE_LIKE = re.compile(r"(?i)st\d*")
_named_no_rule: set[str] = set()


def rule_off(code: str, filename: str, lineno: int, module_globals: dict[str, Any]) -> bool:
    """Whether the warning filters in force switch rule ``code`` off at this line: the first filter that applies
    to the rule's warning there, among those that *name* a rule, ignores it. A filter names a rule by its code at
    the start of its message pattern, as a whole word (``-W ignore:ST003``; ``ignore:ST01`` names none), or by a
    safetorch category (``ignore::safetorch.EvalModeGradWarning``, ``ignore::safetorch.SafetorchWarning`` for all).
    A filter that names no rule (``simplefilter("ignore")``, ``ignore::UserWarning``) only hides the message, and
    the rule still acts. Cached per site until the filters change (a dict lookup and three comparisons)."""
    filters = warnings.filters
    key = (code, filename, lineno)
    entry = _off.get(key)
    first = filters[0] if filters else None
    if entry is not None and entry[0] is filters and entry[1] == len(filters) and entry[2] is first:
        return entry[3]
    answer = False
    try:
        category = _rule(code).category
        module = module_globals.get("__name__") or _module_name(filename)
        answer = _filtered_off(code, category, module, lineno, filters)
        _warn_filters_naming_no_rule(filters, filename, lineno, module)
    except Exception as exc:
        internal_error(code, exc)
    if len(_off) > 1 << 14:
        _off.clear()
    _off[key] = (filters, len(filters), first, answer)
    return answer


def _names(msg: Any, code: str) -> bool | None:
    """Whether a filter's message pattern names rule ``code`` (True), names another text (False), or is empty."""
    if msg is None or not msg.pattern:
        return None
    found = msg.match(code + " ")
    return found is not None and found.end() >= len(code)


def _filtered_off(code: str, category: type[Warning], module: str, lineno: int, filters: Any) -> bool:
    from ._exceptions import SafetorchWarning

    for action, msg, cat, mod, ln in filters:
        if not issubclass(category, cat) or (mod is not None and not mod.match(module)) or (ln and ln != lineno):
            continue
        names = _names(msg, code)
        if names is False:
            continue  # another message (or a code prefix that is no whole code: `ST01`)
        if names is None and not issubclass(cat, SafetorchWarning):
            continue  # a blanket filter (every warning, every UserWarning): it hides, it does not switch off
        return action == "ignore"
    return False


def _warn_filters_naming_no_rule(filters: Any, filename: str, lineno: int, module: str) -> None:
    """An ignore filter whose message looks like a rule code but is none (``ignore:ST01``, a typo for ST001) hides
    every finding whose code starts with it and switches none off: say so, once per pattern."""
    from ._exceptions import SafetorchConfigWarning
    from ._rules import RULES

    for action, msg, _cat, _mod, _ln in filters:
        if action != "ignore" or msg is None or not _CODE_LIKE.fullmatch(msg.pattern.replace("\\", "")):
            continue
        pattern = msg.pattern
        if pattern in _named_no_rule or any(_names(msg, code) for code in RULES):
            continue
        _named_no_rule.add(pattern)
        try:  # at the line of the finding it hides
            warnings.warn_explicit(
                f"safetorch: the warnings filter 'ignore:{pattern}' names no rule (codes are matched as whole words: "
                f"{', '.join(sorted(RULES)[:2])}, …): no rule is switched off, but Python hides every message that "
                f"starts with {pattern!r}. Write the whole code (-W ignore:ST003) or use SAFETORCH_IGNORE.",
                SafetorchConfigWarning, filename, lineno, module=module)
        except Exception:  # a filter set to "error" must not break the host
            pass


def internal_error(code: str, exc: BaseException, what: str = "failed internally") -> None:
    """A check failed: say so once per check and carry on; the user's program must not notice.

    Every check guards its own logic with ``except Exception as exc: internal_error(CODE, exc)``. A
    `SafetorchError` is a strict-mode finding, not a failure, and a `Warning` raised as an exception is a finding
    that the program's warning filters (``-W error``) turned into one: both are raised again, to reach the user.
    """
    __tracebackhide__ = True  # noqa: F841
    if isinstance(exc, (SafetorchError, Warning)):  # a finding raised in strict mode, or by a `-W error` filter
        raise exc
    if code in _internal_reported or _without_data(exc):
        return
    _internal_reported.add(code)
    try:
        warnings.warn(
            f"safetorch: check {code} {what} ({type(exc).__name__}: {exc}) and is skipped from now on at that place; "
            f"your program is unaffected. Please report this with your torch version.",
            SafetorchInternalWarning,
            stacklevel=3,
        )
    except Exception:  # a warnings filter set to "error" must not break the host either
        pass


def _without_data(exc: BaseException) -> bool:
    """A check that read a value under FakeTensorMode (or from a fake tensor) failed where torch itself is fine."""
    from ._compat import fake_mode_active

    return fake_mode_active() or type(exc).__module__.startswith("torch._subclasses")


def found_in_run() -> int:
    """How many sites the run found so far: this process's and, for the run's owner, its other processes'."""
    _settle()
    return len(findings()) + len(_from_others())


def seen_here(code: str, filename: str, lineno: int) -> bool:
    """Whether this process has reported that site (shown or not)."""
    return (code, filename, lineno) in _sites


def findings() -> list[Site]:
    """Every call site reported so far, in order of first occurrence (``# safetorch: ignore``'d lines left out)."""
    return [s for s in _sites.values() if not s.suppressed]


def reset() -> None:
    """Forget every reported call site (tests, and programs that want to see findings again)."""
    with _lock:
        _sites.clear()
        _internal_reported.clear()
    _run.forget()


def prune_traceback(tb: TracebackType | None) -> TracebackType | None:
    """Cut the trailing torch/wrapt/safetorch frames off a traceback, so that it ends on the user's line."""
    last_user = None
    node = tb
    while node is not None:
        if not is_internal(node.tb_frame.f_code):
            last_user = node
        node = node.tb_next
    if last_user is not None:
        last_user.tb_next = None
    return tb


#: The runner exits 1 because of the findings (the program itself succeeded): the summary says so.
failing_exit = False

#: A host prints the summary itself (pytest's plugin, in its terminal summary): at exit, only the JSON is written.
summary_by_host = False
#: Where the document of ``--format json|sarif`` goes at exit: the runner's own stdout, kept as this file descriptor
#: while the program's stdout goes to stderr (`safetorch.__main__`); None: ``sys.__stdout__``.
document_fd: int | None = None


def shown_here(site: Site) -> bool:
    """Whether this process prints the site: under torchrun, rank 0 prints what every rank sees."""
    return _RANK == 0 or _rule(site.code).per_rank


def _only_here(site: Site) -> bool:
    """A shared finding of a rank other than 0 that no other process of the job has reported: this rank prints it."""
    return not shown_here(site) and not _run.reported_elsewhere(site.code, site.filename, site.lineno)


def _from_others() -> list[dict[str, Any]]:
    """What the run's other processes reported (children, workers, other ranks), for the owner's summary."""
    if not _run.owner() or _run.directory() is None:
        return []
    me = os.getpid()
    mine = {(s.code, s.filename, s.lineno) for s in findings()}
    return [e for e in _run.merged() if set(e["pids"]) - {me} and (e["code"], e["file"], e["line"]) not in mine]


def format_summary(others: list[dict[str, Any]] | None = None) -> str:
    sites = [s for s in findings() if (shown_here(s) or _only_here(s)) and not s.suppressed]
    others = _from_others() if others is None else others
    ranks = []
    if _run.torchrun():  # each rank prints its own findings; rank 0 says how many the others have
        ranks, others = (others if _RANK == 0 else []), []
    head = f"safetorch: {len(sites) + len(others)} finding(s) at " \
           f"{sum(s.count for s in sites) + sum(e['count'] for e in others)} occurrence(s)"
    if others:
        processes = {pid for e in others for pid in e["pids"]} - {os.getpid()}
        head += f", {len(others)} of them from {len(processes)} other process(es) of this run"
    if ranks:
        head += f"; {len(ranks)} more from other ranks of the job"
    lines = [head]
    for s in sites:  # a warning shown in full is one line here: where, how often, what
        text = first_clause(s.code, s.message) if s.warned else s.message.splitlines()[0].removeprefix(s.code).strip()
        lines.append(f"  {s.code} {s.filename}:{s.lineno} ({counted(s.code, s.count)}): {text}")
    for e in others + ranks:
        text = e["message"].splitlines()[0].removeprefix(e["code"]).strip()
        where = ", ".join(f"rank {r}" for r in e["ranks"]) if e.get("ranks") else \
            ", ".join(f"pid {p}" for p in e["pids"])
        if len(e.get("hosts", ())) > 1 or (e.get("hosts") and e["hosts"] != [_run._host()]):
            where += " on " + ", ".join(e["hosts"])
        lines.append(f"  {e['code']} {e['file']}:{e['line']} ({counted(e['code'], e['count'])}, {where}): {text}")
    if failing_exit:
        lines.append("safetorch: exit status 1 for these findings (the program itself succeeded; --exit-zero: 0)")
    return "\n".join(lines)


def _local_entries() -> list[dict[str, Any]]:
    return [{"code": s.code, "file": s.filename, "line": s.lineno, "count": s.count, "message": s.message,
             "pids": [os.getpid()], "ranks": [] if s.rank is None else [s.rank], "first_seen": s.first_seen,
             "host": _run._host(), "span": s.span, "source": s.source}
            for s in findings()]


def _version() -> str:
    package = sys.modules.get("safetorch")
    return str(getattr(package, "__version__", "0+unknown"))


def document(fmt: str) -> str:
    """Every finding of the run (this process's, merged with every other process's when there is a run directory)
    as a ``json`` list (``[]`` when there is none), a ``sarif`` log or ``github`` workflow commands."""
    from . import _formats

    raw = _run.merged(_local_entries()) if _run.directory() is not None else _local_entries()
    return _formats.render(fmt, raw, _version())


def write_json(path: str, fmt: str = "json") -> None:
    """Write `document` to ``path`` (under the run's lock when there is a run directory, atomically)."""
    if _run.directory() is not None:
        from . import _formats

        _run.write_report(path, lambda raw: _formats.render(fmt, raw, _version()), _local_entries())
        return
    _run.write_file(path, document(fmt))


#: What a check must do before the exit summary is made (report what it learnt late: ST019's graphs that died after
#: their forwards), by rule code.
_before_summary: dict[str, Callable[[], None]] = {}


def before_summary(code: str, callback: Callable[[], None] | None) -> None:
    """Have ``callback`` called at exit, before the summary (None: no longer)."""
    if callback is None:
        _before_summary.pop(code, None)
    else:
        _before_summary[code] = callback


def _settle() -> None:
    """Before counting or summarising: read the checks still in flight on a device (waiting for it), and let each
    check report what it learnt late. A strict-mode finding raised here is recorded: nothing is left to stop."""
    try:
        from . import _deferred

        _deferred.poll(wait=True)
    except Exception:
        pass
    for callback in list(_before_summary.values()):
        try:
            callback()
        except Exception:  # noqa: S110
            pass


def exit_summary() -> None:
    """At exit: write the JSON report when asked (``[]`` when nothing was found; strict mode's findings too), then
    print the summary on stderr (not in an interactive session). A report that cannot be written says so. The
    checks still in flight on a device are read first (waiting for it): a NaN loss of the last step is in the summary.
    In strict mode such a finding has nothing left to stop: the summary shows it."""
    _settle()
    try:
        for site in list(_sites.values()):  # each site's final count, for the run's report
            if not site.suppressed and site.count > 1:
                _run.record(site.code, site.filename, site.lineno, site.message, site.count, site.first_seen,
                            site.span, site.source)
        _run.gather()  # a rank of a job: every other rank's findings, from the job's store
        cfg = _config.current
        if not _run.owner():  # a child or worker of the run: the process that owns it reports
            _run.finish()
            return
        if cfg.report is False:
            _run.finish()
            return
        if isinstance(cfg.report, str):
            try:
                write_json(cfg.report, "sarif" if cfg.format == "sarif" else "json")
            except (OSError, ValueError) as exc:
                print(f"safetorch: the report {cfg.report!r} could not be written "
                      f"({type(exc).__name__}: {exc}); the summary follows.", file=sys.stderr)
        if cfg.format == "github" or (cfg.format in ("json", "sarif") and not isinstance(cfg.report, str)):
            # The document is the summary: on stdout, after the program's own output, for a tool to read.
            text = document(cfg.format)
            if text and (_RANK == 0 or not _run.torchrun()):  # under torchrun, rank 0 prints the job's
                with contextlib.suppress(Exception):
                    sys.stdout.flush()  # the program's own output first
                if document_fd is not None:
                    with open(document_fd, "w", encoding="utf-8", closefd=False) as out:
                        print(text, file=out, flush=True)
                else:
                    out = sys.__stdout__ or sys.stdout  # not where the program redirected sys.stdout
                    print(text, file=out, flush=True)
            _run.finish()
            return
        others = _from_others()
        mine = any((shown_here(s) or _only_here(s)) and not s.suppressed for s in _sites.values())
        if not mine and not (others and not _run.torchrun()):
            _run.finish()
            return
        if hasattr(sys, "ps1") or sys.flags.interactive or summary_by_host:
            _run.finish()
            return
        print(format_summary(others), file=sys.stderr)
        _run.finish()
    except Exception:
        pass
