"""Values no integer view can hold, found without decoding a clean trace: a rank file that
stores an integer view (``positions``, ``seq_lens``: ``schema.VIEW_SPECS``) as floats is read
only where it does, and inf, NaN, 2.5 or a value beyond int64 there is damaged data, the same
verdict (exit 3) in ``check``, ``diff``, ``explain`` and ``export``::

    malformed_value(trace)   # "rank1.arrow step 3 target.seq_lens holds inf, not an integer" or None
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .schema import MalformedValue, int_view, view_spec

__all__ = ["malformed_value", "report_malformed"]


def malformed_value(trace: Any) -> str | None:
    """The first value of ``trace`` that an integer view cannot hold, as one line, else None.
    Each distinct step layout (names and dtypes, shared by the steps that repeat it) is looked at
    once; only float rows of integer views are decoded."""
    seen: dict[int, tuple[tuple[str, str], ...]] = {}
    for rank, ix in sorted(trace._index.items()):
        for i, layout in enumerate(ix.layouts):
            suspects = seen.get(id(layout))
            if suspects is None:
                suspects = seen[id(layout)] = _float_int_rows(layout)
            for phase, name in suspects:
                step = int(ix.steps[i])
                try:
                    int_view(trace.record(step, rank, phase)[name], name)
                except MalformedValue as e:
                    return f"{ix.path.name} step {step} {phase}.{e}"
    return None


def report_malformed(trace: Any, incomplete: Callable[[Path, str | None, str], None]) -> None:
    """``validate``'s part: one INCOMPLETE problem (``incomplete(file, key, message)``) naming the
    rank file, step and view of the first malformed value, if there is one."""
    damaged = malformed_value(trace) if hasattr(trace, "_index") else None
    if damaged is not None:
        incomplete(Path(trace.path) / damaged.split(" ", 1)[0], None, f"{Path(trace.path) / damaged} (damaged data)")


def _float_int_rows(layout: Any) -> tuple[tuple[str, str], ...]:
    """(phase, view) of every row stored as floats where the schema declares an integer view."""
    out = []
    for phase, view, dt in zip(layout.phase_of, layout.views, layout.dtypes):
        if dt is not None and dt.kind == "f":
            spec = view_spec(phase, view)
            if spec is not None and spec.dtype.startswith(("int", "uint")):
                out.append((phase, view))
    return tuple(out)
