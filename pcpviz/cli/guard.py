"""Input guards of the ``pcpviz`` command line: bounded numbers, writable outputs, the trace
verdict (valid / complete) and the exit codes, so every bad input is one line and exit 2.

    pcpviz check runs/x        # exit 3 and "pcpviz check: incomplete: runs/x/rank1.arrow: missing
                               #   (run.json says pcp=2)" when a rank file is gone

Exit codes (``pcpviz --help`` lists them):
0 ok; 1 a check failed or runs differ; 2 bad input (one-line reason on stderr: a bad option,
an unreadable trace, an invalid run.json; "incomplete:" lines of damage found first may
precede it); 3 incomplete trace (data lost: a missing or
unreadable rank file, steps dropped after a damaged record, steps missing on some ranks);
141 stdout was closed early (``| head``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Callable

from pcpviz.trace.jsonlimits import loads_bounded

__all__ = ["EXIT_INCOMPLETE", "EXIT_PIPE", "EXIT_CODES_HELP", "bounded_int", "seconds", "path",
           "check_output_file", "read_json_file", "trace_verdict", "exit_code"]

EXIT_INCOMPLETE = 3
EXIT_PIPE = 141
EXIT_CODES_HELP = ("Exit codes: 0 ok, 1 a check failed or runs differ, 2 bad input (one-line reason "
                   "on stderr; includes an invalid run.json), 3 incomplete trace (data lost: a "
                   "missing or unreadable rank file, steps dropped after a damaged record, steps "
                   "missing on some ranks; one 'incomplete:' line each on stderr), 141 stdout "
                   "closed early.")

MAX_JSON_INPUT_BYTES = 64 << 20


def bounded_int(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an int in ``lo..hi`` (one-line error otherwise)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in {lo}..{hi}, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer in {lo}..{hi}, got {value}")
        return value
    parse.__name__ = "integer"
    return parse


def seconds(text: str) -> float:
    """An argparse type: a finite positive number of seconds (at most a week)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or not 0 < value <= 7 * 24 * 3600:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 604800], got {text!r}")
    return value


def path(text: str) -> str:
    """An argparse type: a file or directory path, not empty or blank (``--json ""`` would
    otherwise be skipped as if not given, and ``--trace ""`` would mean the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return text


def check_output_file(path: str, option: str) -> None:
    """ValueError (one line naming ``option``) if ``path`` cannot be written as a file: it is a
    directory, its directory does not exist or is not writable."""
    where = f"{option} {path}"
    try:
        os.stat(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # a name too long, a component that is a file, a loop of links
        raise ValueError(f"{where}: {e.strerror or e}") from None
    if os.path.isdir(path):
        raise ValueError(f"{where}: is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{where}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{where}: not writable")


def read_json_file(path: str, option: str) -> Any:
    """The JSON in ``path`` (at most 64 MiB), or ValueError naming ``option`` and the file."""
    where = f"{option} {path}"
    try:
        if not os.path.isfile(path):
            raise ValueError("not a regular file" if os.path.exists(path) else "no such file")
        with open(path, "rb") as f:
            data = f.read(MAX_JSON_INPUT_BYTES + 1)
        if len(data) > MAX_JSON_INPUT_BYTES:
            raise ValueError(f"larger than {MAX_JSON_INPUT_BYTES} bytes")
        return loads_bounded(data)
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply") from None
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise ValueError(f"{where}: {' '.join(str(e).split())}") from None


def trace_verdict(trace: Any, cmd: str) -> Any:
    """``pcpviz.trace.validate(trace)``: an invalid run.json raises ValueError with its lines
    (the caller exits 2); lost data prints one ``incomplete:`` line each to stderr. Returns the
    ``TraceStatus``."""
    from pcpviz.trace import INVALID, validate

    status = validate(trace)
    bad = [p for p in status.problems if p.kind == INVALID]
    if bad:
        more = (f" (and {len(bad) - 1} more: {', '.join(str(p.key) for p in bad[1:4])})"
                if len(bad) > 1 else "")
        raise ValueError(f"invalid: {bad[0].message}{more}")
    for line in status.lines("incomplete"):
        print(f"pcpviz {cmd}: {line}", file=sys.stderr)
    return status


def exit_code(status: Any, ok: bool) -> int:
    """3 for an incomplete trace, else 0 / 1 by ``ok``."""
    if not status.complete:
        return EXIT_INCOMPLETE
    return 0 if ok else 1
