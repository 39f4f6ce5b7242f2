"""A run is all its processes: every process's findings go into one report.

Design rules:
- Every process of a run writes into one *run directory*: the first process to install safetorch makes it and puts
  its path in the environment (``SAFETORCH_RUN_DIR``), which every child inherits — forked, spawned or forkserver
  workers, ``mp.spawn``, DataLoader workers, ``subprocess`` running Python. Under torchrun the ranks are siblings,
  not children: their directory is named after the job (``TORCHELASTIC_RUN_ID`` and the rendezvous address), so
  that they share it too.
- A process appends one JSON line to its own part (``<pid>.jsonl``) for each call site when it first reports there,
  flushed at once: a child ended by ``os._exit`` (multiprocessing's way), a crash or a SIGKILL loses only what it had
  not written. At a normal exit it appends each site's final count.
- The process that owns the run (the first one: the parent, or each rank under torchrun, whose exit order nobody
  knows) merges every part into the JSON report the user named, under a lock, written to a temporary file and
  renamed, so that the last merge holds everything written before it; the owner's exit summary says what came from
  other processes. A child prints its warning only when no other process of the run has reported that site already,
  and prints no exit summary of its own.
- Nothing here is on a hot path: a part line is written once per call site.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

ENV = "SAFETORCH_RUN_DIR"

_lock = threading.Lock()
_state: dict[str, Any] = {"dir": None, "owner": True, "pid": None, "part": None}


def _torchrun_dir() -> str | None:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None or "RANK" not in os.environ:
        return None
    # The agent that started the ranks (their parent) tells this job from an earlier one with the same run id.
    key = "|".join((run_id, os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""),
                    os.environ.get("GROUP_RANK", ""), str(os.getppid())))
    name = "safetorch-run-" + hashlib.sha1(key.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), name)


def start() -> None:
    """At install: join the run of the environment, or start one (then this process owns it)."""
    with _lock:
        if _state["dir"] is not None and _state["pid"] == os.getpid():
            return
        inherited = os.environ.get(ENV)
        torchrun = _torchrun_dir()
        try:
            if inherited:
                path, owner = inherited, False
            elif torchrun is not None:
                path, owner = torchrun, True
                os.makedirs(path, exist_ok=True)
            else:
                path, owner = tempfile.mkdtemp(prefix="safetorch-run-"), True
            os.environ[ENV] = path
        except OSError:
            return  # no run directory: each process reports alone, as before
        _state.update(dir=path, owner=owner, pid=os.getpid(), part=None, torchrun=torchrun is not None)


def _after_fork_in_child() -> None:
    """A forked child keeps the parent's patches and reports into the same run, as a process of its own."""
    _state.update(owner=False, pid=os.getpid(), part=None, claimed=[])


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def directory() -> str | None:
    return _state["dir"]


def owner() -> bool:
    return bool(_state["owner"])


def torchrun() -> bool:
    return bool(_state.get("torchrun"))


def _part() -> Any:
    part = _state["part"]
    if part is None and _state["dir"] is not None:
        part = _state["part"] = open(os.path.join(_state["dir"], f"{os.getpid()}.jsonl"), "a", encoding="utf-8")
    return part


def _rank() -> int | None:
    try:
        return int(os.environ["RANK"]) if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 else None
    except (KeyError, ValueError):
        return None


def record(code: str, filename: str, lineno: int, message: str, count: int, first_seen: float | None = None,
           span: tuple[int, int, int, int] | None = None, source: str | None = None) -> None:
    """Append one site of this process to its part, flushed: a first occurrence, or a final count."""
    try:
        with _lock:
            part = _part()
            if part is None:
                return
            part.write(json.dumps({"code": code, "file": filename, "line": lineno, "message": message,
                                   "count": count, "pid": os.getpid(), "rank": _rank(),
                                   "first_seen": first_seen, "span": span, "source": source}) + "\n")
            part.flush()
    except (OSError, ValueError, TypeError):
        pass


def forget() -> None:
    """This process's part starts again (``safetorch._report.reset``: a program that wants to see findings again)."""
    with _lock:
        part = _part()
        if part is not None:
            with contextlib.suppress(OSError):
                part.seek(0)
                part.truncate()
        for name in _state.pop("claimed", []):  # the warnings this process showed may be shown again
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(_state["dir"], name))


def _lines() -> Iterator[dict[str, Any]]:
    path = _state["dir"]
    if path is None:
        return
    try:
        names = sorted(n for n in os.listdir(path) if n.endswith(".jsonl"))
    except OSError:
        return
    for name in names:
        try:
            with open(os.path.join(path, name), encoding="utf-8") as fh:
                for line in fh:
                    try:
                        yield json.loads(line)
                    except ValueError:  # a line cut short by a kill
                        continue
        except OSError:
            continue


def claim(code: str, filename: str, lineno: int) -> bool:
    """Whether this process is the first of the run to show this site's warning: it creates the site's marker file
    (an exclusive create, atomic between processes). True without a run directory."""
    path = _state["dir"]
    if path is None:
        return True
    name = hashlib.sha1(f"{code}|{filename}|{lineno}".encode()).hexdigest()[:24] + ".shown"
    try:
        os.close(os.open(os.path.join(path, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        _state.setdefault("claimed", []).append(name)
        return True
    except FileExistsError:
        return False
    except OSError:
        return True  # the directory is gone: show it


def reported_elsewhere(code: str, filename: str, lineno: int) -> bool:
    """Whether another process of the run has reported this site (a child then leaves the warning to it)."""
    me = os.getpid()
    return any(e.get("pid") != me and e.get("code") == code and e.get("file") == filename and e.get("line") == lineno
               for e in _lines())


def merged() -> list[dict[str, Any]]:
    """Every site of every process of the run: one entry per (code, file, line), with its total count and the
    processes (pid, and rank under torchrun) that reported it."""
    sites: dict[tuple[str, str, int], dict[str, Any]] = {}
    counts: dict[tuple[str, str, int], dict[int, int]] = {}
    for e in _lines():
        key = (e.get("code"), e.get("file"), e.get("line"))
        entry = sites.setdefault(key, {"code": key[0], "file": key[1], "line": key[2], "count": 0,
                                       "message": e.get("message", ""), "pids": [], "ranks": []})
        pid = e.get("pid")
        per = counts.setdefault(key, {})
        per[pid] = max(per.get(pid, 0), int(e.get("count", 1)))
        if pid not in entry["pids"]:
            entry["pids"].append(pid)
        rank = e.get("rank")
        if rank is not None and rank not in entry["ranks"]:
            entry["ranks"].append(rank)
        seen = e.get("first_seen")
        if isinstance(seen, (int, float)) and (entry.get("first_seen") is None or seen < entry["first_seen"]):
            entry["first_seen"] = seen
        if entry.get("span") is None and e.get("span") is not None:
            entry["span"], entry["source"] = e.get("span"), e.get("source")
    for key, entry in sites.items():
        entry["count"] = sum(counts[key].values())
        entry["pids"].sort()
        entry["ranks"].sort()
        if not entry["ranks"]:
            del entry["ranks"]
    return list(sites.values())


@contextlib.contextmanager
def _exclusive() -> Iterator[None]:
    path = _state["dir"]
    try:
        import fcntl
    except ImportError:  # Windows: no lock, the rename still makes each write whole
        yield
        return
    with open(os.path.join(path, ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_report(path: str, render: Callable[[list[dict[str, Any]]], str]) -> None:
    """Merge every part into ``path``, rendered by ``render``, atomically (a temporary file, then a rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    with _exclusive():
        text = render(merged())
        fd, tmp = tempfile.mkstemp(prefix=".safetorch-", suffix=".json", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def finish() -> None:
    """At exit: close the part; the owner of a run that is not torchrun's removes its directory."""
    with _lock:
        part, _state["part"] = _state["part"], None
        if part is not None:
            with contextlib.suppress(OSError):
                part.close()
    if _state["owner"] and not _state.get("torchrun") and _state["dir"] and _state["pid"] == os.getpid():
        import shutil

        shutil.rmtree(_state["dir"], ignore_errors=True)
