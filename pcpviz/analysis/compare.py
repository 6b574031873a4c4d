"""Exact comparison of two recorded arrays and their short text form: what ``pcpviz.analysis.checks``
and ``pcpviz.analysis.diff`` report as expected vs actual.

    >>> first_difference([1, 2, 3], [1, 5, 3])
    (True, (1,), 'values differ')
    >>> short_repr(list(range(20)), (10,))
    '[6:15]=[6, 7, 8, 9, *10, 11, 12, 13, 14]'
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["fmt_value", "short_repr", "first_difference"]


def fmt_value(x: Any) -> str:
    if isinstance(x, (np.str_, str)):
        return repr(str(x))
    if isinstance(x, (np.bool_, bool)):
        return "T" if x else "F"
    if isinstance(x, np.floating):
        return f"{float(x):g}"
    if isinstance(x, np.void):
        return "(" + ",".join(str(v) for v in x.tolist()) + ")"
    return str(x.item() if isinstance(x, np.generic) else x)


def short_repr(arr: Any, index: tuple[int, ...] | None = None, width: int = 4) -> str:
    """A short text form of ``arr``: whole if small, else a window around ``index``
    (along the last axis) written ``[i:j]=[...]``."""
    a = np.asarray(arr)
    if a.ndim == 0:
        return fmt_value(a[()])
    if index is None or len(index) != a.ndim:
        if a.size <= 2 * width + 2:
            return "[" + ", ".join(fmt_value(v) for v in a.ravel()) + "]" + (
                f" shape {list(a.shape)}" if a.ndim > 1 else "")
        return (f"shape {list(a.shape)} [" + ", ".join(fmt_value(v) for v in a.ravel()[:2 * width]) + ", …]")
    line = a[tuple(index[:-1])] if a.ndim > 1 else a
    i = int(index[-1])
    lo, hi = max(0, i - width), min(line.shape[0], i + width + 1)
    prefix = "" if a.ndim == 1 else "[" + ", ".join(str(int(v)) for v in index[:-1]) + "]"
    body = ", ".join(("*" if j == i else "") + fmt_value(line[j]) for j in range(lo, hi))
    return f"{prefix}[{lo}:{hi}]=[{body}]"


def first_difference(expected: Any, actual: Any) -> tuple[bool, tuple[int, ...] | None, str]:
    """``(differs, first index, reason)`` comparing two arrays exactly (shape, then values)."""
    e, a = np.asarray(expected), np.asarray(actual)
    if e is a and e.dtype.names is None:  # one array (ranks share a byte-equal view): NaN equals NaN here
        return False, None, ""
    if e.shape != a.shape:
        return True, None, f"shape {list(a.shape)}, expected {list(e.shape)}"
    if (e.dtype.kind == "U") != (a.dtype.kind == "U"):
        return True, None, f"dtype {a.dtype}, expected {e.dtype}"
    if e.size == 0:
        return False, None, ""
    if e.dtype.names is not None or a.dtype.names is not None:
        neq = np.asarray([x != y for x, y in zip(e.ravel().tolist(), a.ravel().tolist())]).reshape(e.shape)
    elif e.dtype.kind in "fc" and a.dtype.kind in "fc":
        neq = ~((e == a) | (np.isnan(e) & np.isnan(a)))
    else:
        neq = e != a
    if not neq.any():
        return False, None, ""
    idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(neq)), neq.shape))
    return True, idx, "values differ"
