"""Reading and writing the files ``safetorch fix`` rewrites: as Python reads them, and all of them or none.

Design rules:
- A file is decoded as Python decodes it (``tokenize.detect_encoding``: a PEP 263 coding cookie, a UTF-8 BOM) and
  written back in that encoding with its own line endings (no newline translation either way).
- All files or none: each new text is written to a temporary file beside its file (same directory, same mode), and
  only when every one of them is written are they renamed over the files. A file that changed since it was read,
  or that its owner made read-only, stops the write before anything is renamed. A rename that fails half-way puts
  back the files already renamed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import stat
import tempfile
import tokenize

__all__ = ["Source", "WriteError", "read", "write_all"]


@dataclasses.dataclass(frozen=True)
class Source:
    text: str
    encoding: str
    digest: str  # sha256 of the bytes read
    mtime: float


def read(path: str) -> Source:
    """The file's text as Python decodes it (OSError, or SyntaxError/UnicodeDecodeError for an unknown or wrong
    encoding)."""
    with open(path, "rb") as fh:
        raw = fh.read()
        mtime = os.fstat(fh.fileno()).st_mtime
    encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    return Source(raw.decode(encoding), encoding, hashlib.sha256(raw).hexdigest(), mtime)


def digest(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return None


class WriteError(Exception):
    """Nothing was written: ``path`` could not be, and why."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def write_all(changes: dict[str, tuple[Source, str]]) -> list[str]:
    """Replace each file's text (``path -> (what was read, the new text)``) by the new one, all or none: the paths
    written, in order; `WriteError` when none was."""
    temps: dict[str, str] = {}
    try:
        for path, (source, text) in changes.items():
            try:
                data = text.encode(source.encoding)
            except UnicodeEncodeError as exc:
                raise WriteError(path, f"the fix cannot be written in the file's encoding {source.encoding} "
                                       f"({exc.reason})") from None
            if digest(path) != source.digest:
                raise WriteError(path, "the file changed since the run read it")
            mode = stat.S_IMODE(os.stat(path).st_mode)
            if not os.access(path, os.W_OK) or not mode & 0o222:  # read-only, even to a user who could override it
                raise WriteError(path, f"the file is not writable (mode {mode:04o})")
            try:
                fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".safetorch-fix",
                                            dir=os.path.dirname(os.path.abspath(path)))
            except OSError as exc:
                raise WriteError(path, f"no file can be made beside it ({exc.strerror})") from None
            temps[path] = temp
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                os.chmod(temp, mode)
            except OSError as exc:
                raise WriteError(path, f"it cannot be written ({exc.strerror})") from None
        done: list[str] = []
        for path, temp in temps.items():
            try:
                os.replace(temp, path)
            except OSError as exc:
                for back in done:  # put back what was already replaced
                    with contextlib.suppress(OSError), open(back, "wb") as fh:
                        old = changes[back][0]
                        fh.write(old.text.encode(old.encoding))
                raise WriteError(path, f"it cannot be replaced ({exc.strerror})") from None
            done.append(path)
        temps.clear()
        return done
    finally:
        for temp in temps.values():
            with contextlib.suppress(OSError):
                os.unlink(temp)
