"""The value codec of a trace row: a view's array <-> (dtype tag, shape, stored bytes), and the
crc32s that guard a row and a step's index (the layout they fill is in ``schema``).

    >>> e = encode_value(np.arange(3, dtype=np.int64))
    >>> e.tag, e.shape, len(e.payload)
    ('<i8', (3,), 24)
    >>> decode_payload(e.tag, e.shape, bytes(e.payload)).tolist()
    [0, 1, 2]
"""

from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable

import numpy as np

from .jsonlimits import loads_bounded

__all__ = [
    "ALIGN", "STR_TAG", "STRUCT_PREFIX", "Encoded", "encode_value", "parse_dtype_tag", "padded_size",
    "row_crc32", "step_crc32", "decode_payload", "check_shape",
]

ALIGN = 8
"""Stored payloads are padded to a multiple of this, keeping every payload aligned."""

STR_TAG = "str"
STRUCT_PREFIX = "struct:"
_NUMERIC_KINDS = "biufc"
_SIMPLE_TAG_RE = re.compile(r"^[<|][biufc][0-9]+$")


# --------------------------------------------------------------------------- value codec

@dataclass(frozen=True)
class Encoded:
    """One view ready to store: dtype tag, shape, and the unpadded payload bytes."""

    tag: str
    shape: tuple[int, ...]
    payload: memoryview  # uint8[nbytes]


def _flat_items(value: Any) -> Iterable[Any]:
    if isinstance(value, np.ndarray):
        yield from value.ravel().tolist()
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat_items(v)
    else:
        yield value


def _check_struct_fields(dt: np.dtype) -> None:
    for name in dt.names:
        sub = dt.fields[name][0]
        base = sub.subdtype[0] if sub.subdtype else sub
        if base.names is not None:
            _check_struct_fields(base)
        elif base.kind not in _NUMERIC_KINDS:
            raise ValueError(f"structured field {name!r} has dtype {base.str!r}; "
                             "only int/uint/float/bool/complex fields are supported")


_FAST_TAGS: dict[np.dtype, str] = {}  # native little-endian numeric dtypes seen -> their tag


def encode_value(value: Any) -> Encoded:
    """Encode a view value (array-like) for storage; ValueError says what is not supported.

    A C-contiguous array of a little-endian numeric dtype seen before takes a fast path (no
    conversion, no copy): the recorder's step is dozens of such views."""
    if type(value) is np.ndarray and value.flags.c_contiguous:
        tag = _FAST_TAGS.get(value.dtype)
        if tag is not None:
            return Encoded(tag, value.shape, memoryview(value.reshape(-1).view(np.uint8)))
    try:
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as exc:  # ragged lists, bfloat16/CUDA tensors
        raise ValueError(f"cannot convert {type(value).__name__} to a NumPy array "
                         f"({' '.join(str(exc).split())})") from None
    if arr.dtype.kind == "O" or (arr.dtype.kind == "U" and not isinstance(value, (str, np.ndarray))):
        # Only strings may arrive as objects; np.asarray([1, "a"]) would silently stringify 1.
        items = arr.ravel().tolist() if arr.dtype.kind == "O" else _flat_items(value)
        for x in items:
            if not isinstance(x, str):
                raise ValueError(f"holds {type(x).__name__} {x!r}; "
                                 "only arrays of str may hold Python objects")
        arr = np.array(arr.tolist(), dtype=str).reshape(arr.shape)
    shape = tuple(int(d) for d in arr.shape)
    if arr.dtype.kind == "U":
        text = json.dumps(arr.ravel().tolist(), ensure_ascii=False, separators=(",", ":"))
        return Encoded(STR_TAG, shape, memoryview(text.encode("utf-8")))
    dt = arr.dtype
    if dt.names is not None:
        _check_struct_fields(dt)
        le = dt.newbyteorder("<")
        tag = STRUCT_PREFIX + json.dumps(_struct_to_json(le), separators=(",", ":"))
    elif dt.kind in _NUMERIC_KINDS and dt.subdtype is None:
        le = dt.newbyteorder("<")
        tag = le.str
        if le == dt and len(_FAST_TAGS) < 256:
            _FAST_TAGS[dt] = tag
    else:
        raise ValueError(f"dtype {dt.str!r} is not supported "
                         "(int/uint/float/bool/complex, str, or structured)")
    flat = np.ascontiguousarray(arr.astype(le, copy=False)).reshape(-1)
    return Encoded(tag, shape, memoryview(flat.view(np.uint8)))


def _struct_to_json(dt: np.dtype) -> Any:
    """A structured dtype as JSON: NumPy's dict form (names/formats/offsets/itemsize), nested.

    The dict form keeps padding and field offsets exactly (``dtype.descr`` does not round-trip
    padding: it comes back as fields named ``f1``...). Subarray fields are ``{"sub", "shape"}``.
    """
    if dt.subdtype is not None:
        return {"sub": _struct_to_json(dt.subdtype[0]), "shape": list(dt.subdtype[1])}
    if dt.names is not None:
        return {"names": list(dt.names),
                "formats": [_struct_to_json(dt.fields[n][0]) for n in dt.names],
                "offsets": [int(dt.fields[n][1]) for n in dt.names],
                "itemsize": int(dt.itemsize)}
    return dt.str


def _struct_from_json(obj: Any) -> np.dtype:
    if isinstance(obj, str):
        if not _SIMPLE_TAG_RE.match(obj):
            raise ValueError(obj)
        return np.dtype(obj)
    if set(obj) == {"sub", "shape"}:
        return np.dtype((_struct_from_json(obj["sub"]), tuple(int(d) for d in obj["shape"])))
    if set(obj) != {"names", "formats", "offsets", "itemsize"}:
        raise ValueError(obj)
    return np.dtype({"names": [str(n) for n in obj["names"]],
                     "formats": [_struct_from_json(f) for f in obj["formats"]],
                     "offsets": [int(o) for o in obj["offsets"]],
                     "itemsize": int(obj["itemsize"])})


@lru_cache(maxsize=4096)
def parse_dtype_tag(tag: str) -> np.dtype | None:
    """NumPy dtype of a stored tag (None for ``"str"``); ValueError if not understood."""
    if tag == STR_TAG:
        return None
    try:
        if tag.startswith(STRUCT_PREFIX):
            dt = _struct_from_json(loads_bounded(tag[len(STRUCT_PREFIX):]))
            if dt.names is None:
                raise ValueError
            _check_struct_fields(dt)
            return dt
        if _SIMPLE_TAG_RE.match(tag):
            dt = np.dtype(tag)
            if dt.kind in _NUMERIC_KINDS and dt.str == tag:
                return dt
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, RecursionError):
        pass
    raise ValueError(f"dtype {tag!r} not understood")


def padded_size(nbytes: int) -> int:
    """Stored size of a payload of ``nbytes`` (rounded up to ``ALIGN``)."""
    return -(-nbytes // ALIGN) * ALIGN


def row_crc32(step: int, phase: str, view: str, *, tag: str, shape: tuple[int, ...], stored) -> int:
    """crc32 of a row: its identity, type, shape and stored (padded) bytes."""
    head = f"{step}\0{phase}\0{view}\0{tag}\0{','.join(map(str, shape))}\0".encode("utf-8")
    return zlib.crc32(stored, zlib.crc32(head)) & 0xFFFFFFFF


def step_crc32(step: int, rows: Iterable[tuple[str, str, str, Any, int, int]]) -> int:
    """crc32 of a step's index: every row's (phase, view, dtype tag, shape, stored size, row
    crc32), in order."""
    rows = list(rows)
    crc = zlib.crc32(f"{step}\0{len(rows)}\0".encode("utf-8"))
    for phase, view, tag, shape, size, row_crc in rows:
        crc = zlib.crc32(f"{phase}\0{view}\0{tag}\0{','.join(map(str, shape))}\0{size}\0"
                         f"{row_crc}\0".encode("utf-8"), crc)
    return crc & 0xFFFFFFFF


def decode_payload(tag: str, shape: tuple[int, ...], stored) -> np.ndarray:
    """The array a row holds; ``stored`` is its (padded) bytes. Read-only, zero-copy if numeric.

    Raises ValueError when the bytes do not fit the dtype and shape.
    """
    dt = parse_dtype_tag(tag)
    count = math.prod(shape)
    if dt is None:
        try:  # depth-guarded: a payload nested 100,000 deep is refused, never recursed into
            items = loads_bounded(bytes(stored).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, nested too deeply
            raise ValueError(f"string payload is not JSON ({' '.join(str(exc).split())[:200]})") from None
        if not isinstance(items, list) or len(items) != count or not all(isinstance(x, str) for x in items):
            raise ValueError(f"string payload is not a list of {count} strings")
        out = np.array(items, dtype=str) if items else np.empty(0, dtype="<U1")
        out = out.reshape(shape)
    else:
        nbytes = count * dt.itemsize
        if len(stored) != padded_size(nbytes):
            raise ValueError(f"{len(stored)} stored bytes do not fit {tag} {list(shape)} "
                             f"({nbytes} bytes)")
        out = np.frombuffer(stored, dtype=dt, count=count).reshape(shape)
    out.flags.writeable = False
    return out


def check_shape(shape: Any) -> tuple[int, ...]:
    """A stored shape as a tuple of non-negative ints; ValueError otherwise."""
    shape = tuple(shape) if isinstance(shape, (list, tuple)) else None
    if shape is None or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"shape {shape!r} is not a list of non-negative ints")
    return shape
