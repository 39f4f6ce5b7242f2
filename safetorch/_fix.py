"""``safetorch fix``: turn what a run found into a reviewed patch.

``python -m safetorch fix [--write [--no-verify]] [--check] [--verify] [--from REPORT.json] [--] script.py [args…]``
runs the program as the runner does (or reads a JSON report), then prints a unified diff of the fixes for the findings
that have a mechanical one. Static fixers can only guess what a line does; here the run has seen it: that
``x.cuda()`` at that line was discarded, that the model called there was evaluated with nothing using its graph, that
``size_average=False`` meant ``reduction='sum'``. The rewrite keeps everything else of the file byte for byte: it is
made on a concrete syntax tree (libcst, the optional extra ``safetorch[fix]``), and only the nodes a fix names change.

Design rules:
- A fix never writes a program that is broken or does something else. It is made only where the finding and the
  source together make it certain; anything else is *skipped*, with the reason, and listed.
- Rewrite by position, not by text: a finding carries its expression's span (line and columns, from the bytecode
  positions, 3.11+) and source text; the fix rewrites that node or nothing, and only if the file still holds that
  text there (a report read later, a file edited since). Without a span (3.10, an older report) a line's only
  candidate is taken, and a line of several is skipped.
- A fix is only as wide as what the run proved (`safetorch._fixtrace`: the lines that ran, and the program's frames
  at each backward): ST003's ``no_grad`` takes a loop only where no backward ran from any of its lines, ST005's
  takes the uses of the volatile input only then. A report carries no such record: only the statement.
- Facts come from the finding: its rule, place and message (the message is the rule's, stable and tested: the
  reduction ST002 computed, the receiver ST001 found assignable, the prefix ST014 found). A fix never runs the
  user's code; ``--verify`` (the default of ``--write``) runs the patched copy.
- The fixes of one file are applied in one pass over the original tree (nested fixes compose: a conversion fixed
  inside a loop that is wrapped in ``torch.no_grad()``), so that their positions never shift under each other.
- Files are read and written as Python decodes them, all or none (`safetorch._fixio`).
- ``--verify`` applies the patch to a copy of the script's directory, runs it again and keeps only the fixes whose
  findings are gone from the run that still succeeds (when the run with every fix fails, each is tried alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from . import _fixio, _fixtrace

__all__ = ["Edit", "Plan", "Skip", "fixable", "main", "plan"]

#: The rules ``fix`` handles, and what it writes.
FIXABLE: dict[str, str] = {
    "ST001": "x.cuda() -> x = x.cuda() (a receiver that takes the assignment: not a parameter, a property)",
    "ST002": "size_average=/reduce= -> the equivalent reduction=",
    "ST003": "the evaluation under `with torch.no_grad():` (its loop where the run saw no backward in it)",
    "ST004": "total += loss -> total += loss.item()",
    "ST005": "Variable(x, volatile=True) -> Variable(x), its uses under `with torch.no_grad():`",
    "ST009": "the softmax's input passed to the loss (log_softmax for nll_loss)",
    "ST013": "F.dropout(x, p) -> F.dropout(x, p, training=self.training)",
    "ST014": "the prefix the finding names stripped from the checkpoint's keys",
    "ST015": "p.require_grad -> p.requires_grad; module.requires_grad = False -> module.requires_grad_(False)",
}

INSTALL_HINT = "safetorch fix needs libcst: pip install 'safetorch[fix]' (or pip install libcst)"

#: Calls that read as training: a veto for lines the run never reached (what may train there), never a proof.
_TRAINING_CALLS = re.compile(r"\.backward\(|\.step\(|zero_grad\(|autograd\.grad\(|autograd\.backward\(")
_DROPOUTS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"})


def fixable(code: str) -> bool:
    return code in FIXABLE


@dataclasses.dataclass(frozen=True)
class Finding:
    code: str
    path: str  # absolute
    line: int
    message: str
    #: The expression the finding is about, (line, column, end line, end column) as ``ast`` counts them (columns in
    #: UTF-8 bytes), and its source text as the run read it; None when the report has none (Python 3.10).
    span: tuple[int, int, int, int] | None = None
    source: str | None = None
    #: When the run first found it (seconds since the epoch), if the report says.
    seen: float | None = None


@dataclasses.dataclass
class Edit:
    """One fix: ``node`` of the file's tree (the original) becomes ``make(node as updated by nested fixes)``."""

    finding: Finding
    path: str
    line: int  # the first line of the node it changes
    end: int  # its last line
    what: str
    node: Any = dataclasses.field(repr=False)
    make: Callable[[Any], Any] = dataclasses.field(repr=False)
    #: The node's type and position: how the node is found again in another parse of the same text.
    key: tuple[type, int, int, int, int] = dataclasses.field(repr=False, default=(object, 0, 0, 0, 0))
    #: The lines it puts under ``with torch.no_grad():`` (ST003, ST005), if it does.
    wraps: tuple[int, int] | None = None


@dataclasses.dataclass
class Skip:
    finding: Finding
    why: str


@dataclasses.dataclass
class Plan:
    edits: list[Edit]
    skips: list[Skip]
    sources: dict[str, str]  # path -> its text now
    files: dict[str, _fixio.Source] = dataclasses.field(default_factory=dict)  # path -> how it was read

    def patched(self, edits: Sequence[Edit] | None = None) -> dict[str, str]:
        """path -> the text with ``edits`` (all by default) applied, for the files they change."""
        chosen = self.edits if edits is None else edits
        out: dict[str, str] = {}
        for path in dict.fromkeys(e.path for e in chosen):
            out[path] = _apply(self.sources[path], [e for e in chosen if e.path == path])
        return out

    def diff(self, edits: Sequence[Edit] | None = None, root: str | None = None) -> str:
        chunks = []
        for path, new in self.patched(edits).items():
            old = self.sources[path]
            if new == old:
                continue
            shown = os.path.relpath(path, root or os.getcwd())
            if shown.startswith(".."):
                shown = path
            chunks.append("".join(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                                       f"a/{shown}", f"b/{shown}")))
        return "".join(chunks)


# --- reading findings ----------------------------------------------------------------------------------------------


def findings_from(entries: Iterable[dict[str, Any]], base: str | None = None) -> list[Finding]:
    """Findings from a JSON report's entries (``rule``/``code``, ``abspath``/``file``/``path``, ``line``,
    ``message``); relative paths are ``base``'s (the report's directory's run: its working directory)."""
    found = []
    for e in entries:
        if not isinstance(e, dict):
            continue
        code = e.get("rule") or e.get("code")
        path = e.get("abspath") or e.get("file") or e.get("path")
        if not isinstance(code, str) or not isinstance(path, str) or not isinstance(e.get("line"), int):
            continue
        if not os.path.isabs(path):
            path = os.path.join(base or os.getcwd(), path)
        message = re.sub(r"\s*\(safetorch explain ST\d+\)\s*$", "", str(e.get("message", "")))
        found.append(Finding(code, os.path.normpath(path), e["line"], message, *_span_of(e), _seen(e)))
    return list(dict.fromkeys(found))


def _span_of(e: dict[str, Any]) -> tuple[tuple[int, int, int, int] | None, str | None]:
    where = (e.get("line"), e.get("col"), e.get("end_line"), e.get("end_col"))
    source = e.get("source")
    if all(type(n) is int and n >= 0 for n in where) and isinstance(source, str):
        return where, source  # type: ignore[return-value]
    return None, None


def _seen(e: dict[str, Any]) -> float | None:
    import datetime

    seen = e.get("first_seen")
    if isinstance(seen, (int, float)):
        return float(seen)
    try:
        return datetime.datetime.fromisoformat(seen).timestamp() if isinstance(seen, str) else None
    except ValueError:
        return None


# --- planning ------------------------------------------------------------------------------------------------------


def plan(findings: Iterable[Finding], facts: _fixtrace.Facts | None = None, since: float | None = None) -> Plan:
    """The fixes (and the skips) for ``findings``, read against their files as they are now. ``facts`` is what the
    run saw happen (`safetorch._fixtrace`: what ran, where backwards were called from), None for a report; ``since``,
    when the run started (a file modified after it is refused)."""
    import libcst as cst  # noqa: F401  (ImportError: the caller says how to install it)

    result = Plan([], [], {})
    by_file: dict[str, list[Finding]] = {}
    for f in findings:
        if fixable(f.code):
            by_file.setdefault(f.path, []).append(f)
    for path, found in by_file.items():
        if _installed(path):
            result.skips.extend(Skip(f, "in an installed library, not the program's own code") for f in found)
            continue
        try:
            read = _fixio.read(path)
        except OSError as exc:
            result.skips.extend(Skip(f, f"the file cannot be read ({exc.strerror})") for f in found)
            continue
        except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
            result.skips.extend(Skip(f, f"the file cannot be decoded as Python decodes it ({exc})") for f in found)
            continue
        source = read.text
        try:
            tree = _Tree(path, source, facts)
        except Exception as exc:  # a file libcst does not parse (a newer syntax)
            result.skips.extend(Skip(f, f"the file does not parse ({type(exc).__name__})") for f in found)
            continue
        result.sources[path] = source
        result.files[path] = read
        taken: set[tuple[Any, str]] = set()
        for f in sorted(found, key=lambda f: (f.line, f.code)):
            stale = _stale(tree, f, read, since)
            try:
                made = stale or _FIXERS[f.code](tree, f)
            except Exception as exc:  # never let one odd line stop the others
                made = f"no fix could be made ({type(exc).__name__}: {exc})"
            if isinstance(made, str):
                result.skips.append(Skip(f, made))
                continue
            for edit in made if isinstance(made, list) else [made]:
                if (edit.key, edit.what) not in taken:  # two findings, one fix (a loop of two evaluations)
                    taken.add((edit.key, edit.what))
                    result.edits.append(edit)
    _one_no_grad(result)
    return result


def _one_no_grad(result: Plan) -> None:
    """A ``no_grad`` block inside another one of the same patch (ST005's uses inside ST003's evaluation loop) is
    not written: the outer one holds it."""
    wraps = [e for e in result.edits if e.wraps is not None]
    for inner in wraps:
        outer = next((o for o in wraps if o is not inner and o.path == inner.path and o in result.edits
                      and o.wraps[0] <= inner.wraps[0] and inner.wraps[1] <= o.wraps[1]), None)  # type: ignore[index]
        if outer is None:
            continue
        result.edits.remove(inner)
        if not any(e.finding == inner.finding for e in result.edits):
            result.skips.append(Skip(inner.finding, f"already under the `with torch.no_grad():` that the fix of "
                                                    f"{outer.finding.code} at line {outer.finding.line} writes"))


def _stale(tree: _Tree, f: Finding, read: _fixio.Source, since: float | None) -> str | None:
    """Why the file no longer holds what the run found there (None when it does): the finding's expression is not
    at its place any more, or, without one, the file was modified after the run."""
    if f.span is not None and f.source is not None:
        now = tree.text_at(f.span)
        if now != f.source:
            return (f"the file changed since the run: line {f.line} no longer holds `{' '.join(f.source.split())}` "
                    f"there: run again")
        return None
    started = since if since is not None else f.seen
    if started is not None and read.mtime > started + 1.0:  # report times are whole seconds
        return "the file changed since the run (modified after it), and the finding has no source to compare: run again"
    return None


def _installed(path: str) -> bool:
    """A file of an installed library or of the standard library (never rewritten)."""
    import sysconfig

    real = os.path.realpath(path)
    roots = {sysconfig.get_paths().get(k) for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    return any(f"{os.sep}{d}{os.sep}" in real for d in ("site-packages", "dist-packages")) or any(
        r and real.startswith(os.path.realpath(r) + os.sep) for r in roots)


class _Tree:
    """A file's tree with its positions and parents."""

    def __init__(self, path: str, source: str, facts: _fixtrace.Facts | None = None) -> None:
        import libcst as cst
        from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

        self.path = path
        self.facts = facts
        self.lines = source.splitlines(keepends=True)
        self.wrapper = MetadataWrapper(cst.parse_module(source))
        self.module = self.wrapper.module
        self.positions = self.wrapper.resolve(PositionProvider)
        self.parents = self.wrapper.resolve(ParentNodeProvider)

    def _column(self, line: int, byte: int) -> int:
        """A column in UTF-8 bytes (Python's) as a column in characters (libcst's)."""
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return len(text.encode()[:byte].decode(errors="ignore"))

    def text_at(self, span: tuple[int, int, int, int]) -> str | None:
        """The file's text at a span of the run's (columns in UTF-8 bytes), None where the file is shorter."""
        line, col, end_line, end_col = span
        if not 0 < line <= end_line <= len(self.lines):
            return None
        encoded = [t.encode() for t in self.lines[line - 1:end_line]]
        if len(encoded) == 1:
            return encoded[0][col:end_col].decode(errors="replace")
        return b"".join([encoded[0][col:], *encoded[1:-1], encoded[-1][:end_col]]).decode(errors="replace")

    def at_span(self, f: Finding, kind: type | tuple[type, ...]) -> Any:
        """The node of ``kind`` that is exactly the finding's expression (None without a span, or when none is)."""
        if f.span is None:
            return None
        line, col, end_line, end_col = f.span
        start, end = (line, self._column(line, col)), (end_line, self._column(end_line, end_col))
        found = [n for n, r in self.positions.items() if isinstance(n, kind)
                 and (r.start.line, r.start.column) == start and (r.end.line, r.end.column) == end]
        return found[-1] if found else None  # the innermost: `(x.float())` is one Call in parentheses

    def span(self, node: Any) -> tuple[int, int]:
        rng = self.positions[node]
        return rng.start.line, rng.end.line

    def code(self, node: Any) -> str:
        return self.module.code_for_node(node)

    def statement(self, line: int) -> Any:
        """The innermost simple statement line that holds ``line``."""
        import libcst as cst

        best = None
        for node, rng in self.positions.items():
            if isinstance(node, cst.SimpleStatementLine) and rng.start.line <= line <= rng.end.line:
                if best is None or rng.start.line >= self.positions[best].start.line:
                    best = node
        return best

    def nodes(self, root: Any, kind: type) -> list[Any]:
        """The nodes of ``kind`` under ``root`` (itself included), in source order."""
        found: list[Any] = []

        def walk(node: Any) -> None:
            if isinstance(node, kind):
                found.append(node)
            for child in node.children:
                walk(child)

        walk(root)
        return found

    def ancestors(self, node: Any) -> list[Any]:
        out = []
        while node in self.parents:
            node = self.parents[node]
            out.append(node)
        return out

    def binds_torch(self) -> bool:
        import libcst as cst

        for stmt in self.module.body:
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, cst.Import) and any(
                            alias.asname is None and self.code(alias.name).split(".")[0] == "torch"
                            or alias.asname is not None and self.code(alias.asname.name) == "torch"
                            for alias in small.names):
                        return True
        return False

    def spans(self, node: Any, f: Finding) -> bool:
        """Whether ``node`` is exactly the finding's expression."""
        if f.span is None or node not in self.positions:
            return False
        line, col, end_line, end_col = f.span
        r = self.positions[node]
        return (r.start.line, r.start.column, r.end.line, r.end.column) == (
            line, self._column(line, col), end_line, self._column(end_line, end_col))

    def key(self, node: Any) -> tuple[type, int, int, int, int]:
        rng = self.positions[node]
        return type(node), rng.start.line, rng.start.column, rng.end.line, rng.end.column

    def edit(self, finding: Finding, node: Any, what: str | None, make: Callable[[Any], Any]) -> Edit:
        """The edit of ``node``; ``what`` says it (None: the rewritten node's own text, on one line)."""
        start, end = self.span(node)
        if what is None:
            what = " ".join(self.code(make(node)).split())
            what = what if len(what) <= 80 else what[:77] + "..."
        return Edit(finding, self.path, start, end, what, node, make, self.key(node))


def _apply(source: str, edits: Sequence[Edit]) -> str:
    """``source`` with ``edits`` applied in one pass (they were planned on another parse of the same text: each node
    is found again by its type and position)."""
    import libcst as cst

    tree = _Tree("", source)
    by_key: dict[tuple[type, int, int, int, int], list[Edit]] = {}
    for e in edits:
        by_key.setdefault(e.key, []).append(e)
    wanted: dict[int, list[Edit]] = {}
    for node in tree.positions:
        found = by_key.get(tree.key(node))
        if found:
            wanted[id(node)] = found

    class Apply(cst.CSTTransformer):
        def on_leave(self, original: Any, updated: Any) -> Any:
            for e in wanted.get(id(original), ()):
                updated = e.make(updated)
            return updated

    return tree.module.visit(Apply()).code


# --- the fixers: each returns an Edit, or the reason it makes none -------------------------------------------------


def _simple_chain(node: Any) -> bool:
    import libcst as cst

    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name)


def _call_name(call: Any) -> str:
    import libcst as cst

    func = call.func
    if isinstance(func, cst.Attribute):
        return func.attr.value
    if isinstance(func, cst.Name):
        return func.value
    return ""


def _pick(tree: _Tree, f: Finding, candidates: Sequence[Any], describe: str,
          node_of: Callable[[Any], Any] = lambda n: n) -> Any:
    """The candidate that is the finding's expression (``node_of(candidate)`` spans exactly what the run recorded);
    without a recorded span, the line's only candidate. A string (the reason) when there is none to be sure of."""
    if f.span is not None:
        exact = [c for c in candidates if tree.spans(node_of(c), f)]
        if exact:
            return exact[0]
        return f"the finding's expression `{' '.join((f.source or '').split())}` is not {describe}"
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        return f"no {describe} at that line"
    return (f"the line holds {len(candidates)} of them ({describe}) and the finding does not say which (no column: "
            f"Python 3.10, or a report without one): fix it by hand")


_WRITE = re.compile(r"\. Write: (.+?) = (.+)$")


def _fix_st001(tree: _Tree, f: Finding) -> Edit | str:
    import libcst as cst

    stmt = tree.statement(f.line)
    if stmt is None:
        return "no statement at that line"
    method = re.match(r"ST001 (?:tensor\.(\w+)\(\)|.*?\.(\w+)\()", f.message)
    name = next((g for g in method.groups() if g), None) if method else None
    candidates = [small for small in stmt.body if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call)
                  and isinstance(small.value.func, cst.Attribute)
                  and (name is None or small.value.func.attr.value == name)]
    small = _pick(tree, f, candidates, "a discarded conversion that is a statement of its own",
                  lambda n: n.value)
    if isinstance(small, str):
        return small
    call = small.value
    wanted = _WRITE.search(f.message)
    receiver = call.func.value
    if wanted is None:
        return (f"`{_one_line(tree, receiver)}` cannot take an assignment (a module's parameter, a property, an "
                f"item of a tensor or a tuple, or a value the run could not read): assign the result to a name by hand")
    target = wanted.group(1)
    readable = {_one_line(tree, receiver), *(_one_line(tree, a.value) for a in call.args[:1] if a.keyword is None)}
    if target not in readable:
        return f"the finding's receiver `{target}` is not the call's at that line"

    def make(node: Any, target: str = target) -> Any:
        return cst.Assign(targets=[cst.AssignTarget(target=cst.parse_expression(target))], value=node.value,
                          semicolon=node.semicolon)

    return tree.edit(f, small, None, make)


def _one_line(tree: _Tree, node: Any) -> str:
    from ._callsite import normalized

    return normalized(tree.code(node))


_LEGACY = ("size_average", "reduce")


def _fix_st002(tree: _Tree, f: Finding) -> Edit | str:
    import libcst as cst

    match = re.search(r"write reduction='(\w+)'", f.message)
    if match is None:
        return "the finding does not name the reduction"
    new = match.group(1)
    stmt = tree.statement(f.line)
    if stmt is None:
        return "no statement at that line"
    def legacy(call: Any) -> bool:
        return any(a.keyword is not None and (a.keyword.value in _LEGACY or a.keyword.value == "reduction"
                   and isinstance(a.value, cst.SimpleString) and a.value.evaluated_value == "elementwise_mean")
                   for a in call.args)

    call = _pick(tree, f, [c for c in tree.nodes(stmt, cst.Call) if legacy(c)], "a call with a legacy argument")
    if isinstance(call, str):
        return call
    if any(a.keyword is None and a.star == "" for a in call.args) and _call_name(call)[:1].isupper() \
            and len([a for a in call.args if a.keyword is None]) > 1:
        return "legacy arguments given by position: write reduction= by hand"
    quote = _quote(tree, call)

    def make(node: Any, new: str = new, quote: str = quote) -> Any:
        args = [a for a in node.args if a.keyword is None or a.keyword.value not in (*_LEGACY, "reduction")]
        value = cst.SimpleString(f"{quote}{new}{quote}")
        old = next((a for a in node.args if a.keyword is not None and a.keyword.value == "reduction"), None)
        if old is not None:  # in its place
            index = node.args.index(old)
            kept = [a for a in node.args[:index] if a in args]
            args.insert(len(kept), old.with_changes(value=value))
        else:
            first = next((a for a in node.args if a.keyword is not None and a.keyword.value in _LEGACY), None)
            arg = cst.Arg(value=value, keyword=cst.Name("reduction"),
                          equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                                whitespace_after=cst.SimpleWhitespace("")))
            index = node.args.index(first) if first is not None else len(node.args)
            kept = [a for a in node.args[:index] if a in args]
            args.insert(len(kept), arg)
        return node.with_changes(args=_commas(args, node.args))

    return tree.edit(f, call, f"reduction={quote}{new}{quote}", make)


def _quote(tree: _Tree, near: Any) -> str:
    """The quote the call's own strings use, else the file's first string's, else a double quote."""
    import libcst as cst

    for root in (near, tree.module):
        for s in tree.nodes(root, cst.SimpleString):
            if s.quote in ("'", '"'):
                return s.quote
    return '"'


def _commas(args: list[Any], before: Sequence[Any]) -> list[Any]:
    """Arguments with their commas as a call wrote them: the last keeps the old last one's (none, or trailing)."""
    import libcst as cst

    if not args:
        return args
    last_comma = before[-1].comma if before else cst.MaybeSentinel.DEFAULT
    middle = next((a.comma for a in before[:-1] if not isinstance(a.comma, cst.MaybeSentinel)), None)
    out = []
    for i, a in enumerate(args):
        if i < len(args) - 1:
            comma = a.comma if not isinstance(a.comma, cst.MaybeSentinel) else (middle or cst.Comma(
                whitespace_after=cst.SimpleWhitespace(" ")))
            out.append(a.with_changes(comma=comma))
        else:
            out.append(a.with_changes(comma=last_comma))
    return out


def _enclosing(tree: _Tree, node: Any, kind: type | tuple[type, ...]) -> list[Any]:
    return [a for a in tree.ancestors(node) if isinstance(a, kind)]


def _fix_st003(tree: _Tree, f: Finding) -> Edit | str:
    """The evaluation under ``with torch.no_grad():``. What goes under it is what the run proved trains nothing: the
    statement of the forward, and each loop around it (in its function, innermost first) while no backward ran from
    any line of that loop (a training helper it calls included), none of its lines that never ran reads as training,
    and it returns or yields nothing. Without the run's record (a report), only the statement."""
    import libcst as cst

    stmt = tree.statement(f.line)
    if stmt is None:
        return "no statement at that line"
    if f.span is not None and not any(tree.spans(c, f) for c in tree.nodes(stmt, cst.Call)):
        return f"the finding's forward `{' '.join((f.source or '').split())}` is not a call of that statement"
    if not tree.binds_torch():
        return "the file does not `import torch`: wrap the evaluation in `with torch.no_grad():` by hand"
    if not isinstance(tree.parents.get(stmt), (cst.IndentedBlock, cst.Module)):
        return "the forward is on one line with its block's header: split the line, then wrap it by hand"
    ancestors = tree.ancestors(stmt)
    function = next((a for a in ancestors if isinstance(a, (cst.FunctionDef, cst.Lambda))), None)
    inside = ancestors[: ancestors.index(function)] if function is not None else ancestors
    if any(isinstance(a, cst.With) and "no_grad" in tree.code(a.items[0]) for a in inside):
        return "already under no_grad"
    if any(isinstance(s, cst.Return) for s in stmt.body):
        return "the forward's result is returned: its callers may train through it"
    start, end = tree.span(stmt)
    if tree.facts is not None and tree.facts.backward_within(tree.path, start, end):
        return "a backward ran from the forward's own statement"
    target, what = stmt, "the evaluation under `with torch.no_grad():`"
    if tree.facts is None and _TRAINING_CALLS.search(tree.code(stmt)):
        return "the forward's statement reads as training, and without a run (a report) nothing shows it does not"
    if tree.facts is not None:
        for loop in (a for a in inside if isinstance(a, (cst.For, cst.While))):
            first, last = tree.span(loop)
            if _trains(tree, [loop], first, last):
                break  # an outer loop holds this one: it trains too
            target, what = loop, "the evaluation loop under `with torch.no_grad():`"

    def make(node: Any) -> Any:
        inner = node.with_changes(leading_lines=())
        return cst.With(items=[cst.WithItem(item=cst.parse_expression("torch.no_grad()"))],
                        body=cst.IndentedBlock(body=[inner]), leading_lines=node.leading_lines)

    edit = tree.edit(f, target, what, make)
    edit.wraps = tree.span(target)
    return edit


def _fix_st004(tree: _Tree, f: Finding) -> Edit | str:
    import libcst as cst

    match = re.search(r"Write: .*?(\.item\(\)|\.detach\(\))", f.message)  # `losses.append(x.item())`
    if match is None:
        return "the finding does not say what to write"
    method = match.group(1)[1:-2]
    stmt = tree.statement(f.line)
    if stmt is None:
        return "no statement at that line"

    def called(value: Any) -> Any:
        if not isinstance(value, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)):
            value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        return cst.Call(func=cst.Attribute(value=value, attr=cst.Name(method)))

    def accumulation(small: Any) -> bool:
        return isinstance(small, cst.AugAssign) and isinstance(small.operator, (cst.AddAssign, cst.SubtractAssign)) \
            or isinstance(small, cst.Assign) and isinstance(small.value, cst.BinaryOperation) \
            and isinstance(small.value.operator, cst.Add)

    def item(small: Any) -> bool:  # history[step] = loss
        return isinstance(small, cst.Assign) and len(small.targets) == 1 \
            and isinstance(small.targets[0].target, cst.Subscript) and not accumulation(small)

    def filler(small: Any) -> bool:  # losses.append(loss)
        call = small.value if isinstance(small, cst.Expr) else None
        return isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) and bool(call.args) \
            and call.func.attr.value in _FILLERS

    small = _pick(tree, f, [s for s in stmt.body if accumulation(s) or item(s) or filler(s)],
                  "an accumulation or a container filled",
                  lambda n: n.value if isinstance(n, cst.Expr) or (isinstance(n, cst.Assign) and accumulation(n))
                  else n)
    if isinstance(small, str):
        return small
    if item(small):
        def make_item(node: Any) -> Any:
            return node.with_changes(value=called(node.value))

        return tree.edit(f, small, None, make_item)
    if filler(small):
        def make_call(node: Any) -> Any:
            args = list(node.value.args)
            args[-1] = args[-1].with_changes(value=called(args[-1].value))
            return node.with_changes(value=node.value.with_changes(args=args))

        return tree.edit(f, small, None, make_call)
    target = _one_line(tree, small.target if isinstance(small, cst.AugAssign) else small.targets[0].target)
    named = re.match(r"ST004 `?(.+?) (?:\+=|= .+? \+) .+? adds a tensor", f.message)
    if named is not None and named.group(1) != target:
        return f"the finding's accumulator `{named.group(1)}` is not the one at that line (`{target}`)"
    if isinstance(small, cst.AugAssign):
        def make(node: Any) -> Any:
            return node.with_changes(value=called(node.value))

        return tree.edit(f, small, None, make)
    import ast

    from ._graphs import addend

    try:  # the message's own choice of the value added (`safetorch._graphs.fixed`)
        parsed = ast.parse(_one_line(tree, small)).body[0]
    except (SyntaxError, IndexError):
        return "the accumulation cannot be read again"
    if not isinstance(parsed, ast.Assign) or not isinstance(parsed.value, ast.BinOp):
        return "the accumulation cannot be read again"
    chosen = addend(parsed, parsed.value)
    if chosen is parsed.value:
        return f"`{target}` is read on both sides of the `+` or on neither: fix it by hand"
    side = "right" if chosen is parsed.value.right else "left"  # ``total = total + loss``

    def make_bin(node: Any) -> Any:
        return node.with_changes(value=node.value.with_changes(**{side: called(getattr(node.value, side))}))

    return tree.edit(f, small, None, make_bin)


#: Methods that store their last argument as one item (ST004's containers).
_FILLERS = frozenset({"append", "appendleft", "insert", "add"})


def _fix_st005(tree: _Tree, f: Finding) -> list[Edit] | str:
    """``volatile=True`` meant: nothing computed from this input records a graph. Dropping it (it does nothing since
    torch 0.4) and putting the statements that use what it made under ``torch.no_grad()`` keeps that meaning; the
    run must show that no backward ran there, else nothing is written."""
    import libcst as cst

    stmt = tree.statement(f.line)
    if stmt is None:
        return "no statement at that line"

    def volatile(call: Any) -> bool:
        return any(a.keyword is not None and a.keyword.value == "volatile" for a in call.args)

    call = _pick(tree, f, [c for c in tree.nodes(stmt, cst.Call) if volatile(c)], "a call with volatile=")
    if isinstance(call, str):
        return call
    if not tree.binds_torch():
        return "the file does not `import torch`: drop volatile= and put its uses under torch.no_grad() by hand"
    region = _volatile_uses(tree, stmt)
    if isinstance(region, str):
        return region
    block, first, last = region
    statements = list(block.body)[first:last + 1]
    start, end = tree.span(statements[0])[0], tree.span(statements[-1])[1]
    why = _trains(tree, statements, start, end)
    if why:
        return f"volatile= is to become `with torch.no_grad():` around its uses, but {why}: do it by hand"

    def drop(node: Any) -> Any:
        args = [a for a in node.args if a.keyword is None or a.keyword.value != "volatile"]
        return node.with_changes(args=_commas(args, node.args))

    def wrap(node: Any, first: int = first, last: int = last) -> Any:
        body = list(node.body)
        inner = [body[first].with_changes(leading_lines=()), *body[first + 1:last + 1]]
        with_ = cst.With(items=[cst.WithItem(item=cst.parse_expression("torch.no_grad()"))],
                         body=cst.IndentedBlock(body=inner), leading_lines=body[first].leading_lines)
        return node.with_changes(body=[*body[:first], with_, *body[last + 1:]])

    lines = f"line {start}" if start == end else f"lines {start}-{end}"
    edits = [tree.edit(f, call, "volatile= dropped", drop),
             tree.edit(f, block, f"its uses ({lines}) under `with torch.no_grad():`", wrap)]
    edits[1].wraps = (start, end)
    return edits


def _volatile_uses(tree: _Tree, stmt: Any) -> tuple[Any, int, int] | str:
    """(the block, the first and the last index) of the statements from ``stmt`` to the last one of its block that
    reads a name assigned from the volatile input (the names assigned from those, and so on)."""
    import libcst as cst

    block = tree.parents.get(stmt)
    body = list(getattr(block, "body", ()))
    if stmt not in body or not isinstance(block, (cst.IndentedBlock, cst.Module)):
        return "the volatile input is not made in a statement of its own block"
    first = last = body.index(stmt)
    names = _assigned(tree, stmt)
    if not names:
        return "the volatile input is not assigned to a name: its uses cannot be told"
    for i in range(first + 1, len(body)):
        used = {n.value for n in tree.nodes(body[i], cst.Name)}
        if used & names:
            last = i
            names |= _assigned(tree, body[i])
    return block, first, last


def _assigned(tree: _Tree, stmt: Any) -> set[str]:
    import libcst as cst

    out: set[str] = set()
    for node in tree.nodes(stmt, (cst.AssignTarget, cst.AugAssign, cst.AnnAssign, cst.For, cst.WithItem)):
        target = node.asname.name if isinstance(node, cst.WithItem) and node.asname else getattr(node, "target", None)
        if target is not None:
            out |= {n.value for n in tree.nodes(target, cst.Name)}
    return out


def _trains(tree: _Tree, statements: Sequence[Any], start: int, end: int) -> str | None:
    """Why lines ``start``-``end`` (the ``statements``) cannot go under ``no_grad`` from what the run saw, or None:
    a backward ran while they ran, one of them never ran and reads as training, or they return or yield a value
    (its users may train through it). Without the run's record (a report) nothing is proven."""
    import libcst as cst

    facts = tree.facts
    if facts is None:
        return "without a run (a report) what these lines do is not known"
    if not facts.file_ran(tree.path):
        return "the run recorded no line of this file"
    if facts.backward_within(tree.path, start, end):
        return f"a backward ran from lines {start}-{end}"
    for stmt in statements:
        if tree.nodes(stmt, (cst.Return, cst.Yield)):
            return "they return or yield a value, which its users may train through"
    for line in range(start, end + 1):
        text = tree.lines[line - 1] if line <= len(tree.lines) else ""
        if not facts.ran(tree.path, line) and _TRAINING_CALLS.search(text):
            return f"line {line} never ran and reads as training"
    return None


_FUNCTIONAL = frozenset({"F", "torch", "nn", "functional", "torch.nn.functional", "nn.functional", "torch.special"})


def _softmax_input(tree: _Tree, call: Any) -> tuple[Any, bool] | None:
    """(X, method form) for ``F.softmax(X, ...)``, ``torch.sigmoid(X)``, ``softmax(X)``, ``X.softmax(dim)``, and a
    softmax module called on X (``self.softmax(X)``); None for another call."""
    import libcst as cst

    if _call_name(call) not in ("softmax", "sigmoid"):
        return None
    func = call.func
    positional = [a for a in call.args if a.keyword is None and a.star == ""]
    if isinstance(func, cst.Attribute) and tree.code(func.value) not in _FUNCTIONAL \
            and all(isinstance(a.value, cst.Integer) or isinstance(a.value, cst.UnaryOperation) for a in positional):
        return func.value, True  # the tensor method: x.softmax(1), x.softmax(dim=-1), x.sigmoid()
    return (positional[0].value, False) if positional else None


def _fix_st009(tree: _Tree, f: Finding) -> Edit | str:
    import libcst as cst

    if "a log_softmax over dim=" in f.message:
        return "the log_softmax's dim is to be changed by hand"
    nll = f.message.startswith("ST009 nll_loss()")
    stmt = tree.statement(f.line)
    if stmt is None:
        return "no statement at that line"
    calls = tree.nodes(stmt, cst.Call)
    exact = [c for c in calls if tree.spans(c, f)]
    for call in exact or calls:
        for arg in call.args:
            if not isinstance(arg.value, cst.Call):
                continue
            found = _softmax_input(tree, arg.value)
            if found is None:
                continue
            inner, method = found
            if nll:
                if _call_name(arg.value) != "softmax":
                    continue

                def make_log(node: Any) -> Any:
                    return node.with_changes(func=node.func.with_changes(attr=cst.Name("log_softmax"))
                                             if isinstance(node.func, cst.Attribute) else cst.Name("log_softmax"))

                return tree.edit(f, arg.value, "softmax -> log_softmax", make_log)
            text = tree.code(inner)

            def make(node: Any, text: str = text) -> Any:
                return cst.parse_expression(text)

            return tree.edit(f, arg.value, f"the loss gets `{text}`", make)
    return _through_variable(tree, stmt, f, nll)


def _through_variable(tree: _Tree, stmt: Any, f: Finding, nll: bool) -> Edit | str:
    """``probs = F.softmax(logits, dim=1)`` a few statements above ``loss = F.cross_entropy(probs, y)``, in the same
    block, with neither name assigned in between: the loss gets ``logits``."""
    import libcst as cst

    given = re.search(r"got `?([A-Za-z_][\w.]*)`?, the output", f.message)
    if given is None or nll:
        return "the probabilities reach the loss through an expression: pass the logits there by hand"
    name = given.group(1)
    block = tree.parents.get(stmt)
    body = list(getattr(block, "body", ()))
    if stmt not in body:
        return f"the probabilities reach the loss through `{name}`: pass the logits there by hand"
    assigned: set[str] = set()
    for previous in reversed(body[: body.index(stmt)]):
        if not isinstance(previous, cst.SimpleStatementLine):
            break
        for small in previous.body:
            targets = [tree.code(t.target) for t in small.targets] if isinstance(small, cst.Assign) else \
                [tree.code(small.target)] if isinstance(small, (cst.AugAssign, cst.AnnAssign)) else []
            if name in targets and len(targets) == 1 and isinstance(small, cst.Assign) \
                    and isinstance(small.value, cst.Call):
                found = _softmax_input(tree, small.value)
                if found is None or not _simple_chain(found[0]) or tree.code(found[0]) in assigned:
                    return f"`{name}` is not the softmax of a variable the loss could take: pass the logits by hand"
                logits = tree.code(found[0])
                uses = [n for n in tree.nodes(stmt, cst.Name) if n.value == name]
                if len(uses) != 1:
                    return f"`{name}` is used more than once at that line: pass the logits by hand"

                def make(node: Any, logits: str = logits) -> Any:
                    return cst.parse_expression(logits)

                return tree.edit(f, uses[0], f"the loss gets `{logits}` in place of `{name}`", make)
            if name in targets:
                return f"`{name}` is not assigned a softmax just above: pass the logits by hand"
            assigned.update(targets)
    return f"no `{name} = softmax(...)` just above in the same block: pass the logits by hand"


def _fix_st013(tree: _Tree, f: Finding) -> Edit | str:
    import libcst as cst

    stmt = tree.statement(f.line)
    if stmt is None:
        return "no statement at that line"
    function = next((a for a in tree.ancestors(stmt) if isinstance(a, cst.FunctionDef)), None)
    if function is None or not function.params.params:
        return "not in a method: pass training= by hand"
    owner = function.params.params[0].name.value
    def dropout(call: Any) -> bool:
        functional = isinstance(call.func, cst.Name) or (isinstance(call.func, cst.Attribute)
                                                          and tree.code(call.func.value) in _FUNCTIONAL)
        return functional and _call_name(call) in _DROPOUTS and not any(
            a.keyword is not None and a.keyword.value == "training" for a in call.args) \
            and len([a for a in call.args if a.keyword is None]) < 3

    call = _pick(tree, f, [c for c in tree.nodes(stmt, cst.Call) if dropout(c)], "an F.dropout without training=")
    if isinstance(call, str):
        return call

    def make(node: Any, owner: str = owner) -> Any:
        arg = cst.Arg(value=cst.parse_expression(f"{owner}.training"), keyword=cst.Name("training"),
                      equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                            whitespace_after=cst.SimpleWhitespace("")))
        return node.with_changes(args=_commas([*node.args, arg], node.args))

    return tree.edit(f, call, f"training={owner}.training", make)


def _fix_st014(tree: _Tree, f: Finding) -> Edit | str:
    import libcst as cst

    match = re.search(r"The checkpoint's keys start with ('(?:[^'\\]|\\.)*'|\"[^\"]*\")", f.message)
    if match is None:
        return "the finding names no prefix to strip"
    prefix = match.group(1)
    stmt = tree.statement(f.line)
    if stmt is None:
        return "no statement at that line"
    call = _pick(tree, f, [c for c in tree.nodes(stmt, cst.Call) if _call_name(c) == "load_state_dict"],
                 "a load_state_dict() call")
    if isinstance(call, str):
        return call
    positional = [a for a in call.args if a.keyword is None and a.star == ""]
    if not positional:
        return "the state dict is not given by position"
    arg = positional[0]
    text = tree.code(arg.value)
    if not isinstance(arg.value, (cst.Name, cst.Attribute, cst.Subscript, cst.Call)):
        text = f"({text})"

    def make(node: Any, text: str = text) -> Any:
        return node.with_changes(value=cst.parse_expression(
            f"{{k.removeprefix({prefix}): v for k, v in {text}.items()}}"))

    return tree.edit(f, arg, f"keys without {prefix}", make)


def _fix_st015(tree: _Tree, f: Finding) -> list[Edit] | str:
    import libcst as cst

    edits: list[Edit] = []
    reasons: list[str] = []
    for segment in f.message.split("; and "):
        module = "an attribute of the module" in segment
        if " sets an attribute " in segment:  # reported at the assignment itself
            places = [f"{f.path}:{f.line}"]
        else:  # an assignment made before the check was installed: at the optimizer's line, no place known
            reasons.append("the finding names no line that set the attribute")
            continue
        for place in places:
            filename, _, line = place.rpartition(":")
            if not line.isdigit() or os.path.normpath(os.path.abspath(filename)) != tree.path and \
                    os.path.basename(filename) != os.path.basename(tree.path):
                reasons.append(f"the assignment is in another file ({place})")
                continue
            stmt = tree.statement(int(line))
            small = next((s for s in (stmt.body if stmt is not None else ()) if isinstance(s, cst.Assign)
                          and len(s.targets) == 1 and isinstance(s.targets[0].target, cst.Attribute)), None)
            if small is None:
                reasons.append(f"no attribute assignment at line {line}")
                continue
            target = small.targets[0].target
            if module:
                receiver = tree.code(target.value)

                def make(node: Any, receiver: str = receiver) -> Any:
                    return cst.Expr(value=cst.Call(func=cst.parse_expression(f"{receiver}.requires_grad_"),
                                                   args=[cst.Arg(value=node.value)]), semicolon=node.semicolon)

                edits.append(tree.edit(f, small, None, make))
            else:

                def rename(node: Any) -> Any:
                    t = node.targets[0]
                    return node.with_changes(targets=[t.with_changes(target=t.target.with_changes(
                        attr=cst.Name("requires_grad")))])

                edits.append(tree.edit(f, small, None, rename))
    if edits:
        return edits
    return "; ".join(reasons) or "nothing to fix"


_FIXERS: dict[str, Callable[[_Tree, Finding], Any]] = {
    "ST001": _fix_st001, "ST002": _fix_st002, "ST003": _fix_st003, "ST004": _fix_st004, "ST005": _fix_st005,
    "ST009": _fix_st009, "ST013": _fix_st013, "ST014": _fix_st014, "ST015": _fix_st015,
}


# --- running the program -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    status: int  # the program's own exit status (findings do not change it: the runner is given --exit-zero)
    findings: list[Finding]
    output: str  # what the program and the runner printed
    facts: _fixtrace.Facts | None = None  # what ran, and where backwards were called from
    started: float | None = None  # when (seconds since the epoch)


def run(script: str, args: Sequence[str], cwd: str | None = None, timeout: float | None = None) -> Run:
    """Run ``script`` under the runner, as ``python -m safetorch --exit-zero --report … script args`` would, and read
    what it found from the report."""
    env = {k: v for k, v in os.environ.items() if k not in ("SAFETORCH_STRICT", "SAFETORCH_DISABLE", "SAFETORCH_REPORT",
                                                             "SAFETORCH_FORMAT", "SAFETORCH_RUNNER")}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="safetorch-fix-") as tmp:
        report = os.path.join(tmp, "findings.json")
        env[_fixtrace.ENV] = os.path.join(tmp, "ran.json")
        cmd = [sys.executable, "-m", "safetorch", "--exit-zero", "--report", report, "--", script, *args]
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        entries: list[dict[str, Any]] = []
        if os.path.exists(report):
            with open(report, encoding="utf-8") as fh:
                entries = json.load(fh)
        facts = _fixtrace.read(env[_fixtrace.ENV])
    return Run(proc.returncode, findings_from(entries, cwd), proc.stdout + proc.stderr, facts, started)


# --- verification: the patched program, run again -----------------------------------------------------------------


def _copy_root(script: str) -> str:
    return os.path.dirname(os.path.abspath(script))


_IGNORED = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".venv", "venv", "node_modules", ".mypy_cache",
                                  ".ruff_cache", ".pytest_cache")


def _line_map(old: str, new: str) -> dict[int, int]:
    """new line -> old line, for the lines a patch left as they were."""
    mapping: dict[int, int] = {}
    matcher = difflib.SequenceMatcher(None, old.splitlines(), new.splitlines(), autojunk=False)
    for tag, i1, i2, j1, _ in matcher.get_opcodes():
        if tag == "equal":
            for k in range(i2 - i1):
                mapping[j1 + k + 1] = i1 + k + 1
    return mapping


def _still_found(edit: Edit, found: list[Finding], maps: dict[str, dict[int, int]]) -> bool:
    """Whether the run of the patched copy still finds what ``edit`` fixed: the same rule at the finding's line
    (mapped back), or inside the lines the fix rewrote."""
    for f in found:
        if f.code != edit.finding.code or f.path != edit.path:
            continue
        old = maps.get(f.path, {}).get(f.line)
        if old is None or old == edit.finding.line or edit.line <= old <= edit.end:
            return True
    return False


def verify(p: Plan, edits: Sequence[Edit], script: str, args: Sequence[str], cwd: str,
           timeout: float | None = None) -> tuple[list[Edit], list[Finding] | None, _fixtrace.Facts | None]:
    """The edits that, applied together to a copy of the script's directory, leave a run that succeeds and no
    longer finds what they fixed (when that run fails, each edit is tried alone first), and what the run of the kept
    edits found (its lines are the patched files', its paths the originals'; None when nothing ran), and what ran
    in it (the same)."""
    root = os.path.realpath(_copy_root(script))
    inside = [e for e in edits if os.path.commonpath([root, os.path.realpath(e.path)]) == root]

    def attempt(chosen: Sequence[Edit]) -> tuple[list[Edit], list[Finding] | None, _fixtrace.Facts | None]:
        if not chosen:
            return [], None, None
        patched = p.patched(chosen)
        with tempfile.TemporaryDirectory(prefix="safetorch-verify-") as tmp:
            copy = os.path.join(os.path.realpath(tmp), os.path.basename(root) or "program")
            shutil.copytree(root, copy, ignore=_IGNORED, symlinks=True)
            for path, text in patched.items():
                encoding = p.files[path].encoding if path in p.files else "utf-8"
                with open(os.path.join(copy, os.path.relpath(os.path.realpath(path), root)), "wb") as fh:
                    fh.write(text.encode(encoding))
            rel_cwd = os.path.relpath(os.path.realpath(cwd), root)
            there = os.path.join(copy, rel_cwd) if not rel_cwd.startswith("..") else cwd
            result = run(os.path.join(copy, os.path.relpath(os.path.realpath(script), root)), args, there, timeout)
        if result.status != 0:
            return [], None, None
        back = {os.path.realpath(path): path for path in p.sources}

        def original(path: str) -> str:
            real = os.path.realpath(path)
            if real.startswith(copy + os.sep):
                real = os.path.join(root, os.path.relpath(real, copy))
            return back.get(real, real)

        found = [dataclasses.replace(f, path=original(f.path), seen=None) for f in result.findings]
        maps = {path: _line_map(p.sources[path], text) for path, text in patched.items()}
        facts = None
        if result.facts is not None:
            facts = _fixtrace.Facts({original(k): v for k, v in result.facts.lines.items()},
                                    [tuple((original(f), n) for f, n in s) for s in result.facts.backwards])
        return [e for e in chosen if not _still_found(e, found, maps)], found, facts

    kept, found, facts = attempt(inside)
    if len(kept) == len(inside):
        return kept, found, facts
    alone = [e for e in inside if attempt([e])[0] == [e]]
    together, found, facts = attempt(alone)
    return (together, found, facts) if len(together) == len(alone) else ([], None, None)





# --- the command ---------------------------------------------------------------------------------------------------


_USAGE = """\
%(prog)s [--write [--no-verify]] [--check] [--verify] [--] script.py [args ...]
       %(prog)s [--check] --from REPORT.json [--write [--no-verify | -- script.py [args ...]]]"""


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{prog} fix", usage=_USAGE, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a program (or read a JSON report) and print a unified diff of the fixes for what it found: "
                    "the rules with a mechanical fix, where the run makes it certain.",
        epilog="rules it fixes:\n" + "\n".join(f"  {code}  {what}" for code, what in FIXABLE.items())
        + "\n\nexit status: 0; with --check, 1 when there is something to fix; 2 for a usage error; 1 when --write "
          "could not write (then no file was changed).")
    parser.add_argument("--write", action="store_true",
                        help="apply the fixes to the files (formatting kept), all or none; verified first")
    parser.add_argument("--check", action="store_true", help="exit 1 when there is something to fix (pre-commit, CI)")
    parser.add_argument("--verify", action="store_true", default=None,
                        help="apply the patch to a copy of the script's directory and run it again: keep the fixes "
                             "whose findings are gone from a run that still succeeds (the default with --write)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="with --write: write the fixes without running the patched program first")
    parser.add_argument("--from", dest="report", metavar="REPORT.json",
                        help="read the findings of an earlier run (python -m safetorch --report REPORT.json ...)")
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="script.py [args ...]")
    return parser


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: Sequence[str], prog: str = "python -m safetorch") -> int:
    ns = _parser(prog).parse_args(list(argv))
    program = ns.program[1:] if ns.program[:1] == ["--"] else ns.program
    verify_ = ns.verify if ns.verify is not None else ns.write
    try:
        import libcst  # noqa: F401
    except ImportError:
        _say(f"{prog} fix: {INSTALL_HINT}")
        return 2
    cwd = os.getcwd()
    facts: _fixtrace.Facts | None = None
    since: float | None = None
    if ns.report is not None:
        if program and not verify_:
            _say(f"{prog} fix: error: --from reads a report; a script is only for verifying (--verify, --write)")
            return 2
        if verify_ and not program:
            _say(f"{prog} fix: error: --write verifies the fixes by running the program again: give it after the "
                 f"report (--from {ns.report} --write -- script.py [args]), or write unverified with --no-verify")
            return 2
        try:
            with open(ns.report, encoding="utf-8") as fh:
                entries = json.load(fh)
        except (OSError, ValueError) as exc:
            _say(f"{prog} fix: error: the report {ns.report!r} cannot be read ({exc})")
            return 2
        if not isinstance(entries, list):
            _say(f"{prog} fix: error: {ns.report!r} is not a JSON report of safetorch (a list of findings)")
            return 2
        found = findings_from(entries, os.path.dirname(os.path.abspath(ns.report)))
    else:
        if not program:
            _say(f"{prog} fix: error: no script to run (see --help)")
            return 2
        if not os.path.exists(program[0]):
            _say(f"{prog} fix: error: can't open file {program[0]!r}: no such file")
            return 2
        _say(f"safetorch fix: running {' '.join(program)}")
        result = run(program[0], program[1:], cwd)
        if result.status != 0:
            _say(result.output.rstrip())
            _say(f"safetorch fix: the program failed (exit status {result.status}); the fixes are for what it found "
                 f"before")
        found, facts, since = result.findings, result.facts, result.started
    fixed: list[Edit] = []
    skips: dict[tuple[Finding, str], Skip] = {}
    diffs: list[str] = []
    status = 0
    for _ in range(_ROUNDS):
        p = plan(found, facts, since)
        edits, after, after_facts = p.edits, None, None
        if verify_ and edits:
            kept, after, after_facts = verify(p, edits, program[0], program[1:], cwd)
            for e in edits:
                if e not in kept:
                    p.skips.append(Skip(e.finding, f"not verified: {e.what} (the run of the patched copy still found "
                                                   f"it, or failed)"))
            edits = kept
        for s in p.skips:
            skips.setdefault((s.finding, s.why), s)
        if ns.write:
            changes = {path: (p.files[path], text) for path, text in p.patched(edits).items()
                       if text != p.sources[path]}
            try:
                _fixio.write_all(changes)
            except _fixio.WriteError as exc:
                _say(f"safetorch fix: nothing was written: {_shown(exc.path, cwd)}: {exc.why}")
                for path in changes:
                    _say(f"unchanged: {_shown(path, cwd)}")
                for e in edits:
                    _say(f"not written: {_where(e.path, e.finding.line, cwd)}: {e.finding.code} {e.what}")
                status = 1
                break
            for path in changes:
                _say(f"changed: {_shown(path, cwd)}")
        fixed.extend(edits)
        diffs.append(p.diff(edits))
        # --write --verify: what the patched program found (past a crash the old lines hid) is the next round's work.
        if not (ns.write and edits and after is not None):
            break
        found, facts, since = after, after_facts, None
    if not ns.write and any(diffs):
        sys.stdout.write("".join(diffs))
        sys.stdout.flush()
    _summary(fixed, skips, found, facts, ns.write, verify_, cwd, quiet=bool(status))
    if status:
        return status
    return 1 if ns.check and fixed and not ns.write else 0


def _summary(fixed: list[Edit], skips: dict[tuple[Finding, str], Skip], found: list[Finding],
             facts: _fixtrace.Facts | None, written: bool, verified: bool, cwd: str, quiet: bool = False) -> None:
    """What was fixed, what was not and why: skipped fixes, the findings no fix exists for, and what the run never
    reached (the fixable patterns on lines of its files that never ran)."""
    for e in fixed:
        _say(f"{'fixed' if written else 'fix'}: {_where(e.path, e.finding.line, cwd)}: {e.finding.code} {e.what}"
             + (" (verified)" if verified else ""))
    for s in skips.values():
        if not any(e.finding == s.finding for e in fixed):
            _say(f"skipped: {_where(s.finding.path, s.finding.line, cwd)}: {s.finding.code} {s.why}")
    for f in found:
        if not fixable(f.code):
            _say(f"not fixed: {_where(f.path, f.line, cwd)}: {f.code} has no mechanical fix "
                 f"(safetorch explain {f.code})")
    for path, line, code, text in _never_ran(facts):
        _say(f"not fixed: never ran: {_where(path, line, cwd)}: {code}? `{text}` (the run never reached this line: "
             f"run what reaches it to know)")
    if not fixed and not quiet:
        _say("safetorch fix: nothing to fix")


def _never_ran(facts: _fixtrace.Facts | None) -> list[tuple[str, int, str, str]]:
    """(file, line, rule, the statement) for each pattern a fix exists for that no run can miss (``volatile=``,
    ``size_average=``/``reduce=``, an assignment to ``.require_grad``) on a statement of the program's files that
    never ran: the run could not find it there, so nothing was fixed."""
    import libcst as cst

    out: list[tuple[str, int, str, str]] = []
    if facts is None:
        return out
    for path in sorted(facts.lines):
        if _installed(path) or not path.endswith(".py"):
            continue
        try:
            tree = _Tree(path, _fixio.read(path).text)
        except Exception:  # noqa: S112  (a file that cannot be read or parsed: nothing to say of it)
            continue
        for stmt in tree.nodes(tree.module, cst.SimpleStatementLine):
            start, end = tree.span(stmt)
            if any(facts.ran(path, n) for n in range(start, end + 1)):
                continue
            code = _pattern(tree, stmt)
            if code:
                out.append((path, start, code, " ".join(tree.code(stmt.with_changes(leading_lines=())).split())))
    return out


def _pattern(tree: _Tree, stmt: Any) -> str | None:
    import libcst as cst

    for call in tree.nodes(stmt, cst.Call):
        words = {a.keyword.value for a in call.args if a.keyword is not None}
        if "volatile" in words:
            return "ST005"
        if words & set(_LEGACY):
            return "ST002"
    for target in tree.nodes(stmt, cst.AssignTarget):
        if isinstance(target.target, cst.Attribute) and target.target.attr.value == "require_grad":
            return "ST015"
    return None


def _shown(path: str, cwd: str) -> str:
    rel = os.path.relpath(path, cwd)
    return path if rel.startswith("..") else rel


_ROUNDS = 4  # --write --verify: rounds of fixing what the fixed program found


def _where(path: str, line: int, cwd: str) -> str:
    rel = os.path.relpath(path, cwd)
    return f"{path if rel.startswith('..') else rel}:{line}"
