"""A digest of what a figure is drawn from, so that equal inputs are drawn once (``content_key``).

The HTML report draws each (step, rank) page's panels; at PCP=64 the token-order and slot-mapping
figures of a step read only the step's global views, the same on every rank, and cost most of a
page. A panel that can say what it reads (``pcpviz.views.panels.Panel.shared_key``) is drawn once
per distinct digest of those inputs and each rank's page derives its figure from that one.

The digest covers values, not identities: two arrays are the same input when their dtype, shape
and bytes are (an object array by its items), two ``StepLayout``s when every field is; strings,
numbers, ``None``, tuples, lists and mappings (in their order) by value and type, so ``1``,
``1.0``, ``True`` and ``"1"`` differ::

    content_key(np.arange(3), "req0") == content_key(np.arange(3), "req0")      # True
    content_key(np.arange(3), "req0") == content_key(np.arange(3.0), "req0")    # False: dtype
    content_key([1, 2]) == content_key((1, 2))                                  # False: type
"""

from __future__ import annotations

import dataclasses
from hashlib import blake2b
from typing import Any, Mapping

import numpy as np

__all__ = ["content_key"]


def content_key(*parts: Any) -> str:
    """A 128-bit BLAKE2b hex digest of ``parts`` by value (see the module doc); a value of another
    type raises ``TypeError`` (the caller then draws without sharing)."""
    h = blake2b(digest_size=16)
    _feed(h, parts)
    return h.hexdigest()


def _feed(h: Any, v: Any) -> None:
    t = type(v)
    if v is None:
        h.update(b"N;")
    elif t is bool:
        h.update(b"B1;" if v else b"B0;")
    elif t is int:
        h.update(b"I%d;" % v)
    elif t is float:
        h.update(b"F" + float.hex(v).encode() + b";")
    elif t is str:
        b = v.encode("utf-8", "surrogatepass")
        h.update(b"S%d:" % len(b))
        h.update(b)
    elif t is tuple or t is list:
        h.update(b"T%d(" % len(v) if t is tuple else b"L%d(" % len(v))
        for x in v:
            _feed(h, x)
    elif isinstance(v, np.ndarray):
        _feed_array(h, v)
    elif isinstance(v, np.generic):
        h.update(b"G" + repr(v.dtype).encode() + b":")
        _feed_array(h, np.asarray(v))
    elif isinstance(v, Mapping):
        h.update(b"M%d(" % len(v))
        for k, x in v.items():
            _feed(h, k)
            _feed(h, x)
    elif dataclasses.is_dataclass(v) and not isinstance(v, type):
        h.update(b"C" + type(v).__qualname__.encode() + b"(")
        for f in dataclasses.fields(v):
            _feed(h, getattr(v, f.name))
    else:
        raise TypeError(f"content_key: a {t.__name__} has no content key")


def _feed_array(h: Any, a: np.ndarray) -> None:
    h.update(b"A" + repr(a.dtype).encode() + repr(a.shape).encode() + b":")
    if a.dtype.kind == "O":
        _feed(h, a.ravel().tolist())
    else:
        h.update(np.ascontiguousarray(a).tobytes())

