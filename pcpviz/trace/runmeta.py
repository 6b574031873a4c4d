"""run.json and how the reader opens a trace's files: regular files only, never blocking.

``read_meta(run_dir)`` parses run.json (at most ``MAX_META_BYTES``, nesting bounded, duplicate
keys refused) and checks its schema version (``check_version``: one this pcpviz reads, see
``schema.SCHEMA_VERSIONS``); ``open_for_reading`` is how every trace file is opened for reading
(a FIFO or a device swapped in is refused, never waited on). Every problem is a one-line
``TraceError`` naming the file.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from pcpviz.limits import MAX_META_BYTES

from . import schema as S
from .errors import TraceError
from .jsonlimits import loads_bounded

__all__ = ["file_kind", "read_meta", "check_version", "open_for_reading"]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def open_for_reading(path: Path) -> int:
    """A read-only descriptor of ``path`` if it is a regular file (a link to one is followed):
    opened with O_NONBLOCK, so a FIFO or device swapped in after a check never blocks, then
    checked with fstat. OSError (EINVAL "not a regular file") otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd




def file_kind(path: Path) -> str | None:
    """None for a regular file (or a link to one); else why it cannot be read as one."""
    try:
        st = os.stat(path)
    except OSError as exc:
        if os.path.islink(path):
            return f"a dangling or unreadable symbolic link ({exc.strerror})"
        return exc.strerror or _one_line(exc)
    if stat.S_ISREG(st.st_mode):
        return None
    if stat.S_ISDIR(st.st_mode):
        return "a directory, not a file"
    what = "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else \
        "a pipe" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a file"
    return f"{what}, not a regular file" + (" (a symbolic link to it)" if os.path.islink(path) else "")

def read_meta(run_dir: Path) -> dict[str, Any]:
    path = run_dir / S.RUN_META_FILE
    if not os.path.lexists(path):
        raise TraceError(f"{run_dir}: no {S.RUN_META_FILE}")
    kind = file_kind(path)
    if kind is not None:
        raise TraceError(f"{path}: cannot read ({kind})")
    try:
        with os.fdopen(open_for_reading(path), "rb") as fh:
            data = fh.read(MAX_META_BYTES + 1)
        if len(data) > MAX_META_BYTES:
            raise TraceError(f"{path}: more than the {MAX_META_BYTES} bytes a run.json may have")
        meta = loads_bounded(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"{path}: not valid JSON ({_one_line(exc)})") from None
    except RecursionError:
        raise TraceError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        if isinstance(exc, TraceError):
            raise
        raise TraceError(f"{path}: not valid JSON ({_one_line(exc)})") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({_one_line(exc)})") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{path}: not a pcpviz trace (top level is a {type(meta).__name__}, "
                         "not an object)")
    if S.META_SCHEMA_KEY not in meta:
        raise TraceError(f"{path}: not a pcpviz trace (missing {S.META_SCHEMA_KEY!r})")
    check_version(path, meta[S.META_SCHEMA_KEY])
    return meta


def check_version(path: Path, version: Any) -> int:
    if isinstance(version, str) and version.strip().isdigit() and len(version.strip()) <= 18:
        version = int(version)
    if isinstance(version, bool) or not isinstance(version, int):
        text = repr(version)
        shown = text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"
        raise TraceError(f"{path}: {S.META_SCHEMA_KEY} must be an int, got {shown}")
    if version > S.SCHEMA_VERSION:
        raise TraceError(f"{path}: schema version {version} is newer than this pcpviz "
                         f"({S.SCHEMA_VERSION}); upgrade pcpviz")
    if version not in S.SCHEMA_VERSIONS:
        raise TraceError(f"{path}: schema version {version} is not valid")
    return version
