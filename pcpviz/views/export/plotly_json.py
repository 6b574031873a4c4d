"""A figure spec as the JSON values plotly.js reads, without building a ``go.Figure``.

The HTML report embeds hundreds of figures. Building each as a ``go.Figure`` and encoding it
with ``plotly.io.to_json`` deep-copies it twice and walks it three times; on a PCP=64 report
that was most of the export. ``figure_json`` walks a spec (``{"data": [...], "layout": {...}}``
of plain dicts, lists and NumPy arrays, as ``pcpviz.views.figures`` builds them) once and gives
what ``json.loads(plotly.io.to_json(go.Figure(spec, _validate=False), validate=False,
remove_uids=True))`` gives (a test holds the two equal on real traces):

* a numeric array becomes plotly.js's typed-array object, ``{"dtype", "bdata"}`` (base64 of
  its bytes) and ``"shape"`` when it has more than one axis; int64 is narrowed to the smallest
  of int8/16/32 that holds it, else written as a list (plotly.js has no 64-bit integers);
* other arrays (strings, objects: hover texts) and tuples become lists;
* NaN and infinities become ``null``; NumPy scalars become numbers;
* ``uid`` is dropped from traces; values under ``range`` (and ``geojson``, ``layer``,
  ``layers``) stay plain lists, as plotly leaves them;
* a layout without a ``template`` gets none (``go.Figure`` would add plotly's default one, tens
  of kB; every pcpviz figure names its own small ``canvas.TEMPLATE``).

``figure_json({"data": [{"type": "bar", "x": np.array([1, 2])}], "layout": {}})`` is
``{"data": [{"type": "bar", "x": {"dtype": "i1", "bdata": "AQI="}}], "layout": {}}``.
"""

from __future__ import annotations

import base64
import math
from typing import Any, Container

import numpy as np

__all__ = ["figure_json"]

_SHORT = {"int8": "i1", "uint8": "u1", "int16": "i2", "uint16": "u2", "int32": "i4", "uint32": "u4",
          "float32": "f4", "float64": "f8"}
_NARROW = {"int64": ("int8", "int16", "int32"), "uint64": ("uint8", "uint16", "uint32")}
_PLAIN_KEYS = frozenset({"geojson", "layer", "layers", "range"})
_AS_IS = frozenset({str, int, bool, type(None)})
_NUMBERS = frozenset({int, float, bool})


def _typed(a: np.ndarray) -> Any:
    """A numeric array as plotly.js's typed-array object (or a list where it has none)."""
    if a.size == 0:
        return []
    name = a.dtype.name
    if name in _NARROW:
        lo, hi = a.min(), a.max()
        name = next((n for n in _NARROW[name] if np.iinfo(n).min <= lo and hi <= np.iinfo(n).max), None)
        if name is None:
            return _value(a.tolist())
        a = a.astype(name)
    if name not in _SHORT:
        return _value(a.tolist())
    out = {"dtype": _SHORT[name], "bdata": base64.b64encode(np.ascontiguousarray(a)).decode("ascii")}
    if a.ndim > 1:
        out["shape"] = ", ".join(map(str, a.shape))
    return out


def _value(v: Any, key: str | None = None) -> Any:
    t = type(v)
    if t is str or t is int or t is bool or v is None:
        return v
    if t is float:
        return v if math.isfinite(v) else None
    if t is dict:
        return {k: _value(x, k) for k, x in v.items()}
    if t is list or t is tuple:
        kinds = set(map(type, v))
        if kinds <= _AS_IS:  # strings, integers, booleans and nulls alone (most hover rows): as they are
            return list(v)
        if kinds <= _NUMBERS and all(map(math.isfinite, v)):  # finite numbers alone (coordinates)
            return list(v)
        return [_value(x) for x in v]
    if isinstance(v, np.ndarray):
        if v.dtype.kind in "iuf" and key not in _PLAIN_KEYS:
            return _typed(v)
        return _value(v.tolist())
    if isinstance(v, np.generic):
        return _value(v.item())
    if isinstance(v, dict):
        return {k: _value(x, k) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_value(x) for x in v]
    raise TypeError(f"figure_json: a {t.__name__} is not a figure value")


def figure_json(spec: dict, *, memo: dict | None = None, only: Container[int] | None = None) -> dict:
    """``spec`` as JSON values (see the module doc); the spec is left as it was.

    ``memo`` (a dict kept between calls): a container (dict, list, tuple, array) converted before
    gives the same JSON object again, not a new one, so that figures sharing parts share their JSON
    (and ``jsonpack.pack`` walks a shared part once). It keeps what it holds alive; the JSON objects
    must then be left as they are. ``a = figure_json(s, memo=m); figure_json({**s}, memo=m)["layout"]
    is a["layout"]``. ``only``: the ids of the containers the memo keeps (the others are converted
    each time, and not kept alive)."""
    if memo is None:
        data = [{k: _value(x, k) for k, x in trace.items() if k != "uid"} for trace in spec.get("data", ())]
        return {"data": data, "layout": _value(spec.get("layout", {}))}
    data = [_remembered(trace, None, memo, trace=True, only=only) for trace in spec.get("data", ())]
    return {"data": data, "layout": _remembered(spec.get("layout", {}), None, memo, only=only)}


_CONTAINERS = (dict, list, tuple, np.ndarray)


def _remembered(v: Any, key: str | None, memo: dict, *, trace: bool = False, only: Container[int] | None) -> Any:
    """``_value(v, key)`` (a trace's, without its ``uid``, where ``trace``), or the one made before
    for this very ``v`` where there is one (``memo``: ``(id, plain, trace) -> (v, json)``, ``plain``
    whether ``key`` keeps arrays as lists; only ``v``s whose id is in ``only``, when given); a dict's
    values and a list's items are looked up alike."""
    if not isinstance(v, _CONTAINERS):
        return _value(v, key)
    k = (id(v), key in _PLAIN_KEYS, trace) if only is None or id(v) in only else None
    hit = None if k is None else memo.get(k)
    if hit is not None:
        return hit[1]
    if trace or type(v) is dict:
        out = {n: _remembered(x, n, memo, only=only) for n, x in v.items() if not (trace and n == "uid")}
    elif (type(v) is list or type(v) is tuple) and any(isinstance(x, _CONTAINERS) for x in v):
        out = [_remembered(x, None, memo, only=only) for x in v]
    else:
        out = _value(v, key)
    if k is not None:
        memo[k] = (v, out)
    return out
