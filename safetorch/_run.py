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

import atexit
import contextlib
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

ENV = "SAFETORCH_RUN_DIR"

_lock = threading.Lock()
_state: dict[str, Any] = {"dir": None, "owner": True, "pid": None, "part": None}
_said: set[str] = set()

#: Flags of every file safetorch opens in a run directory: never through a symbolic link, never inherited by a child.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _say(text: str) -> None:
    """One line on stderr, once per process: a run directory or part refused. Never raises."""
    if text in _said:
        return
    _said.add(text)
    with contextlib.suppress(Exception):
        print(f"safetorch: {text}", file=sys.stderr, flush=True)


def _private(path: str) -> str | None:
    """Why ``path`` is not a directory only this user can enter (None: it is): a real directory, not a symbolic
    link, owned by this process's user, with no permission for the group or others."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o077:
        return f"is open to other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _private_dir(path: str) -> str | None:
    """Make ``path`` (0700) or join it when it is already this user's private directory; refuse anything else with
    one line on stderr (None)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    why = _private(path)
    if why is None:
        return path
    _say(f"the run directory {path} {why}: refused, this process reports alone (its findings are kept).")
    return None


def _torchrun_dir() -> str | None:
    """A torchrun job's directory: its ranks are siblings, not children, so they meet at a name made from the job.
    The name is guessable, so it lives inside a directory of this user's that nobody else can enter
    (``$TMPDIR/safetorch-<uid>``), made or verified first."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None or "RANK" not in os.environ:
        return None
    # The agent that started the ranks (their parent) tells this job from an earlier one with the same run id.
    key = "|".join((run_id, os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""),
                    os.environ.get("GROUP_RANK", ""), str(os.getppid())))
    uid = os.geteuid() if hasattr(os, "geteuid") else 0
    return os.path.join(tempfile.gettempdir(), f"safetorch-{uid}", "job-" + hashlib.sha1(key.encode()).hexdigest()[:16])


def start() -> None:
    """At install: join the run of the environment, or start one (then this process owns it)."""
    with _lock:
        if _state["dir"] is not None and _state["pid"] == os.getpid():
            return
        inherited = os.environ.get(ENV)
        torchrun = _torchrun_dir()
        path: str | None
        try:
            if inherited:
                path, owner = inherited, False
                why = _private(path)
                if why is not None:
                    _say(f"the run directory {path} (SAFETORCH_RUN_DIR) {why}: refused, this process reports alone.")
                    return
            elif torchrun is not None:
                owner = True
                path = _private_dir(os.path.dirname(torchrun)) and _private_dir(torchrun)
                if path is None:
                    return
            else:
                path, owner = tempfile.mkdtemp(prefix="safetorch-run-"), True  # 0700, a name nobody can guess
            os.environ[ENV] = path
        except OSError:
            return  # no run directory: each process reports alone, as before
        _state.update(dir=path, owner=owner, pid=os.getpid(), part=None, torchrun=torchrun is not None and
                      not inherited)
        if _state["torchrun"]:  # the count of ranks still running: the last one out removes the directory
            fd = _open_new(f"{os.getpid()}.live")
            if fd is not None:
                os.close(fd)


def _open_new(name: str, mode: int = os.O_WRONLY) -> int | None:
    """Create ``name`` in the run directory, 0600, exclusively: a file already there (a link included) is never
    opened; a stale file of an earlier process with this pid is removed first. The descriptor, or None."""
    path = os.path.join(_state["dir"], name)
    for _ in range(2):
        try:
            return os.open(path, mode | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        except FileExistsError:
            with contextlib.suppress(OSError):
                os.unlink(path)  # the directory is this user's alone: what is there is a stale file of ours
        except OSError:
            return None
    return None


def _after_fork_in_child() -> None:
    """A forked child keeps the parent's patches and reports into the same run, as a process of its own (never
    through the parent's connection to a job's store)."""
    _state.update(owner=False, pid=os.getpid(), part=None, claimed=[], no_store=True, pending=[], follower=None)


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
        fd = _open_new(f"{os.getpid()}.jsonl", os.O_WRONLY | os.O_APPEND)
        if fd is None:
            return None
        part = _state["part"] = os.fdopen(fd, "a", encoding="utf-8")
    return part


def _rank() -> int | None:
    try:
        return int(os.environ["RANK"]) if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 else None
    except (KeyError, ValueError):
        return None


def _host() -> str:
    host = _state.get("host")
    if host is None:
        import socket

        host = _state["host"] = socket.gethostname()
    return str(host)


def record(code: str, filename: str, lineno: int, message: str, count: int, first_seen: float | None = None,
           span: tuple[int, int, int, int] | None = None, source: str | None = None) -> None:
    """Append one site of this process to its part, flushed: a first occurrence, or a final count; and put it into
    the job's store when this process is a rank of a job (`gather`)."""
    entry = {"code": code, "file": filename, "line": lineno, "message": message, "count": count,
             "pid": os.getpid(), "rank": _rank(), "host": _host(), "first_seen": first_seen,
             "span": list(span) if span is not None else None, "source": source}
    try:
        with _lock:
            part = _part()
            if part is not None:
                part.write(json.dumps(entry) + "\n")
                part.flush()
    except (OSError, ValueError, TypeError):
        pass
    if "torch.distributed" in sys.modules and not _state.get("no_store"):
        _publish(entry)


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


_CODE = re.compile(r"ST\d{3}\Z")


def _valid(entry: Any) -> bool:
    """Whether a line of a part is a finding as `record` writes it, field by field."""
    def number(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    return (isinstance(entry, dict) and isinstance(entry.get("code"), str) and bool(_CODE.match(entry["code"]))
            and isinstance(entry.get("file"), str) and number(entry.get("line")) and entry["line"] > 0
            and isinstance(entry.get("message"), str) and entry["message"].startswith(entry["code"])
            and number(entry.get("count")) and entry["count"] > 0 and number(entry.get("pid"))
            and (entry.get("rank") is None or number(entry["rank"]))
            and isinstance(entry.get("host", ""), str)
            and (entry.get("span") is None or (isinstance(entry["span"], list) and len(entry["span"]) == 4
                                               and all(v is None or number(v) for v in entry["span"])))
            and (entry.get("source") is None or isinstance(entry["source"], str))
            and (entry.get("first_seen") is None or (isinstance(entry["first_seen"], (int, float))
                                                     and not isinstance(entry["first_seen"], bool))))


def _read_part(path: str) -> Iterator[dict[str, Any]]:
    """The valid lines of one part: a regular file of this user's, opened without following a link. A line cut
    short by a kill (the last one) is skipped silently; anything else malformed is skipped with one line on stderr."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except OSError:
        return
    with os.fdopen(fd, encoding="utf-8", errors="replace") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
            _say(f"skipped {path}: not a file of this user's")
            return
        bad = 0
        for line in fh:
            try:
                entry = json.loads(line)
            except ValueError:
                if line.endswith("\n"):
                    bad += 1
                continue  # else: cut short by a kill
            if _valid(entry):
                yield entry
            else:
                bad += 1
        if bad:
            _say(f"skipped {bad} malformed line(s) of {path}; the other findings are kept")


def _lines() -> Iterator[dict[str, Any]]:
    path = _state["dir"]
    if path is None:
        return
    try:
        names = sorted(n for n in os.listdir(path) if n.endswith(".jsonl"))
    except OSError:
        return
    for name in names:
        yield from _read_part(os.path.join(path, name))


def claim(code: str, filename: str, lineno: int) -> bool:
    """Whether this process is the first of the run to show this site's warning: it creates the site's marker file
    (an exclusive create, atomic between processes). True without a run directory."""
    path = _state["dir"]
    if path is None:
        return True
    name = hashlib.sha1(f"{code}|{filename}|{lineno}".encode()).hexdigest()[:24] + ".shown"
    try:
        os.close(os.open(os.path.join(path, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW, 0o600))
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


def merged(own: list[dict[str, Any]] | None = None, remote: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every site of every process of the run: one entry per (code, file, line), with its total count and the
    processes (pid, rank under torchrun, host) that reported it. ``own`` is this process's findings as it holds them
    in memory: they count whatever happened to the run directory (a tmp cleaner, a full disk). ``remote`` are lines
    of processes on other machines (`_store`)."""
    me, host = os.getpid(), _host()
    lines: list[dict[str, Any]] = [e for e in _lines() if own is None or e["pid"] != me or e.get("host", host) != host]
    lines += own or []
    lines += remote if remote is not None else _state.get("remote") or []
    sites: dict[tuple[str, str, int], dict[str, Any]] = {}
    counts: dict[tuple[str, str, int], dict[tuple[str, int], int]] = {}
    for e in lines:
        key = (e["code"], e["file"], e["line"])
        entry = sites.setdefault(key, {"code": key[0], "file": key[1], "line": key[2], "count": 0,
                                       "message": e.get("message", ""), "pids": [], "ranks": [], "hosts": []})
        where = e.get("host") or host
        per = counts.setdefault(key, {})
        for pid in e.get("pids") or [e.get("pid")]:
            per[(where, pid)] = max(per.get((where, pid), 0), int(e.get("count", 1)))
            if pid not in entry["pids"]:
                entry["pids"].append(pid)
        for rank in e.get("ranks") or ([e["rank"]] if e.get("rank") is not None else []):
            if rank not in entry["ranks"]:
                entry["ranks"].append(rank)
        if where not in entry["hosts"]:
            entry["hosts"].append(where)
        seen = e.get("first_seen")
        if isinstance(seen, (int, float)) and (entry.get("first_seen") is None or seen < entry["first_seen"]):
            entry["first_seen"] = seen
        if entry.get("span") is None and e.get("span") is not None:
            entry["span"], entry["source"] = e.get("span"), e.get("source")
    for key, entry in sites.items():
        entry["count"] = sum(counts[key].values())
        entry["pids"].sort(key=lambda p: (p is None, p or 0))
        entry["ranks"].sort()
        entry["hosts"].sort()
        if not entry["ranks"]:
            del entry["ranks"]
    return list(sites.values())


@contextlib.contextmanager
def _exclusive() -> Iterator[None]:
    """The run's lock, held while a report is merged and written (and the last rank out removes the directory). No
    lock when the directory is gone: the report is still written, from what is left and this process's own."""
    path = _state["dir"]
    try:
        import fcntl
    except ImportError:  # Windows: no lock, the rename still makes each write whole
        yield
        return
    try:
        fd = os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    except (OSError, TypeError):
        yield
        return
    with os.fdopen(fd) as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_file(path: str, text: str) -> None:
    """Write ``text`` where the user said. A regular file (or a new name) is replaced atomically (a temporary beside
    it, then a rename; an existing file keeps its mode); anything else — a device such as ``/dev/null``, a FIFO, a
    shell's ``/dev/fd/N`` — is written through, never replaced; a symbolic link is followed: its target is written.
    Raises OSError, which names the path."""
    try:
        st: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        with open(path, "w", encoding="utf-8") as fh:  # a device, a FIFO, /dev/fd/N: written through
            fh.write(text)
        return
    target = os.path.realpath(path)  # a link to a file (or to a name still to be made): the file is replaced
    fd, tmp = tempfile.mkstemp(prefix=".safetorch-", suffix=".tmp", dir=os.path.dirname(target))
    try:
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        else:  # what a plain open() would have made
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_report(path: str, render: Callable[[list[dict[str, Any]]], str], own: list[dict[str, Any]] | None = None,
                 remote: list[dict[str, Any]] | None = None) -> None:
    """Merge every part (and ``own``, ``remote``: see `merged`) into ``path``, rendered by ``render``, under the run's
    lock, with `write_file`."""
    with _exclusive():
        write_file(path, render(merged(own, remote)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def finish() -> None:
    """At exit: close the part; the owner of a run removes its directory — under torchrun, where every rank owns
    the job's directory, the last rank out (no other rank's ``.live`` file left, or only of ranks that died)."""
    with _lock:
        part, _state["part"] = _state["part"], None
        if part is not None:
            with contextlib.suppress(OSError):
                part.close()
    path = _state["dir"]
    if not (_state["owner"] and path and _state["pid"] == os.getpid()):
        return
    import shutil

    if not _state.get("torchrun"):
        shutil.rmtree(path, ignore_errors=True)
        return
    with _exclusive():
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(path, f"{os.getpid()}.live"))
        try:
            others = [int(n[:-5]) for n in os.listdir(path) if n.endswith(".live") and n[:-5].isdigit()]
        except OSError:
            return
        if not any(_alive(pid) for pid in others):
            shutil.rmtree(path, ignore_errors=True)


# --- a job on several machines ------------------------------------------------------------------------------------
# The ranks of a job on several machines share no directory: they share the job's c10d store (torch.distributed's,
# which every rank reaches once the process group exists). Each rank puts the lines it writes to its part into the
# store too, as keys of its own (``safetorch/<rank>/<n>``: a counter, then a value, the operations every store has),
# and at its exit reads everyone's back, so that every rank's part — hence each machine's report, exit summary and
# runner status — holds the whole job's findings. Global rank 0 reads the store every few seconds on a thread of its
# own and prints another rank's new finding once, when it learns of it. Nothing here waits without a bound: the exit
# waits at most ``SAFETORCH_JOB_WAIT`` seconds (default 5) for the other ranks to reach theirs.

_PREFIX = "safetorch/"
_POLL_SECONDS = 2.0
_store_lock = threading.Lock()
#: Set at exit: the follower stops at once (it waits on this, not in a sleep), and the exit joins it.
_closing = threading.Event()
#: How long the exit waits for the follower to leave a call of the store's (set to time out after 10 s first).
_JOIN_SECONDS = 12.0


def _job_store() -> Any:
    """The job's store, once this process is a rank of a process group of two or more (None otherwise). Kept once
    found, so that it outlives ``destroy_process_group``; never used by a forked child (its socket is the parent's)."""
    if _state.get("store_pid") == os.getpid():
        return _state.get("store")
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized() or _state.get("no_store"):
            return None
        from torch.distributed import distributed_c10d

        store, world, rank = distributed_c10d._get_default_store(), dist.get_world_size(), dist.get_rank()
    except Exception:
        return None
    if world < 2:
        return None
    _state.update(store=store, store_pid=os.getpid(), world=world, grank=rank, published=0)
    return store


def _publish(entry: dict[str, Any] | None) -> None:
    """Put ``entry`` (and what waited for the group to exist) into the job's store; keep it for later without one."""
    pending = _state.setdefault("pending", [])
    if entry is not None:
        pending.append(entry)
    store = _job_store()
    if store is None or not pending:
        return
    with _store_lock:
        _put(store, pending)


def _put(store: Any, pending: list[dict[str, Any]]) -> None:
    try:
        rank = _state["grank"]
        while pending:
            n = store.add(f"{_PREFIX}{rank}/n", 1)
            store.set(f"{_PREFIX}{rank}/{n}", json.dumps(pending[0]))
            pending.pop(0)
            store.add(f"{_PREFIX}total", 1)
    except Exception:
        _state["no_store"] = True  # a store that went away: this process reports alone from now on


def joined_group() -> None:
    """After ``init_process_group``: publish what was found before it; global rank 0 starts following the job."""
    _publish(None)
    if _job_store() is not None and _state.get("grank") == 0 and not _state.get("follower"):
        thread = threading.Thread(target=_follow, name="safetorch-job", daemon=True)
        _state["follower"] = thread
        thread.start()
        atexit.register(_stop_following)  # after the report's handler: runs before it


def _stop_following() -> None:
    """Stop global rank 0's follower and wait for it, before the interpreter finalizes. A daemon thread that is inside a
    call of the store's then (a C++ call that let go of the GIL) is ended by the interpreter when it takes the GIL
    back, with an unwind through torch's C++ frames that aborts the whole process: "terminate called without an active
    exception", SIGABRT, after a run that went well."""
    _closing.set()
    thread = _state.get("follower")
    if thread is None or thread is threading.current_thread() or not thread.is_alive():
        return
    with contextlib.suppress(Exception):
        from datetime import timedelta

        _state["store"].set_timeout(timedelta(seconds=10))  # a call it is about to make waits no longer than this
    thread.join(_JOIN_SECONDS)


def _remote_lines(store: Any, seen: dict[int, int]) -> list[dict[str, Any]]:
    """The lines other ranks put into the store since ``seen`` (per rank: how many were read), validated."""
    out = []
    for rank in range(_state["world"]):
        if rank == _state["grank"]:
            continue
        n = store.add(f"{_PREFIX}{rank}/n", 0)
        for i in range(seen.get(rank, 0) + 1, n + 1):
            try:
                entry = json.loads(store.get(f"{_PREFIX}{rank}/{i}"))
            except ValueError:
                entry = None
            if _valid(entry):
                out.append(entry)
            else:
                _say(f"skipped a malformed finding of rank {rank} in the job's store")
        seen[rank] = max(seen.get(rank, 0), n)
    return out


def _follow() -> None:
    """Global rank 0's thread: every few seconds, one read of the job's counter; another rank's new site is printed
    once (a site this rank reported itself is printed by it already)."""
    seen: dict[int, int] = {}
    total = 0
    store = _state["store"]
    while not _closing.wait(_POLL_SECONDS):
        try:
            now = store.add(f"{_PREFIX}total", 0)
            if now == total:
                continue
            total = now
            for entry in _remote_lines(store, seen):
                _announce(entry)
        except Exception:
            return  # the store went away: the job is ending


def _announce(entry: dict[str, Any]) -> None:
    key = (entry["code"], entry["file"], entry["line"])
    shown = _state.setdefault("announced", set())
    if key in shown:
        return
    shown.add(key)
    from . import _report

    if _report.seen_here(*key):
        return
    from ._rules import RULES

    rule = RULES.get(entry["code"])
    if rule is None or rule.per_rank:  # a per-rank finding (a NaN of one rank's data) is printed by its rank
        return
    category = rule.category.__name__
    where = f"rank {entry['rank']}" if entry.get("rank") is not None else f"pid {entry['pid']}"
    with contextlib.suppress(Exception):
        print(f"{entry['file']}:{entry['line']}: {category}: {entry['message']} ({where} on {entry.get('host', '?')})",
              file=sys.stderr, flush=True)


def gather() -> None:
    """At exit, in every rank of a job: publish what is left, wait (bounded) for the other ranks to reach their exit,
    then write the other ranks' lines into this process's part, for its machine's report and runner."""
    _stop_following()
    store = _job_store()
    if store is None:
        return
    import time

    try:
        from datetime import timedelta

        store.set_timeout(timedelta(seconds=10))  # the job is over: no store operation may hold the exit longer
    except Exception:
        pass
    _publish(None)
    try:
        arrived = store.add(f"{_PREFIX}exited", 1)
        try:
            wait = float(os.environ.get("SAFETORCH_JOB_WAIT", "5"))
        except ValueError:
            wait = 5.0
        deadline = time.monotonic() + wait
        while arrived < _state["world"] and time.monotonic() < deadline:
            time.sleep(0.05)
            arrived = store.add(f"{_PREFIX}exited", 0)
        remote = _remote_lines(store, {})
    except Exception:
        return
    _state["remote"] = remote
    with _lock:
        part = _part()
        if part is None:
            return
        with contextlib.suppress(OSError, ValueError, TypeError):
            for entry in remote:
                part.write(json.dumps(entry) + "\n")
            part.flush()
