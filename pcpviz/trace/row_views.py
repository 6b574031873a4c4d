"""A record's rows as arrays, for the reader (``reader.Trace``): a row that does not fit the fast
path (a string row, or a numeric one whose bytes do not fit its dtype and shape) decoded on its
own (``decode_row``), a phase's rows decoded when read (``LazyViews``: ``Trace.lazy_record``),
and a phase's view names by layout (``view_names_of``).

A ``target`` phase of ``req_ids`` str[2] and ``positions`` int64[4]: ``LazyViews`` checks both
rows' crc32s when made and decodes ``req_ids`` (its JSON) only when ``views["req_ids"]`` is read;
``positions`` is then a read-only view of the mapped file.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from typing import Any, Iterator, Mapping

import numpy as np

from . import schema as S
from .batches import phase_rows, row_plan
from .errors import TraceError
from .index import RankIndex

__all__ = ["decode_row", "LazyViews", "view_names_of"]


_NAMES: dict[tuple[int, str], tuple[Any, frozenset[str]]] = {}


def view_names_of(layout, phase: str) -> frozenset[str]:
    """``phase``'s view names in ``layout``, made once per layout (steps recording the same views
    share one ``Layout``; the layout is held beside its entry, so an id is not reused under it)."""
    got = _NAMES.get((id(layout), phase))
    if got is None or got[0] is not layout:
        if len(_NAMES) >= 4096:
            _NAMES.clear()
        got = _NAMES[(id(layout), phase)] = (layout, frozenset(phase_rows(layout, phase)))
    return got[1]


_STRINGS: OrderedDict[tuple, np.ndarray] = OrderedDict()
_STRINGS_MAX = 4096
"""Decoded string rows by (tag, shape, bytes): request ids repeat step after step, and parsing
their JSON is the costliest part of a small row; a verified payload's bytes give one array."""


def decode_row(ix: RankIndex, layout, j: int, *, step: int, shape: tuple[int, ...], stored: np.ndarray) -> np.ndarray:
    """Row ``j`` of a batch of ``layout`` at ``step`` as an array (``stored``: its payload bytes,
    ``shape``: its index's): a numeric row whose bytes fit its dtype and shape is ``stored`` viewed
    as them (zero-copy, read-only); a string row, or one that does not fit, goes through
    ``schema.decode_payload`` (which says what is wrong; a string row's array is remembered by
    its bytes, ``_STRINGS``)."""
    dt = layout.dtypes[j]
    if dt is not None:
        nbytes = math.prod(shape) * dt.itemsize
        if stored.shape[0] == S.padded_size(nbytes):
            return stored[:nbytes].view(dt).reshape(shape)
    key = (layout.tags[j], shape, stored.tobytes()) if dt is None and stored.shape[0] <= 4096 else None
    if key is not None and key in _STRINGS:
        return _STRINGS[key]
    try:
        value = S.decode_payload(layout.tags[j], shape, stored)
    except ValueError as exc:
        raise TraceError(f"{ix.path}: step {step}: view {layout.views[j]!r} (phase {layout.phase_of[j]!r}): "
                         f"{exc}") from None
    if key is not None:
        _STRINGS[key] = value
        if len(_STRINGS) > _STRINGS_MAX:
            _STRINGS.popitem(last=False)
    return value


class LazyViews(Mapping[str, np.ndarray]):
    """The views of one phase of one step, each decoded on first read; every row's crc32 is
    checked when made (a damaged payload raises ``TraceError`` whether or not it is read)."""

    def __init__(self, ix: RankIndex, i: int, phase: str, *, check_unread: bool = True) -> None:
        self._ix, self._loaded, self._layout = ix, ix.batch(i), ix.layouts[i]
        self._step, self._phase = int(ix.steps[i]), phase
        loaded, layout = self._loaded, self._layout
        self._rows = phase_rows(layout, phase)
        self._done: dict[str, np.ndarray] = {}
        self._heads, self._wants = row_plan(layout, loaded.shapes)  # per row: crc32 head, numeric size
        self._checked = check_unread
        if check_unread:
            for j in layout.phases[phase]:
                self._check(j)

    def _check(self, j: int) -> None:
        loaded = self._loaded
        if zlib.crc32(loaded.mv[loaded.offsets[j]:loaded.offsets[j + 1]],
                      zlib.crc32(self._heads[j], loaded.step_crc)) != loaded.crcs[j]:
            raise TraceError(f"{self._ix.path}: step {self._step}: view {self._layout.views[j]!r} "
                             f"(phase {self._phase!r}): corrupt data (crc32 mismatch)")

    def __getitem__(self, name: str) -> np.ndarray:
        value = self._done.get(name)
        if value is None:
            j, loaded = self._rows[name], self._loaded
            if not self._checked:
                self._check(j)
            start, stop = loaded.offsets[j], loaded.offsets[j + 1]
            if stop - start == self._wants[j]:  # a numeric row that fits: a view of the map, as _decode's
                value = np.ndarray(loaded.shapes[j], self._layout.dtypes[j], loaded.u8, start)
            else:
                value = decode_row(self._ix, self._layout, j, step=self._step, shape=loaded.shapes[j],
                                   stored=loaded.u8[start:stop])
            self._done[name] = value
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, name: object) -> bool:
        return name in self._rows

    def get(self, name: str, default: Any = None) -> Any:  # Mapping's catches the KeyError of a miss
        return self[name] if name in self._rows else default
