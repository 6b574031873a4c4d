"""Make a plotly ``FigureWidget`` show a figure spec, sending only what changed.

Plotly validates every property set on a ``FigureWidget`` in Python (``fw.layout = ...``,
``trace.update(...)``), and that validation — not the data — is what a control change used to
spend most of its time on: replacing the whole layout and restyling every trace property cost
30-45 ms per view on a PCP=8 step, a shape or annotation about 1 ms each. The specs the
Workbench pushes are plotly-valid by construction (``tests/views/test_workbench.py`` validates every
figure of the shipped trace with ``pcpviz.views.figures.validate_figure``), and the views of
consecutive steps share most of their properties (axes, template, colorscales, legends).
So ``push_spec`` compares the new spec with the one the widget shows and sends only the trace
properties and top-level layout keys that differ, through ``FigureWidget.plotly_update`` — the
one message ``batch_update`` would send, without re-validating the values.

A PCP=2 example: moving the Workbench from step 0 to step 1 of ``cpu-pcp2-mtp2`` changes the
token-order lanes (``z``, ``x``, ``text``, ``hovertext``...), the title, the subplot titles
(``annotations``) and the rank boundaries (``shapes``); its template, legend, margins and axis
domains are not sent again.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.basedatatypes import Undefined  # plotly_update's "leave this trace's value"

__all__ = ["same", "push_spec"]


def same(a: Any, b: Any) -> bool:
    """Deep equality of figure values: dicts, lists, tuples, NumPy arrays (NaN equals NaN) and
    scalars. ``same([[1.0, None]], np.array([[1.0, None]], dtype=object))`` is True."""
    if a is b:
        return True
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        try:
            x, y = np.asarray(a), np.asarray(b)
        except ValueError:  # a ragged list against an array
            return False
        if x.shape != y.shape:
            return False
        if x.dtype.kind in "fc" and y.dtype.kind in "fc":
            return bool(np.array_equal(x, y, equal_nan=True))
        if x.dtype.kind == "O" or y.dtype.kind == "O":
            return all(same(u, v) for u, v in zip(x.ravel().tolist(), y.ravel().tolist()))
        return bool(np.array_equal(x, y))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return False
        return all(same(u, v) for u, v in zip(a, b))
    if isinstance(b, (dict, list, tuple)):
        return False
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _key_set(trace: dict) -> frozenset:
    return frozenset(k for k in trace if k != "uid")


def push_spec(fw: go.FigureWidget, spec: dict, shown: dict | None, *, width: int | None = None) -> dict:
    """Make ``fw`` show ``spec`` (``{"data": [trace dicts], "layout": {...}}``) and return the spec
    it now shows (to pass as ``shown`` next time).

    ``shown`` is what ``fw`` shows now — the value the previous call returned — or None (then
    everything is sent, validated). With the same trace structure (count, types and property
    names) only the trace properties that differ are restyled; otherwise the traces are
    replaced (validated). Only the top-level layout keys that differ are sent (each replaced
    whole, so nothing stale survives inside an axis or the shapes), and keys ``shown`` had that
    ``spec`` lacks are cleared. ``spec`` is not modified (the Workbench caches specs).
    """
    data = list(spec["data"])
    layout = {"shapes": [], "annotations": [], **spec["layout"]}
    if width:
        layout["width"] = width
    new_shown = {"data": data, "layout": layout}
    old_data = shown["data"] if shown is not None else None
    if shown is None or not (len(old_data) == len(data) == len(fw.data) and all(
            o.get("type") == n.get("type") and _key_set(o) == _key_set(n) for o, n in zip(old_data, data))):
        with fw.batch_update():
            fw.data = ()
            fw.add_traces(data)
            fw.layout = layout
        return new_shown
    indexes, changes = [], []
    for i, (o, n) in enumerate(zip(old_data, data)):
        changed = {k: v for k, v in n.items() if k != "type" and not same(o.get(k), v)}
        if changed:
            indexes.append(i)
            changes.append(changed)
    props = sorted({k for c in changes for k in c})
    restyle = {k: [c.get(k, Undefined) for c in changes] for k in props}
    old = shown["layout"]
    relayout = {k: v for k, v in layout.items() if k not in old or not same(old[k], v)}
    relayout.update({k: None for k in old if k not in layout})
    if restyle or relayout:
        fw.plotly_update(restyle_data=restyle, relayout_data=relayout, trace_indexes=indexes)
    # plotly_update writes the new values into the figure's dicts; drop the property objects
    # plotly cached over the old ones (an annotations tuple keeps its old length otherwise)
    for obj, keys in [(fw.layout, relayout), *((fw.data[i], c) for i, c in zip(indexes, changes))]:
        for k in keys:
            obj._compound_props.pop(k, None)
            obj._compound_array_props.pop(k, None)
    return new_shown
