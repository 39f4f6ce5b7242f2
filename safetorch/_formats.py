"""The report as a document: JSON (safetorch's own), SARIF 2.1.0 (code-scanning tools, editors) and GitHub workflow
commands (annotations on a pull request's lines).

Each renders the same entries: one per call site of the whole run (every process merged), as `entries` returns them.
Nothing here runs before the program's exit.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import urllib.parse
from typing import Any

__all__ = ["entries", "github", "render", "sarif"]

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def _rules() -> dict[str, Any]:
    from ._rules import RULES

    return RULES


def _iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(timespec="seconds")


def entries(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each site as the JSON report has it: ``rule`` and ``name``; ``path`` as the program named its file,
    ``abspath``; ``line``; ``count`` over every process (``sampled``: a count of the steps looked at, not of every
    step); ``pid``/``pids``, ``rank``/``ranks`` and ``hosts`` of the processes that found it; ``first_seen`` (ISO
    8601, UTC); ``message``. ``code`` and ``file`` repeat ``rule`` and ``path`` (the names of the report's first
    version). ``col``, ``end_line`` and ``end_col`` place the expression the finding is about as Python's ``ast``
    does (columns from 0, in UTF-8 bytes), and ``source`` is its text (what ``safetorch fix`` rewrites): all null
    when unknown (before Python 3.11, or a finding made after its line ran)."""
    rules = _rules()
    out = []
    for e in raw:
        code, path = e["code"], e["file"]
        pids = sorted(p for p in e.get("pids", []) if p is not None)
        ranks = sorted(r for r in e.get("ranks", []) if r is not None)
        rule = rules.get(code)
        out.append({
            "rule": code, "name": rule.name if rule is not None else None,
            "path": path, "abspath": os.path.abspath(path) if not path.startswith("<") else path,
            "line": e["line"], "count": e["count"], "sampled": bool(rule is not None and rule.sampled),
            "pid": pids[0] if pids else None, "pids": pids,
            "rank": ranks[0] if ranks else None, "ranks": ranks, "hosts": sorted(e.get("hosts") or ()),
            "first_seen": _iso(e.get("first_seen")),
            "message": e["message"],
            "code": code, "file": path,
            **_span(e),
        })
    return out


def _span(e: dict[str, Any]) -> dict[str, Any]:
    span, source = e.get("span"), e.get("source")
    if not (isinstance(span, (list, tuple)) and len(span) == 4 and all(type(n) is int for n in span)
            and span[0] == e["line"]):
        return {"col": None, "end_line": None, "end_col": None, "source": None}
    return {"col": span[1], "end_line": span[2], "end_col": span[3],
            "source": source if isinstance(source, str) else None}


def _base() -> str:
    """What relative paths are relative to: the checkout in GitHub Actions (``GITHUB_WORKSPACE``, whatever the step's
    working directory), else the directory the program started in."""
    from ._config import START_DIR

    return os.environ.get("GITHUB_WORKSPACE") or START_DIR


def _relative(path: str) -> str:
    """A path as a repository's tools name it: relative to `_base` when inside it, else absolute."""
    if path.startswith("<"):
        return path
    absolute = os.path.join(_base(), path) if not os.path.isabs(path) else path
    try:
        rel = os.path.relpath(absolute, _base())
    except ValueError:  # another drive (Windows)
        return absolute
    return absolute if rel.startswith("..") else rel


def sarif(items: list[dict[str, Any]], version: str) -> dict[str, Any]:
    """A SARIF 2.1.0 log of one run: every rule in the driver, one result per site (its count in ``properties``)."""
    rules = list(_rules().values())
    index = {r.code: i for i, r in enumerate(rules)}
    results = []
    for e in items:
        where = _relative(e["path"])
        artifact: dict[str, Any]
        if os.path.isabs(where):
            artifact = {"uri": pathlib.Path(where).as_uri()}
        else:
            artifact = {"uri": urllib.parse.quote(where.replace(os.sep, "/")), "uriBaseId": "%SRCROOT%"}
        locations = [] if where.startswith("<") else [  # code with no file (`python -c`, exec) has no location
            {"physicalLocation": {"artifactLocation": artifact, "region": {"startLine": max(1, int(e["line"]))}}}]
        result: dict[str, Any] = {"ruleId": e["rule"], "level": "warning", "message": {"text": e["message"]},
                                  "locations": locations,
                                  "properties": {"count": e["count"], "sampled": e["sampled"], "pids": e["pids"],
                                                 "ranks": e["ranks"]}}
        if e["rule"] in index:
            result["ruleIndex"] = index[e["rule"]]
        results.append(result)
    driver = {
        "name": "safetorch", "version": version,
        "rules": [{"id": r.code, "name": r.name, "shortDescription": {"text": r.summary},
                   "help": {"text": f"docs/rules/{r.code}.md, or run: safetorch explain {r.code}"},
                   "defaultConfiguration": {"level": "warning"}} for r in rules],
    }
    run: dict[str, Any] = {"tool": {"driver": driver}, "results": results}
    run["originalUriBaseIds"] = {"%SRCROOT%": {"uri": pathlib.Path(_base()).as_uri() + "/"}}
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github(items: list[dict[str, Any]]) -> str:
    """One ``::warning file=…,line=…,title=…::message`` workflow command per site: GitHub Actions shows each as an
    annotation on that line of the pull request."""
    lines = []
    for e in items:
        title = f"{e['rule']} {e['name'] or ''}".strip()
        rule = _rules().get(e["rule"])
        if rule is not None and rule.sampled:
            title += f" (seen at {e['count']} sampled step{'s' if e['count'] != 1 else ''})"
        elif e["count"] > 1:
            title += f" (x{e['count']})"
        lines.append(f"::warning file={_escape_property(_relative(e['path']))},line={e['line']},"
                     f"title={_escape_property(title)}::{_escape_data(e['message'])}")
    return "\n".join(lines)


def render(fmt: str, raw: list[dict[str, Any]], version: str) -> str:
    """The report in ``fmt`` (json, sarif or github) as text."""
    items = entries(raw)
    if fmt == "sarif":
        return json.dumps(sarif(items, version), indent=2)
    if fmt == "github":
        return github(items)
    return json.dumps(items, indent=2)
