"""A recorded step in transit: one byte buffer plus a small descriptor, and back to NumPy views.

The vLLM plugin's hooks copy a step's device tensors into one flat buffer (``recording.host``);
what reaches the host is that buffer and a descriptor naming, for every view, where its bytes are
or how it is made from them. ``resolve`` turns the pair back into ``{phase: {view: ndarray}}``,
the ``TraceWriter``'s input. Torch-free: the writer process (``pcpviz.trace.procwriter``) and the
inline writer run the same code, so a trace is the same whichever wrote it.

A descriptor is ``((phase, ((view, entry), ...)), ...)``; an entry is a tuple, its first item a tag:

===========================================  ==================================================
entry                                        the view
===========================================  ==================================================
``("b", offset, dtype, shape)``              ``buf[offset:]`` as ``dtype[shape]`` (a copy);
                                             dtype ``"bf16"``: bfloat16 bits, widened to float32
``("a", dtype, shape, data)``                a host array sent as its bytes
``("v", value)``                             ``value`` as it is (scalars, structured arrays)
``("s", strings)``                           ``np.array(strings, dtype=str)``
``("d", fn, args, index)``                   output ``index`` of ``DERIVED[fn](*args)`` (each
                                             arg an entry; the same ``args`` object is
                                             computed once per step and place)
``("p", offset, dtype, shape)``              a planned copy's view (``recording.replayplan``):
                                             ``("b", base + offset, dtype, shape)``, ``base``
                                             the copy's place in the step (``placed``)
===========================================  ==================================================

``placed`` (``resolve``'s third argument) says where each planned copy landed in the step:
``((phase, (view, ...), base), ...)``; a view it names reads its ``"p"`` entries (also inside
``"d"`` arguments) at ``base``. The recording process sends it beside the descriptor, so the
entries shared by every step that replays a plan cross unchanged, and nothing rewrites them on
the way.

A batch-1 verify phase: ``sampled_token_ids`` ``("d", "verify", (S, N, J), 0)`` with ``S = ("b",
0, "<i8", (1, 3))``, the raw ``int64[1, 3]`` row, ``N`` / ``J`` the raw ``num_sampled`` /
``num_rejected``; resolved it is the row with ``-1`` past ``num_sampled``.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .fingerprints import row_fingerprints_host, row_fingerprints_host_at

__all__ = ["resolve", "DERIVED", "block_rows", "verify_views", "trim_block_tables", "host_entry"]


def block_rows(*args: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(table_0, ..., table_{G-1}, num_blocks, idx_mapping)`` -> ``(rows int[G, rows, W], stale
    int64 scalar)``: vLLM's gathered block-table rows with every entry past the request's
    ``num_blocks`` zeroed (``_gather_block_tables_kernel`` leaves the previous occupant's there;
    attention never reads past ``num_blocks``); ``stale`` counts the non-zero entries dropped.
    ``num_blocks`` is the whole ``int32[G, max_num_reqs]`` table, ``idx_mapping`` the rows' requests
    (a negative index reads request 0). Block size 4, 2 blocks, row ``[7, 9, 4, 0]``: ``[7, 9, 0, 0]``,
    stale 1.

        >>> rows, stale = block_rows(np.array([[7, 9, 4, 0]]), np.array([[2]]), np.array([0]))
        >>> rows.tolist(), int(stale)
        ([[[7, 9, 0, 0]]], 1)
    """
    *tables, num_blocks, idx = args
    rows = np.stack(tables)  # int[G, rows, W]
    n = min(rows.shape[1], idx.shape[0])
    nb = np.zeros(rows.shape[:2], dtype=np.int64)  # int64[G, rows]
    if n:
        nb[:, :n] = num_blocks[:, np.maximum(idx[:n], 0)]
    tail = np.arange(rows.shape[2]).reshape(1, 1, -1) >= nb[..., None]  # bool[G, rows, W]
    stale = np.asarray(np.count_nonzero((rows != 0) & tail), dtype=np.int64)
    rows[tail] = 0
    return rows, stale


def verify_views(sampled: np.ndarray, num_sampled: np.ndarray, num_rejected: np.ndarray) -> tuple[np.ndarray, ...]:
    """vLLM's ``postprocess_sampled`` arguments -> ``(sampled_token_ids, num_sampled, num_rejected,
    num_accepted)``: the rows ``int[R, K+1]`` with ``-1`` past ``num_sampled`` (vLLM writes only
    the first ``num_sampled[i]``; on a GPU the rest is whatever the buffer held), the counts as
    int64, ``num_accepted = max(num_sampled - 1, 0)``.

        >>> s, n, j, a = verify_views(np.array([[5, 6, 8]]), np.array([2]), np.array([1]))
        >>> s.tolist(), a.tolist()
        ([[5, 6, -1]], [1])
    """
    ns = num_sampled.astype(np.int64)  # int64[R]
    out = sampled.copy()
    out[np.arange(out.shape[-1]).reshape(1, -1) >= ns[:, None]] = -1
    return out, ns, num_rejected.astype(np.int64), np.maximum(ns - 1, 0)


def take_rows(table: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray]:
    """A request-state table's rows for the batch: ``table[idx]`` as int64, ``-1`` where ``idx``
    is masked (negative) or past the table (vLLM's ``post_update`` skips such a row).

        >>> take_rows(np.array([7, 9, 4], dtype=np.int32), np.array([2, -1, 0]))[0].tolist()
        [4, -1, 7]
    """
    idx = np.asarray(idx).astype(np.int64)
    out = np.full(idx.shape, -1, dtype=np.int64)
    ok = (idx >= 0) & (idx < table.shape[0])
    out[ok] = table[idx[ok]]
    return (out,)


def _columns(t: np.ndarray) -> tuple[np.ndarray, ...]:
    return tuple(np.ascontiguousarray(t[:, k]) for k in range(t.shape[1]))


def _stack(*ts: np.ndarray) -> tuple[np.ndarray]:
    return (np.stack(ts),)


def _segments(rows: list) -> tuple[np.ndarray]:
    from .schema import segments_table

    return (segments_table(rows),)


DERIVED: dict[str, Callable[..., tuple]] = {"block_rows": block_rows, "verify": verify_views,
                                             "columns": _columns, "stack": _stack, "segments": _segments,
                                             "take_rows": take_rows,
                                             "row_fp": row_fingerprints_host,
                                             "row_fp_at": row_fingerprints_host_at}
"""The host-side computations a ``("d", ...)`` entry may name (``columns``: output k is column k)."""


_DTYPE_STR: dict[np.dtype, str | None] = {}
"""A dtype's ``str`` where its arrays are kept by their bytes, None where not (``host_entry``)."""


def host_entry(value: Any) -> tuple:
    """The entry of a host value: numbers and strings by their bytes, anything else as it is."""
    if isinstance(value, np.ndarray):
        dt = value.dtype
        ds = _DTYPE_STR.get(dt, False)
        if ds is False:
            ds = dt.str if dt.fields is None and dt.kind in "biufcUS" else None
            if len(_DTYPE_STR) < 256:
                _DTYPE_STR[dt] = ds
        if ds is not None:
            return ("a", ds, value.shape, value.tobytes())
    return ("v", value)


def int64_entry(value: int) -> tuple:
    """``host_entry(np.array(value, dtype=np.int64))`` without the array (a hook's timestamps).

    >>> int64_entry(5) == host_entry(np.array(5, dtype=np.int64))
    True
    """
    return ("a", "<i8", (), int(value).to_bytes(8, "little", signed=True))


def _array(buf: np.ndarray, offset: int, dtype: str, shape: tuple) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == "bf16":
        bits = np.frombuffer(buf, dtype=np.uint16, count=n, offset=offset).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(buf, dtype=dtype, count=n, offset=offset).reshape(shape).copy()


def _value(entry: Any, buf: np.ndarray | None, cache: dict[tuple, tuple], base: int | None = None) -> Any:
    if not isinstance(entry, tuple):
        return entry  # a host value put straight into the phase (an ndarray)
    tag = entry[0]
    if tag == "b":
        return _array(buf, entry[1], entry[2], entry[3])
    if tag == "p":
        if base is None:
            raise ValueError("a planned entry with no place in the step (placed does not name its view)")
        return _array(buf, base + entry[1], entry[2], entry[3])
    if tag == "a":
        n = int(np.prod(entry[2], dtype=np.int64))
        return np.frombuffer(entry[3], dtype=entry[1], count=n).reshape(entry[2]).copy()
    if tag == "v":
        return entry[1]
    if tag == "s":
        return np.array(entry[1], dtype=str)
    if tag == "d":
        _, fn, args, index = entry
        key = (id(args), base)  # one plan replayed twice in a step: the same args at two places
        if key not in cache:
            cache[key] = (args, DERIVED[fn](*(_value(a, buf, cache, base) for a in args)))
        return cache[key][1][index]
    raise ValueError(f"unknown entry tag {tag!r}")


def resolve(phases: Any, buf: np.ndarray | None, placed: Any = ()) -> dict[str, dict[str, Any]]:
    """``{phase: {view: entry}}`` (or the descriptor's tuple form) and the step's bytes ``buf``
    (uint8, or None when no entry points into it) -> ``{phase: {view: ndarray}}``; ``placed``:
    where the planned copies landed (see the module doc)."""
    cache: dict[tuple, tuple] = {}  # (id(args), base) -> (args, outputs); args kept alive while in use
    bases = {(phase, view): base for phase, views, base in placed for view in views}
    items = phases.items() if isinstance(phases, dict) else phases
    out: dict[str, dict[str, Any]] = {}
    for phase, views in items:
        res = out[phase] = {}
        for view, entry in (views.items() if isinstance(views, dict) else views):
            res[view] = _value(entry, buf, cache, bases.get((phase, view)))
    return out


_BT_PREFIX = "block_table"  # block_table_global / _local / _draft (and the replay's *_no_gather)


def trim_block_tables(phases: dict[str, dict[str, Any]]) -> None:
    """Cut every block-table view of a step to the columns any of them uses (the rest are
    zeros in all of them): vLLM's rows are ``max_model_len / block_size`` wide."""
    tables = [(ph, v) for ph, views in phases.items() for v, a in views.items()
              if v.startswith(_BT_PREFIX) and isinstance(a, np.ndarray) and a.ndim >= 2 and a.dtype.kind in "iu"]
    if not tables:
        return
    width = 1
    for ph, v in tables:
        a = phases[ph][v]
        cols = np.flatnonzero(a.reshape(-1, a.shape[-1]).any(axis=0))
        if cols.size:
            width = max(width, int(cols[-1]) + 1)
    for ph, v in tables:
        phases[ph][v] = np.ascontiguousarray(phases[ph][v][..., :width])
