"""Every file pcpviz writes goes through here: refused if the path is a device, a FIFO, a socket
(or a symbolic link to one), else written to a hidden temporary beside it and renamed over it,
so a full disk or a crash leaves the old file (or none) and nothing half-written::

    with atomic_output("runs/demo.html") as fh:   # fh: a text file runs/.demo.html.<rand>.tmp
        fh.write(doc)                             # renamed to runs/demo.html on success
    atomic_output("/dev/full")                    # SpecialFileError: /dev/full: is a character
                                                  #   device; pcpviz writes regular files only

A symbolic link to a regular file (or to nothing yet) is written through: the file it points at
is replaced and the link stays, as a shell's ``>`` would. Names need not be UTF-8: a path is
kept as Python gives it (``os.fsencode`` round-trips ``b'bad-\\xff.html'``).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Iterator

__all__ = ["SpecialFileError", "special_kind", "check_output", "atomic_output", "write_output"]


class SpecialFileError(ValueError):
    """An output path names something that is not a regular file (one line; the CLI exits 2)."""


def special_kind(path: str | os.PathLike) -> str | None:
    """What ``path`` is if writing there would replace something other than a regular file:
    ``"a character device"``, ``"a FIFO"``, ... (``"... (through a symbolic link)"`` when a link
    leads there); None when it is absent, a regular file, or a link to either. A directory is the
    caller's business (returned as ``"a directory"``)."""
    try:
        st = os.stat(path)
    except OSError:
        return None  # absent, or a dangling link: written as a new regular file
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return None
    what = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a directory" if stat.S_ISDIR(mode) else "not a regular file")
    return what + (" (through a symbolic link)" if os.path.islink(path) else "")


def check_output(path: str | os.PathLike, option: str | None = None) -> Path:
    """The file a write to ``path`` replaces (a symbolic link resolved), or SpecialFileError
    naming ``option`` and ``path`` if that is a device, FIFO, socket or directory."""
    kind = special_kind(path)
    if kind is not None:
        where = f"{option} {os.fsdecode(path)}" if option else os.fsdecode(path)
        raise SpecialFileError(f"{where}: is {kind}; pcpviz writes regular files only and replaced nothing")
    p = Path(os.fsdecode(path))
    return Path(os.path.realpath(p)) if p.is_symlink() else p


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, *, binary: bool = False,
                  option: str | None = None) -> Iterator[IO]:
    """A file (UTF-8 text, or bytes if ``binary``) that replaces ``path`` when the block ends
    without an exception; SpecialFileError before anything is written if ``path`` is not a
    regular file's (see ``check_output``), and again if one was swapped in while writing."""
    target = check_output(path, option)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:200]}.", suffix=".tmp", dir=target.parent)
    try:
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644 & ~_umask())
        check_output(target, option)  # a FIFO or device put there meanwhile is still not replaced
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_output(path: str | os.PathLike, data: str | bytes, *, option: str | None = None) -> Path:
    """Write ``data`` to ``path`` through ``atomic_output``; returns the file written."""
    with atomic_output(path, binary=isinstance(data, bytes), option=option) as fh:
        fh.write(data)
    return check_output(path, option)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
