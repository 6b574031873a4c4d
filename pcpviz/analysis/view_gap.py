"""Views one run records and the other never does: two traces from producers of different ages
(a shipped trace recorded before ``verify.num_computed_after`` existed, against a fresh engine
re-run) or kinds (the engine's ``top1_token``, which vLLM's plugin has no value for). ``diff``
compares neither side of such a view and says so in one note; a view a run records at some steps
and not at others is still a divergence where it is missing.

    >>> # a: steps recorded before the view existed; b: a re-run that records it
    >>> # one_sided_views(a, b) -> ({"num_computed_after"}, ["num_computed_after: recorded only in run b ..."])

Exact, and cheap when the runs agree: the view names of a sample of records (the first, middle
and last steps, every rank and phase) give the candidates, and each candidate is then looked
for in every record of the run that seems to lack it, stopping at the first.
"""

from __future__ import annotations

from pcpviz.trace.errors import MALFORMED, TraceError
from pcpviz.trace.reader import Trace

__all__ = ["one_sided_views"]

_SAMPLE_STEPS = 3  # from each end of the run, and the middle one


def _keys(trace: Trace, step: int, rank: int) -> set[str]:
    """The view names of one (step, rank), every phase; none where a record cannot be read (a damaged
    file: ``check`` and ``diff`` report it where they read it)."""
    out: set[str] = set()
    try:
        for ph in trace.phases(step, rank):
            out.update(trace.record(step, rank, ph).keys())
    except (*MALFORMED, TraceError):
        pass
    return out


def _sample(steps: list[int]) -> list[int]:
    if len(steps) <= 2 * _SAMPLE_STEPS + 1:
        return steps
    return steps[:_SAMPLE_STEPS] + [steps[len(steps) // 2]] + steps[-_SAMPLE_STEPS:]


def _names(trace: Trace) -> set[str]:
    return {k for r in trace.ranks for s in _sample(list(trace.rank_steps(r))) for k in _keys(trace, s, r)}


def _records_anywhere(trace: Trace, view: str) -> bool:
    return any(view in _keys(trace, s, r) for r in trace.ranks for s in trace.rank_steps(r))


def one_sided_views(a: Trace, b: Trace, *,
                    ignore: frozenset[str] | set[str] = frozenset()) -> tuple[set[str], list[str]]:
    """(the view names one run records and the other never does, one note per name); names in
    ``ignore`` (never compared anyway) are left out."""
    na, nb = _names(a) - set(ignore), _names(b) - set(ignore)
    views, notes = set(), []
    for view, has, lacks, side in sorted([(v, "b", a, "a") for v in nb - na] + [(v, "a", b, "b") for v in na - nb]):
        if not _records_anywhere(lacks, view):
            views.add(view)
            notes.append(f"{view}: recorded only in run {has}; run {side} never records it (an older or another "
                         "producer): not compared")
    return views, notes
