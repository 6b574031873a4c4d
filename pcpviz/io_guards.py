"""Input and output guards shared by the ``pcpviz`` command line (``pcpviz.cli.guard``, which
re-exports them) and the library's other ``python -m`` entry points (``pcpviz.costmodel``), so
neither imports the other: a bounded integer option, a writable output file, a JSON input file.
Each failure is one line naming the option and the file::

    >>> bounded_int(1, 8)("2")
    2
    >>> check_output_file("/", "--out")
    Traceback (most recent call last):
    ValueError: --out /: is a directory; give a file name
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from pcpviz.limits import MAX_JSON_INPUT_BYTES
from pcpviz.trace.jsonlimits import loads_bounded
from pcpviz.trace.outputs import check_output, special_kind
from pcpviz.trace.runmeta import open_for_reading

__all__ = ["bounded_int", "check_output_file", "read_json_file"]


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


def check_output_file(path: str, option: str) -> None:
    """ValueError (one line naming ``option``) if ``path`` cannot be written as a file: it is a
    directory, a device, FIFO or socket (or a link to one: ``pcpviz.trace.outputs``), its
    directory does not exist or is not writable."""
    where = f"{option} {path}"
    kind = special_kind(path)
    if kind is not None and kind != "a directory":
        check_output(path, option)
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
        with os.fdopen(open_for_reading(path), "rb") as f:  # a FIFO swapped in is refused, not waited on
            data = f.read(MAX_JSON_INPUT_BYTES + 1)
        if len(data) > MAX_JSON_INPUT_BYTES:
            raise ValueError(f"larger than {MAX_JSON_INPUT_BYTES} bytes")
        return loads_bounded(data)
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply") from None
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise ValueError(f"{where}: {' '.join(str(e).split())}") from None
