"""Export files appear whole or not at all: written to a hidden temporary beside the target,
then renamed over it. A full disk (ENOSPC) or a crash mid-write leaves the old file (or none)
at the output path and no temporary behind::

    with atomic_output("runs/demo.html") as fh:   # fh: a text file in runs/.demo.html.<rand>.tmp
        fh.write(doc)                             # renamed to runs/demo.html on success
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator

__all__ = ["atomic_output"]


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[IO[str]]:
    """A UTF-8 text file that replaces ``path`` when the block ends without an exception."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:200]}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
