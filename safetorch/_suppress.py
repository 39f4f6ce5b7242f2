"""Per-line suppression comments, read the way ruff reads its own: ``# safetorch: ignore[ST001]`` and ``# noqa: ST001``.

Design rules:
- A comment silences a finding when it stands on any physical line of the statement that holds the reported line
  (black and ruff-format move a call's trailing comment to its closing line: ``)  # safetorch: ignore[ST003]``), or
  alone on the line directly above that statement. A blank line in between breaks the link: a comment above a blank
  line speaks of a block, not of the next statement, and silencing a block is what `safetorch.ignore` is for.
- The statement is the tokenizer's logical line: every physical line from its first token to its NEWLINE, through
  brackets, backslashes and multi-line strings. For a compound statement that is its header only (``for x in f(\n
  a):``), so a comment on ``for …:`` never silences the loop's body.
- Comments are the tokenizer's COMMENT tokens, never a regex on the raw text: ``"# safetorch: ignore"`` inside a
  string is text, not a comment.
- ``# noqa: ST003`` (codes only, comma- or space-separated) is honoured, since people coming from ruff and flake8
  write it and both leave codes they do not know alone. A bare ``# noqa`` speaks to linters and silences nothing
  here: a line quieted for a linter must not hide a bug at run time.
- A code that names no rule (``ignore[ST03]``, ``noqa: ST03``) silences nothing, which is easy to miss: it is a
  `SafetorchConfigWarning` at the comment's own file and line, once per line. In ``# noqa`` only ``ST<digits>``
  codes are ours; the others belong to linters.
- Cheap: this runs only when a finding is about to be reported, never on the hot path. A file that holds no
  directive anywhere (most) is not tokenized at all; one that does is tokenized once (cached on the identity of
  linecache's list of its lines, so an edited and reloaded file is read again), and each (file, line) answered once.
"""

from __future__ import annotations

import linecache
import re
import threading
import tokenize
import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Verdict", "clear", "suppressed", "verdict"]

_IGNORE = re.compile(r"#\s*safetorch:\s*ignore\b(?:\[([^\]]*)\])?", re.IGNORECASE)
#: As ruff reads a noqa comment: the word, optionally ``: CODE[, CODE…]`` with codes of letters then digits.
_NOQA = re.compile(r"#\s*noqa(?::\s*([A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*))?", re.IGNORECASE)
_OURS = re.compile(r"(?i)ST[0-9]+")
_SPLIT = re.compile(r"[,\s]+")
#: A file where neither appears anywhere has no directive for us (most files): answered without the tokenizer.
_ANY = re.compile(r"safetorch:\s*ignore|noqa\s*:[^\n]*\bST[0-9]", re.IGNORECASE)
#: Bounds of the caches: generated code (exec'd strings, notebook cells) makes file names without end.
_MAX_FILES = 256
_MAX_LINES = 1 << 14


@dataclass(frozen=True)
class Verdict:
    """What the comments around one line silence: every rule, or the rules in ``codes``."""

    every: bool = False
    codes: frozenset[str] = frozenset()

    def silences(self, code: str) -> bool:
        return self.every or code in self.codes


_NOTHING = Verdict()


@dataclass(frozen=True)
class _Directive:
    """One comment's suppression: what it silences, and the tokens in it that name no rule (for the warning)."""

    verdict: Verdict
    unknown: tuple[str, ...] = ()
    text: str = ""


@dataclass
class _Source:
    """A file's comments and statement spans, from one pass of the tokenizer."""

    #: line -> the directive of the comment on it (only comments that carry one).
    directives: dict[int, _Directive] = field(default_factory=dict)
    #: Lines that hold nothing but a comment (outside any statement).
    alone: set[int] = field(default_factory=set)
    #: line -> (first, last) line of its statement, for statements longer than one line.
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)


_files: dict[str, tuple[list[str], _Source]] = {}
_answers: dict[tuple[str, int], tuple[list[str], Verdict]] = {}
_warned: set[tuple[str, int]] = set()
_lock = threading.Lock()


def clear() -> None:
    """Forget every file read and every line answered (the warnings already given stay given, as Python's own)."""
    _files.clear()
    _answers.clear()


def suppressed(code: str, filename: str, lineno: int, module_globals: dict[str, Any] | None = None) -> bool:
    """True when a comment on the statement of ``filename:lineno``, or alone on the line above it, silences rule
    ``code``. May warn (`SafetorchConfigWarning`) about a code in such a comment that names no rule."""
    return verdict(filename, lineno, module_globals).silences(code)


def verdict(filename: str, lineno: int, module_globals: dict[str, Any] | None = None) -> Verdict:
    """What the comments around ``filename:lineno`` silence, computed once per (file, line) and file version."""
    lines = _getlines(filename, module_globals)
    if not lines:
        return _NOTHING
    key = (filename, lineno)
    cached = _answers.get(key)
    if cached is not None and cached[0] is lines:
        return cached[1]
    source = _source(filename, lines)
    first, last = source.spans.get(lineno, (lineno, lineno))
    where = list(range(first, last + 1))
    if first - 1 in source.alone:
        where.append(first - 1)
    found = [(line, source.directives[line]) for line in where if line in source.directives]
    for line, directive in found:
        if directive.unknown:
            _warn_unknown(directive, filename, line, module_globals)
    answer = _combine([d.verdict for _, d in found])
    if len(_answers) > _MAX_LINES:
        _answers.clear()
    _answers[key] = (lines, answer)
    return answer


def _combine(verdicts: list[Verdict]) -> Verdict:
    if not verdicts:
        return _NOTHING
    if len(verdicts) == 1:
        return verdicts[0]
    return Verdict(any(v.every for v in verdicts), frozenset().union(*(v.codes for v in verdicts)))


def _getlines(filename: str, module_globals: dict[str, Any] | None) -> list[str]:
    """linecache's lines of a file or notebook cell ([] when there is no source), as `_callsite.getline` reads one."""
    try:
        return linecache.getlines(filename, module_globals)
    except (ImportError, OSError):  # a loader that cannot serve this module's source under its run name
        return linecache.getlines(filename)


def _source(filename: str, lines: list[str]) -> _Source:
    cached = _files.get(filename)
    if cached is not None and cached[0] is lines:
        return cached[1]
    source = _read(lines) if _ANY.search("".join(lines)) else _Source()
    if len(_files) > _MAX_FILES:
        _files.clear()
    _files[filename] = (lines, source)
    return source


def _read(lines: list[str]) -> _Source:
    """One pass of the tokenizer: the comments that carry a directive, the comment-only lines, and the span of each
    statement longer than one line. A file that does not tokenize to the end (edited since it was imported) keeps
    what was read before the error; each later line is read alone, as its own statement."""
    source = _Source()
    start: int | None = None
    reached = 0
    skip = (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER)
    try:
        for tok in tokenize.generate_tokens(iter(lines).__next__):
            row = tok.start[0]
            if tok.type == tokenize.COMMENT:
                _comment(source, row, tok.string, alone=not tok.line[: tok.start[1]].strip() and start is None)
            elif tok.type == tokenize.NEWLINE:
                if start is not None and row > start:
                    for line in range(start, row + 1):
                        source.spans[line] = (start, row)
                start = None
                reached = row
            elif tok.type not in skip and start is None:
                start = row
    except (tokenize.TokenError, SyntaxError):
        for row in range(reached + 1, len(lines) + 1):
            _read_alone(source, row, lines[row - 1])
    return source


def _read_alone(source: _Source, row: int, line: str) -> None:
    try:
        for tok in tokenize.generate_tokens(iter([line]).__next__):
            if tok.type == tokenize.COMMENT:
                _comment(source, row, tok.string, alone=not tok.line[: tok.start[1]].strip())
    except (tokenize.TokenError, SyntaxError):
        pass


def _comment(source: _Source, row: int, text: str, alone: bool) -> None:
    if alone:
        source.alone.add(row)
    directive = _directive(text)
    if directive is not None:
        source.directives[row] = directive


def _directive(text: str) -> _Directive | None:
    """The suppression a comment carries, if any. One comment may hold several (``# noqa: E501  # safetorch:
    ignore[ST001]``): their rules add up."""
    from ._rules import resolve

    every = False
    codes: set[str] = set()
    unknown: list[str] = []
    seen = False
    for match in _IGNORE.finditer(text):
        seen = True
        if match.group(1) is None:
            every = True
            continue
        tokens = [t for t in _SPLIT.split(match.group(1)) if t]
        if not tokens:
            unknown.append("")  # `ignore[]`: it names nothing
        for token in tokens:
            resolved = resolve(token)
            if resolved is None:
                unknown.append(token)
            else:
                codes.add(resolved)
    for match in _NOQA.finditer(text):
        for token in _SPLIT.split(match.group(1) or ""):
            if not _OURS.fullmatch(token):
                continue  # a linter's code, or a bare noqa: not ours
            seen = True
            resolved = resolve(token)
            if resolved is None:
                unknown.append(token)
            else:
                codes.add(resolved)
    if not seen:
        return None
    return _Directive(Verdict(every, frozenset(codes)), tuple(unknown), text.strip())


def _warn_unknown(directive: _Directive, filename: str, lineno: int, module_globals: dict[str, Any] | None) -> None:
    """Say, once per comment line, that a code in it names no rule: the comment silences nothing for it."""
    from . import _notebook
    from ._exceptions import SafetorchConfigWarning
    from ._rules import valid_tokens

    with _lock:
        if (filename, lineno) in _warned:
            return
        _warned.add((filename, lineno))
    bad = ", ".join(repr(t) for t in directive.unknown)
    message = (f"safetorch: the comment {directive.text!r} names no rule in {bad}, so it silences nothing for it. "
               f"Valid codes and names (codes only in '# noqa: …'): {valid_tokens()}.")
    module = (module_globals or {}).get("__name__") or filename.removesuffix(".py")
    try:
        warnings.warn_explicit(message, SafetorchConfigWarning, _notebook.cell_name(filename) or filename, lineno,
                               module=module)
    except Exception:  # a filter set to "error" must not break the host
        pass
