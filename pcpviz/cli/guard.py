"""Input guards of the ``pcpviz`` command line: bounded numbers, writable outputs, the trace
verdict (valid / complete) and the exit codes, so every bad input is one line and exit 2.

    pcpviz check runs/x        # exit 3 and "pcpviz check: incomplete: runs/x/rank1.arrow: missing
                               #   (run.json says pcp=2)" when a rank file is gone

Exit codes (``pcpviz --help`` lists them):
0 ok; 1 a check failed or runs differ; 2 bad input (one-line reason on stderr: a bad option,
an unreadable trace, an invalid run.json; "incomplete:" lines of damage found first may
precede it); 3 incomplete trace (data lost: a missing or
unreadable rank file, steps dropped after a damaged record, steps missing on some ranks, a
run that did not finish or is still being written: ``pcpviz.trace.completion``); 130/143
``pcpviz run`` stopped by SIGINT/SIGTERM; 141 stdout was closed early (``| head``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import sys
from typing import Any, Iterator, Sequence

from pcpviz.limits import MAX_PROMPTS
from pcpviz.io_guards import bounded_int, check_output_file, read_json_file

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_BAD_INPUT", "EXIT_INCOMPLETE", "EXIT_PIPE", "UsageError", "Incomplete",
           "positive_int", "EXIT_CODES_HELP", "bounded_int", "seconds", "path",
           "check_output_file", "read_json_file", "read_prompts_file", "trace_verdict", "exit_code", "SUBCOMMAND_NAMES",
           "os_error_line", "drop_stdout", "NamedStdout", "system_error", "named_stdout", "terminal_safe"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INCOMPLETE = 3
EXIT_PIPE = 141
EXIT_CODES_HELP = ("Exit codes: 0 ok, 1 a check failed or runs differ, 2 bad input (one-line reason "
                   "on stderr; includes an invalid run.json), 3 incomplete trace (data lost: a "
                   "missing or unreadable rank file, steps dropped after a damaged record, steps "
                   "missing on some ranks, a run that did not finish or is still being written; "
                   "one 'incomplete:' line each on stderr), 130/143 'pcpviz run' stopped by "
                   "SIGINT/SIGTERM (trace marked partial), 141 stdout closed early.")

class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class Incomplete(Exception):
    """Nothing left to work on because data was lost: one 'incomplete:' line, exit code 3."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


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


def read_prompts_file(path: str) -> list[str]:
    """The prompts of ``--prompts-file`` (a JSON list of strings, at most
    ``pcpviz.limits.MAX_PROMPTS``), or ValueError naming the option and the file."""
    loaded = read_json_file(path, "--prompts-file")
    if not isinstance(loaded, list) or not all(isinstance(p, str) for p in loaded):
        raise ValueError(f"--prompts-file {path}: expected a JSON list of strings")
    if len(loaded) > MAX_PROMPTS:
        raise ValueError(f"--prompts-file {path}: {len(loaded)} prompts; a run takes at most {MAX_PROMPTS}")
    return loaded


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
        print(f"pcpviz {cmd}: {terminal_safe(line)}", file=sys.stderr)
    return status


def exit_code(status: Any, ok: bool) -> int:
    """3 for an incomplete trace, else 0 / 1 by ``ok``."""
    if not status.complete:
        return EXIT_INCOMPLETE
    return 0 if ok else 1


SUBCOMMAND_NAMES = frozenset({"layout", "run", "check", "diff", "export", "explain", "replay", "synth"})
"""The subcommands, for naming the command in a one-line error raised before argparse ran."""


def system_error(argv: Sequence[str], e: BaseException) -> int:
    """The exit code for what the system refused while a command ran, after one line naming the
    command and the file: 141 for a closed pipe (``| head``, silent), else 2 (a name too long,
    a full disk, stdout on /dev/full, out of memory, input nested too deeply)."""
    cmd = next((a for a in argv if not a.startswith("-")), None)
    prog = f"pcpviz {cmd}" if cmd in SUBCOMMAND_NAMES else "pcpviz"
    drop_stdout()
    if isinstance(e, BrokenPipeError):
        return EXIT_PIPE
    what = (os_error_line(e) if isinstance(e, OSError) else "input nested too deeply"
            if isinstance(e, RecursionError) else "out of memory (the input is larger than this machine can hold)")
    print(f"{prog}: {terminal_safe(what)}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def named_stdout() -> Iterator[None]:
    """``sys.stdout`` as a ``NamedStdout`` for the block (write errors name stdout)."""
    real, sys.stdout = sys.stdout, NamedStdout(sys.stdout)
    try:
        yield
    finally:
        sys.stdout = real


def os_error_line(e: OSError) -> str:
    """``<file>: <reason>`` in one line (the file named, never a traceback)."""
    names = [str(n) for n in (e.filename, e.filename2) if n is not None]
    reason = e.strerror or " ".join(str(e).split()) or type(e).__name__
    shown = [n if len(n) <= 400 else n[:200] + f"... ({len(n)} characters)" for n in names]
    return (" -> ".join(shown) + ": " if shown else "") + " ".join(reason.split())


def drop_stdout() -> None:
    """Point stdout at /dev/null so nothing is flushed into a closed pipe or a full disk at exit."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is not a file (a test's StringIO)
        pass


_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff"
                     "\ud800-\udfff]")
"""Characters a terminal acts on or hides: C0/C1 controls but tab and newline (ESC sequences,
carriage returns, backspaces), zero-width and bidirectional overrides (text shown reordered); and
lone surrogates, which stand for the bytes of a file name that is not UTF-8 (``bad-\\xff.html``:
shown as the byte, since no encoding can write them)."""


def terminal_safe(text: str) -> str:
    r"""``text`` with every character a terminal would act on or hide written as an escape, so a
    request id, prompt or file name from a trace cannot move the cursor, recolour, clear or reorder
    what the user reads (tab and newline stay).

        >>> print(terminal_safe("req\x1b[2J0 ok\u202e"))
        req\x1b[2J0 ok\u202e
    """
    return _UNSAFE.sub(_escape, text)


def _escape(m: re.Match) -> str:
    code = ord(m.group())
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape's stand-in for the byte code - 0xDC00
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class NamedStdout:
    """stdout whose write errors (a full disk, an I/O error) name it: ``stdout: No space left
    on device``, not a nameless OSError; what is written is ``terminal_safe``."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def _named(self, fn, *args):
        try:
            return fn(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OSError(e.errno, e.strerror, "stdout") from None

    def write(self, text: str) -> int:
        self._named(self._stream.write, terminal_safe(text))
        return len(text)

    def flush(self) -> None:
        self._named(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
