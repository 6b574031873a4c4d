"""The pcpviz trace schema: names (phases, views), the on-disk layout, and the value codec.

A run is a directory::

    run/
      run.json       {"pcpviz_trace_schema": 1, "producer": ..., "pcp": 2, ...}  (any JSON dict)
      rank0.arrow    Arrow IPC *stream*: schema header, then one record batch per engine step
      rank1.arrow    ...

Each rank file is an Arrow IPC stream whose schema metadata carries ``pcpviz_trace_schema`` (the
version, as text) and ``rank``. Every completed engine step is **one record batch** with one row
per (phase, view)::

    step   phase     view         dtype          shape   data                crc32       step_crc32
    int64  string    string       string         list    large_binary        uint32      uint32
    7      "target"  "positions"  "<i8"          [12]    96 raw bytes        0x1c0ffee5  0x5eed0007
    7      "target"  "segments"   "struct:{..}"  [3]     3*48 raw bytes      ...         0x5eed0007
    7      "verify"  "req_ids"    "str"          [2]     b'["a","b"]     '   ...         0x5eed0007

Why this layout:

* **A step is atomic.** A record batch is one length-prefixed IPC message, handed to the kernel in
  one unbuffered ``os.write`` loop after the whole step was validated and encoded. A writer killed mid-step
  leaves a partial trailing message that the reader detects and drops; every earlier step is
  intact. No footer is needed (unlike the IPC *file* format), so the file is append-only.
* **Cheap, lazy open.** The reader memory-maps the file. Reading a batch is zero-copy, so open
  only touches the small columns (step/phase/view/dtype/shape/crc32) and the offsets of
  ``data``; payloads are decoded on demand.
* **Any view, any dtype, any ndim.** Views differ per phase and producers add new ones, so the
  views are rows, not columns (a fixed column set would need a schema change per new view).
  ``dtype`` is a tag: a little-endian NumPy type string (``"<i8"``, ``"|b1"``, ``"<f4"``),
  ``"str"`` (payload: a JSON list of the strings in C order), or ``"struct:<json dtype>"`` for
  structured arrays (the ``segments`` table). ``shape`` is the NumPy shape (``[]`` for 0-d).
* **Zero-copy decode.** Payloads are stored raw and padded to 8 bytes (zeros, or spaces after
  JSON, which JSON ignores); Arrow's IPC buffers are 8-byte aligned, so ``np.frombuffer`` gives an
  aligned read-only view of the mapped file.
* **Corruption is caught, not returned.** ``crc32`` covers the row's step, phase, view, dtype,
  shape and stored bytes; it is checked when the row is decoded (reading it on open would defeat
  laziness). ``step_crc32`` (same value on every row of the batch) covers the step's whole index
  (every row's step, phase, view, dtype, shape, size and crc32), so a damaged name, shape or a row
  moved to another phase is caught on open without reading payloads. Damage Arrow itself cannot
  parse, and index damage, are treated like a partial tail (see ``reader``).
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa

__all__ = [
    "SCHEMA_VERSION", "META_SCHEMA_KEY", "META_RANK_KEY", "RUN_META_FILE", "rank_file_name",
    "PHASE_TARGET", "PHASE_VERIFY", "PHASE_DUMMY", "DRAFT_PHASE_PREFIX", "PHASES",
    "draft_phase", "draft_index", "is_valid_phase", "phase_sort_key", "causal_phase_key",
    "GLOBAL_BATCH_VIEWS", "LAYOUT_VIEWS", "LOCAL_BATCH_VIEWS", "BLOCK_TABLE_VIEWS",
    "SLOT_MAPPING_VIEWS", "DRAFT_VIEWS", "VERIFY_VIEWS", "DIGEST_VIEWS", "VIEW_GROUPS", "VIEWS",
    "KNOWN_VIEWS", "DRAFT_VIEW_RANK_LOCAL", "DRAFT_VIEW_REPLICATED", "PAD_SLOT", "SEGMENT_DTYPE",
    "segments_table", "is_valid_view_name", "ARROW_SCHEMA", "arrow_schema",
]

# --------------------------------------------------------------------------- versions & files

SCHEMA_VERSION = 1
"""Version of this format; bumped on any change an older reader would misread."""

META_SCHEMA_KEY = "pcpviz_trace_schema"
"""Key of the schema version, in run.json and in each rank file's Arrow schema metadata."""

META_RANK_KEY = "rank"
"""Arrow schema metadata key holding the rank a file belongs to (must match its file name)."""

RUN_META_FILE = "run.json"
"""Name of the run's meta file inside the run directory."""

RANK_FILE_RE = re.compile(r"^rank(0|[1-9][0-9]*)\.arrow$")
"""File names of rank files; the number is the rank."""


def rank_file_name(rank: int) -> str:
    """``rank3.arrow`` for rank 3."""
    return f"rank{int(rank)}.arrow"


# --------------------------------------------------------------------------- phases

PHASE_TARGET = "target"
"""The target model's forward on this rank's PCP-local rows."""
PHASE_VERIFY = "verify"
"""Sampling/rejection outcome on the global batch (identical on every rank)."""
PHASE_DUMMY = "dummy"
"""A profile/dummy run: no gather, no collectives."""
DRAFT_PHASE_PREFIX = "draft_"
"""Draft step k is phase ``draft_{k}``: k=0 rank-local draft prefill, k>=1 replicated decodes."""

PHASES: dict[str, str] = {
    PHASE_DUMMY: "profile/dummy run (no gather, no collectives)",
    PHASE_TARGET: "target forward on the rank-local DualChunkSwap rows",
    "draft_<k>": "draft step k: k=0 rank-local draft prefill, k>=1 replicated draft decode",
    PHASE_VERIFY: "sampling/rejection outcome on the global batch",
}
"""The phase vocabulary with a one-line doc each (``draft_<k>`` stands for draft_0, draft_1, ...)."""

_PHASE_RE = re.compile(r"^(?:target|verify|dummy|draft_(?:0|[1-9][0-9]*))$")


def draft_phase(k: int) -> str:
    """Name of draft step ``k`` (``draft_phase(0) == "draft_0"``)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"draft step must be an int >= 0, got {k!r}")
    return f"{DRAFT_PHASE_PREFIX}{int(k)}"


def draft_index(phase: str) -> int | None:
    """k for ``draft_k``, None for any other phase."""
    if is_valid_phase(phase) and phase.startswith(DRAFT_PHASE_PREFIX):
        return int(phase[len(DRAFT_PHASE_PREFIX):])
    return None


@lru_cache(maxsize=1024)
def _valid_phase(phase: str) -> bool:
    return _PHASE_RE.match(phase) is not None


def is_valid_phase(phase: object) -> bool:
    """True for ``target``, ``verify``, ``dummy`` and ``draft_<int>`` (no leading zeros)."""
    return isinstance(phase, str) and _valid_phase(phase)


def causal_phase_key(phase: str) -> tuple[int, int]:
    """The order phases actually run in vLLM's ``sample_tokens``: target forward, then
    sampling/verification, then the drafter's propose (draft_0 .. draft_{K-1}). ``phase_sort_key``
    (the trace's listing order) shows ``verify`` last; checks, diffs and timelines need this one."""
    k = draft_index(phase)
    if k is not None:
        return (3, k)
    return {PHASE_DUMMY: (0, 0), PHASE_TARGET: (1, 0), PHASE_VERIFY: (2, 0)}.get(phase, (4, 0))


def phase_sort_key(phase: str) -> tuple[int, int]:
    """Execution order within a step: dummy, target, draft_0 .. draft_{K-1}, verify."""
    k = draft_index(phase)
    if k is not None:
        return (2, k)
    return {PHASE_DUMMY: (0, 0), PHASE_TARGET: (1, 0), PHASE_VERIFY: (3, 0)}[phase]


# --------------------------------------------------------------------------- views

GLOBAL_BATCH_VIEWS: dict[str, str] = {
    "req_ids": "str[R]: request ids in global (scheduler) order",
    "num_scheduled_tokens": "int[R]: query tokens scheduled per request this step",
    "query_start_loc": "int[R+1]: cumulative query starts on the global token axis",
    "positions": "int[T]: position of each global token",
    "input_ids": "int[T]: token id of each global token",
    "seq_lens": "int[R]: sequence length per request after this step's tokens",
    "is_prefilling": "bool[R]: request is (still) prefilling",
    "logits_indices": "int[S]: global token rows whose logits are sampled",
}
"""Global batch: the scheduler-ordered batch, identical on every rank."""

LAYOUT_VIEWS: dict[str, str] = {
    "segments": "struct[S] (SEGMENT_DTYPE): every rank's DualChunkSwap segments",
    "per_rank_num_tokens": "int[N]: real (unpadded) local tokens per rank",
    "padded_gather_idx": "int64[N*P]: gathered row -> global token (pad -> 0)",
    "hidden_restore_idx": "int64[T]: global token -> gathered row of its written copy",
    "kv_write_mask": "bool[N*P]: gathered rows whose KV this step writes",
}
"""PCP layout of the step (``pcpviz.layout.PCPLayout``)."""

LOCAL_BATCH_VIEWS: dict[str, str] = {
    "local_input_ids": "int[P]: token ids of this rank's local rows",
    "local_positions": "int[P]: positions of this rank's local rows (from the global positions)",
    "local_query_start_loc": "int[r+1]: cumulative starts of the local segments",
    "local_seq_lens": "int[r]: last local position + 1 per local segment",
    "local_logits_indices": "int[r]: local_query_start_loc[1:] - 1 (never sampled)",
    "local_is_padding": "bool[P]: local row is padding",
    "local_is_prefilling": "bool[r]: local segment belongs to a prefilling request",
    "local_req_ids": "str[r]: request id of each local segment",
}
"""Rank-local batch: this rank's rows (decodes first), padded to P."""

BLOCK_TABLE_VIEWS: dict[str, str] = {
    "block_table_global": "int32[G, R, W] or [R, W]: rows in global request order",
    "block_table_local": "int32[G, r, W] or [r, W]: rows per local segment",
    "block_table_draft": "int32[G, R, W] or [R, W]: rows the draft step used",
}
"""Block tables (a leading G axis when there are several KV-cache groups)."""

SLOT_MAPPING_VIEWS: dict[str, str] = {
    "slot_mapping_global": "int64[G, T]: KV slot of each global token",
    "slot_mapping_gathered": "int64[G, N*P]: KV slot of each gathered row, PAD_SLOT on padding",
    "slot_mapping_draft": "int64[R] (or [G, R]): draft step slots, unexpanded",
}
"""Slot mappings."""

DRAFT_VIEWS: dict[str, str] = {
    "view": "str 0-d: 'rank_local' (draft_0 under MTP) or 'replicated'",
    "draft_input_ids": "int[*]: token ids fed to this draft step",
    "draft_positions": "int[*]: positions fed to this draft step",
    "draft_seq_lens": "int[R or r]: sequence lengths this draft step attends over",
    "draft_tokens": "int[R]: tokens proposed by this draft step",
    "draft_last_token_indices": "int[R]: rows whose hidden state feeds the next draft step",
}
"""Draft step views."""

VERIFY_VIEWS: dict[str, str] = {
    "sampled_token_ids": "int[R, K+1]: sampled tokens per request (-1 past the accepted ones)",
    "num_sampled": "int[R]: tokens sampled per request",
    "num_rejected": "int[R]: draft tokens rejected per request",
    "num_accepted": "int[R]: draft tokens accepted per request",
}
"""Verify (sampling/rejection) views."""

DIGEST_VIEWS: dict[str, str] = {
    "top1_token": "int[rows]: per-row argmax token, for divergence hunting",
    "hidden_hash": "uint64[rows]: per-row hash of the hidden states",
}
"""Optional digests for divergence hunting."""

VIEW_GROUPS: dict[str, dict[str, str]] = {
    "global batch": GLOBAL_BATCH_VIEWS,
    "layout": LAYOUT_VIEWS,
    "rank-local batch": LOCAL_BATCH_VIEWS,
    "block tables": BLOCK_TABLE_VIEWS,
    "slot mappings": SLOT_MAPPING_VIEWS,
    "draft step": DRAFT_VIEWS,
    "verify": VERIFY_VIEWS,
    "digests": DIGEST_VIEWS,
}
"""Known views by group, in display order."""

VIEWS: dict[str, str] = {name: doc for group in VIEW_GROUPS.values() for name, doc in group.items()}
"""Every known view name -> one-line doc (other identifiers are storable too)."""

KNOWN_VIEWS: frozenset[str] = frozenset(VIEWS)
"""The set of known view names."""

DRAFT_VIEW_RANK_LOCAL = "rank_local"
"""Value of the ``view`` view for a draft step that ran on the rank-local rows."""
DRAFT_VIEW_REPLICATED = "replicated"
"""Value of the ``view`` view for a draft step replicated on the global batch."""

PAD_SLOT = -1
"""Slot-mapping value of a padding row (never written)."""

SEGMENT_DTYPE = np.dtype([
    ("global_req_idx", "<i8"), ("global_start", "<i8"), ("global_stop", "<i8"),
    ("local_start", "<i8"), ("local_stop", "<i8"), ("rank", "<i8"),
])
"""Row type of the ``segments`` view: one row per (rank, segment)."""

_SEGMENT_FIELDS = SEGMENT_DTYPE.names[:5]


def segments_table(segments_by_rank: Iterable[Iterable[Any]]) -> np.ndarray:
    """The ``segments`` view from per-rank segments (``PCPLayout.segments_by_rank``).

    Each segment is an object with the five ``SEGMENT_DTYPE`` attributes (``pcpviz.layout.Segment``)
    or a sequence of those five ints. Rows are ordered by rank, then as given.
    """
    rows = []
    for rank, segments in enumerate(segments_by_rank):
        for seg in segments:
            if hasattr(seg, "global_req_idx"):
                vals = tuple(int(getattr(seg, f)) for f in _SEGMENT_FIELDS)
            else:
                vals = tuple(int(v) for v in seg)
                if len(vals) != 5:
                    raise ValueError(f"segment {seg!r} of rank {rank}: expected 5 ints")
            rows.append(vals + (rank,))
    return np.array(rows, dtype=SEGMENT_DTYPE)


_VIEW_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


@lru_cache(maxsize=4096)
def _valid_view_name(name: str) -> bool:
    return _VIEW_NAME_RE.match(name) is not None


def is_valid_view_name(name: object) -> bool:
    """View names are lower-case identifiers: ``[a-z][a-z0-9_]*``."""
    return isinstance(name, str) and _valid_view_name(name)


# --------------------------------------------------------------------------- Arrow layout

ARROW_SCHEMA = pa.schema([
    pa.field("step", pa.int64(), nullable=False),
    pa.field("phase", pa.string(), nullable=False),
    pa.field("view", pa.string(), nullable=False),
    pa.field("dtype", pa.string(), nullable=False),
    pa.field("shape", pa.list_(pa.int64()), nullable=False),
    pa.field("data", pa.large_binary(), nullable=False),
    pa.field("crc32", pa.uint32(), nullable=False),
    pa.field("step_crc32", pa.uint32(), nullable=False),
])
"""Columns of every rank file (one row per (phase, view); one record batch per step)."""


def arrow_schema(rank: int) -> pa.Schema:
    """``ARROW_SCHEMA`` with this rank's metadata (version, rank)."""
    from pcpviz import __version__

    return ARROW_SCHEMA.with_metadata({
        META_SCHEMA_KEY: str(SCHEMA_VERSION),
        META_RANK_KEY: str(int(rank)),
        "pcpviz_version": __version__,
    })


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


def encode_value(value: Any) -> Encoded:
    """Encode a view value (array-like) for storage; ValueError says what is not supported."""
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
            dt = _struct_from_json(json.loads(tag[len(STRUCT_PREFIX):]))
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


def row_crc32(step: int, phase: str, view: str, tag: str, shape: tuple[int, ...], stored) -> int:
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
    count = int(np.prod(shape, dtype=np.int64))
    if dt is None:
        try:
            items = json.loads(bytes(stored).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"string payload is not JSON ({exc})") from None
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


def run_meta_with_version(meta: Mapping[str, Any]) -> dict[str, Any]:
    """run.json content: ``meta`` plus the schema version (first key)."""
    if not isinstance(meta, Mapping):
        raise ValueError(f"run meta must be a dict, got {type(meta).__name__}")
    if META_SCHEMA_KEY in meta and meta[META_SCHEMA_KEY] != SCHEMA_VERSION:
        raise ValueError(f"run meta has {META_SCHEMA_KEY}={meta[META_SCHEMA_KEY]!r}; "
                         f"this pcpviz writes version {SCHEMA_VERSION}")
    out: dict[str, Any] = {META_SCHEMA_KEY: SCHEMA_VERSION}
    for key, value in meta.items():
        if not isinstance(key, str):
            raise ValueError(f"run meta keys must be str, got {key!r}")
        out[key] = value
    return out
