"""The shapes a view may take, normalised: one KV-cache group or several, a one-value text view.

A slot mapping is recorded as ``[n]`` (one KV-cache group) or ``[G, n]``; a block table as
``[rows, W]`` or ``[G, rows, W]`` (the schema's ``[G, ...]`` shapes, ``pcpviz.trace.schema``).
Checks and figures read them through ``slot_groups`` / ``table_groups``, so both forms are one.
``None`` (a view not recorded) stays ``None``.

PCP=2 example: ``slot_groups(np.array([8, 9, -1]))`` is ``[[8, 9, -1]]`` (G = 1);
``table_groups(np.zeros((2, 4)))`` has shape ``(1, 2, 4)``; ``view_text(np.array("replicated"))``
is ``"replicated"`` (a draft phase's ``view``: its layout view).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["slot_groups", "table_groups", "view_text"]


def slot_groups(a: Any) -> np.ndarray | None:
    """A slot mapping as ``[G, n]`` (a 1-D array is one group)."""
    if a is None:
        return None
    a = np.asarray(a)
    return a[None, :] if a.ndim == 1 else a


def table_groups(a: Any) -> np.ndarray | None:
    """A block table as ``[G, rows, W]`` (a 2-D array is one group)."""
    if a is None:
        return None
    a = np.asarray(a)
    return a[None] if a.ndim == 2 else a


def view_text(a: Any) -> str:
    """The first value of a text view as ``str`` (``""`` when empty)."""
    a = np.asarray(a)
    return str(a.item() if a.ndim == 0 else a.ravel()[0]) if a.size else ""
