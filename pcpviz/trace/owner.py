"""One writer per trace directory: ``claim(run_dir)`` before writing, ``release`` after.

A run that writes a trace (``pcpviz run``, a replay) first claims its directory::

    c = claim("runs/demo", overwrite=False, command="pcpviz run")   # ValueError if taken
    ... ranks write run.json and rank<r>.arrow, passing owner=c.token to TraceWriter ...
    c.release()

The claim is a lock file, ``run_dir/.writer.lock``, holding ``{"pid", "host", "token",
"command", "started"}`` and kept ``flock``-ed by the claiming process for the whole run, so:

* a second writer gets one line naming the first ("in use by pid 4242 on host a (pcpviz run,
  since 12:00:01)") and touches nothing;
* a writer killed even by SIGKILL drops its flock with its process, and the next claim takes
  the stale lock over (the lock file is the only thing it replaces);
* a directory that already holds anything is refused unless ``overwrite``; with ``overwrite``
  only the trace's own files (``run.json``, ``rank<N>.arrow``, run.json temporaries) are
  removed, never anything else.

``TraceWriter`` consults the lock too (``check_writer``): it refuses to write into a directory
claimed by a live writer unless given that writer's token (the engine passes it to its rank
processes) or the claim is held by this very process (in-process writers such as the replay).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import schema as S
from .outputs import special_kind

__all__ = ["LOCK_FILE", "Claim", "claim", "check_target", "check_writer", "writer_busy", "open_regular",
           "trace_files", "rank_file_busy"]

LOCK_FILE = ".writer.lock"
"""Name of the lock file inside a claimed run directory."""

_held: dict[str, "Claim"] = {}  # realpath of the directory -> claim held by this process
_held_lock = threading.Lock()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _os_error(path: Path, exc: OSError, what: str) -> ValueError:
    reason = exc.strerror or _one_line(exc)
    if exc.errno == errno.ENOTDIR:
        reason = "a path component is a file, not a directory"
    return ValueError(f"{path}: cannot {what} ({reason})")


@dataclass
class Claim:
    """A held claim on ``path``; ``token`` lets this run's other processes write there."""

    path: Path
    token: str
    _fd: int | None = field(default=None, repr=False)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file (if it is still ours) and drop the flock. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with _held_lock:
            _held.pop(_key(self.path), None)
        try:
            lock = self.path / LOCK_FILE
            try:
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    os.unlink(lock)
            except OSError:
                pass
        finally:
            os.close(fd)

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def open_regular(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that never follows a symlink at ``path`` and never blocks on a FIFO or device.

    Raises OSError (ELOOP for a link, EINVAL-like ``OSError`` naming the kind for anything that
    is not a regular file) so callers turn it into their one line. Example::

        fd = open_regular(p / LOCK_FILE, os.O_RDWR | os.O_CREAT)   # a planted link -> ELOOP
    """
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock_error(lock: Path, exc: OSError) -> ValueError:
    if exc.errno == errno.ELOOP:
        return ValueError(f"{lock}: is a symbolic link; refusing to open it (remove it yourself)")
    if exc.errno == errno.EINVAL:
        return ValueError(f"{lock}: is not a regular file; refusing to open it (remove it yourself)")
    return _os_error(lock.parent, exc, f"open its lock file {LOCK_FILE}")


def _key(path: Path) -> str:
    return os.path.realpath(path)


def trace_files(run_dir: Path) -> list[Path]:
    """The files a trace consists of in ``run_dir``: run.json, rank files, the completion record,
    their temporaries."""
    out = []
    for child in sorted(run_dir.iterdir()):
        name = child.name
        if (name in (S.RUN_META_FILE, S.COMPLETION_FILE) or S.RANK_FILE_RE.match(name)
                or (name.startswith((".run.json.", ".complete.json.")) and name.endswith(".tmp"))):
            out.append(child)
    return out


def check_target(path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """The cheap checks of a trace directory, without claiming it (for early one-line errors).

    Raises ValueError naming the directory: not a directory, in use by a live writer, or
    not empty without ``overwrite``.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{p}: exists and is not a directory")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{p}: cannot create ({parent} is a file, not a directory)")
            break
    if p.is_dir():
        busy = _busy_message(p)
        if busy:
            raise ValueError(busy)
        if not overwrite:
            _refuse_non_empty(p)
    return p


def _refuse_non_empty(p: Path) -> None:
    try:
        names = sorted(n for n in os.listdir(p) if n != LOCK_FILE)
    except OSError as exc:
        raise _os_error(p, exc, "list the directory") from None
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        what = "already holds a trace" if trace_files(p) else "not empty"
        raise ValueError(f"{p}: {what} ({shown}); pass --overwrite (overwrite=True) to replace "
                         "the trace in it, or choose a new directory")


def _read_lock(lock: Path) -> dict:
    try:
        with os.fdopen(open_regular(lock, os.O_RDONLY), "rb") as fh:
            doc = json.loads(fh.read(4096).decode("utf-8"))
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def _describe(doc: dict) -> str:
    if not doc.get("pid"):
        return "another writer (starting up)"
    since = doc.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return (f"pid {doc.get('pid')} on host {doc.get('host', '?')} "
            f"({doc.get('command') or 'a writer'}, since {when})")


def _busy_message(p: Path, token: str | None = None) -> str | None:
    """A one-line 'in use' message if a live writer other than ``token``'s holds ``p``."""
    lock = p / LOCK_FILE
    with _held_lock:
        mine = _held.get(_key(p))
    if mine is not None and (token is None or token == mine.token):
        return None
    try:
        fd = open_regular(lock, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return str(_lock_error(lock, exc))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # nobody holds it: a stale lock of a writer that died
        except BlockingIOError:
            pass
    finally:
        os.close(fd)
    doc = _read_lock(lock)
    if token is not None and doc.get("token") == token:
        return None
    return (f"{p}: in use by {_describe(doc)}; wait for it to finish or choose another "
            "directory")


def writer_busy(path: Path) -> str | None:
    """The one-line 'in use by pid ...' of a live writer that claimed ``path`` (another process's,
    or a claim this process holds under another token), None when nobody holds it."""
    return _busy_message(Path(path), token="")


def check_writer(path: Path, token: str | None) -> None:
    """Raise FileExistsError if a live writer other than ``token``'s (or this process's) holds
    the directory."""
    busy = _busy_message(path, token)
    if busy:
        raise FileExistsError(busy)


def claim(path: str | os.PathLike, *, overwrite: bool = False, command: str = "") -> Claim:
    """Claim ``path`` for one writer (see the module doc). Raises ValueError with one line."""
    p = check_target(path, overwrite=True)
    created = not p.exists()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _os_error(p, exc, "create the trace directory") from None
    try:
        return _claim_in(p, overwrite=overwrite, command=command)
    except BaseException:
        if created:  # a claim that failed (a full disk, a busy lock) leaves no directory behind
            with contextlib.suppress(OSError):
                os.rmdir(p)
        raise


def _claim_in(p: Path, *, overwrite: bool, command: str) -> Claim:
    lock = p / LOCK_FILE
    for _ in range(20):
        try:
            fd = open_regular(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise _lock_error(lock, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(f"{p}: in use by {_describe(_read_lock(lock))}; wait for it to finish "
                             "or choose another directory") from None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed that file after we opened it: try again
    else:
        raise ValueError(f"{p}: cannot take its lock file {LOCK_FILE} (it keeps changing)")
    c = Claim(p, secrets.token_hex(8), fd)
    try:
        doc = {"pid": os.getpid(), "host": socket.gethostname(), "token": c.token,
               "command": command, "started": time.time()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(doc).encode("utf-8"), 0)
        except OSError as exc:  # ENOSPC, EDQUOT, EIO
            raise _os_error(p, exc, f"write its lock file {LOCK_FILE}") from None
        if not overwrite:
            _refuse_non_empty(p)
        else:
            old = trace_files(p)
            for f in old:  # all checked before any is removed: a refusal removes nothing
                if f.is_dir() and not f.is_symlink():
                    raise ValueError(f"{f}: is a directory, not a trace file; remove it yourself")
                kind = special_kind(f)
                if kind is not None:
                    raise ValueError(f"{f}: is {kind}, not a trace file; --overwrite replaced nothing")
            for f in old:
                try:
                    f.unlink()
                except OSError as exc:
                    raise _os_error(f, exc, "remove the old trace file") from None
    except BaseException:
        c.release()
        raise
    with _held_lock:
        _held[_key(p)] = c
    return c


def rank_file_busy(path: Path) -> bool:
    """True while a live ``TraceWriter`` holds ``path`` open (its exclusive flock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
