"""The pcpviz trace schema: names (phases, and every view with its dtype, shape, padding and
meaning: ``VIEW_SPECS``) and the on-disk layout. Its parts have modules of their own and are
re-exported here: the phases in ``phases``, the view declarations in ``view_specs``, the value
codec in ``codec``, the file names in ``files``, the versions in ``versions``.

A run is a directory::

    run/
      run.json       {"pcpviz_trace_schema": 2, "producer": ..., "pcp": 2, ...}  (any JSON dict)
      rank0.arrow    Arrow IPC *stream*: schema header, then one record batch per engine step
      rank1.arrow    ...
      complete.json  how each rank's writer ended, written last (``pcpviz.trace.completion``)

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

import re
from functools import lru_cache
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa

from pcpviz.trace.files import (  # noqa: F401 - the file names, re-exported
    COMPLETION_FILE, COMPLETION_KEY, RANK_FILE_RE, RUN_META_FILE, rank_file_name,
)
from pcpviz.trace.phases import (  # noqa: F401 - the phase vocabulary, re-exported (``schema.PHASE_TARGET`` ...)
    DRAFT_PHASE_PREFIX, PHASE_CLASSES, PHASE_DUMMY, PHASE_TARGET, PHASE_VERIFY, PHASES, causal_phase_key,
    draft_index, draft_phase, is_valid_phase, phase_class, phase_sort_key,
)
from pcpviz.trace.versions import SCHEMA_VERSIONS, upgrade_views  # noqa: F401 - re-exported
from pcpviz.trace.view_specs import GLOBAL, RANK, VIEW_SPECS, ViewSpec  # noqa: F401 - re-exported
from pcpviz.trace.codec import (  # noqa: F401 - the value codec, re-exported (``schema.encode_value`` ...)
    ALIGN, STR_TAG, STRUCT_PREFIX, Encoded, check_shape, decode_payload, encode_value, padded_size,
    parse_dtype_tag, row_crc32, step_crc32,
)
from pcpviz.version import __version__

__all__ = [
    "SCHEMA_VERSION", "SCHEMA_VERSIONS", "upgrade_views", "META_SCHEMA_KEY", "META_RANK_KEY", "RUN_META_FILE",
    "COMPLETION_FILE", "COMPLETION_KEY", "rank_file_name",
    "PHASE_TARGET", "PHASE_VERIFY", "PHASE_DUMMY", "DRAFT_PHASE_PREFIX", "PHASES",
    "draft_phase", "draft_index", "is_valid_phase", "phase_sort_key", "causal_phase_key", "int_view",
    "MalformedValue", "MALFORMED_VALUE",
    "GLOBAL_BATCH_VIEWS", "LAYOUT_VIEWS", "LOCAL_BATCH_VIEWS", "BLOCK_TABLE_VIEWS",
    "SLOT_MAPPING_VIEWS", "DRAFT_VIEWS", "VERIFY_VIEWS", "DIGEST_VIEWS", "VIEW_GROUPS", "VIEWS",
    "KNOWN_VIEWS", "PHASE_CLASSES", "GLOBAL", "RANK", "ViewSpec", "VIEW_SPECS", "phase_class", "view_spec",
    "phase_views", "view_panel", "undeclared_views", "views_markdown", "RUN_SPECIFIC_VIEWS", "TIMING_VIEWS",
    "DRAFT_VIEW_RANK_LOCAL", "DRAFT_VIEW_REPLICATED", "PAD_SLOT", "SEGMENT_DTYPE",
    "segments_table", "is_valid_view_name", "ARROW_SCHEMA", "arrow_schema",
]

# --------------------------------------------------------------------------- versions & files

SCHEMA_VERSION = 2
"""Version of this format; bumped on any change an older reader would misread (``SCHEMA_VERSIONS``)."""
META_SCHEMA_KEY = "pcpviz_trace_schema"
"""Key of the schema version, in run.json and in each rank file's Arrow schema metadata."""

META_RANK_KEY = "rank"
"""Arrow schema metadata key holding the rank a file belongs to (must match its file name)."""


_SPEC_INDEX: dict[tuple[str, str], ViewSpec] = {}
for _s in VIEW_SPECS:
    for _p in _s.phases:
        if (_p, _s.name) in _SPEC_INDEX:
            raise AssertionError(f"view {_s.name!r} declared twice for phase {_p}")
        _SPEC_INDEX[(_p, _s.name)] = _s


class MalformedValue(ValueError):
    """A value a file stored where the schema declares an integer view that no integer can be:
    NaN, inf, 2.5 or beyond int64. Damaged data: every command reports it as lost (exit 3)."""


MALFORMED_VALUE = "MalformedValue"
"""The exception's name as a check's 'could not evaluate' line carries it."""


def int_view(values, name: str):
    """int64 array of an integer view as read from a file. A producer may store integers in a
    float column; those are kept when every value is a whole finite number, and anything else
    (NaN, inf, 2.5) raises ValueError naming the view, not a silent cast to garbage::

        int_view(np.array([1.0, 2.0]), "num_accepted")    # array([1, 2])
        int_view(np.array([1.0, nan]), "num_accepted")    # ValueError: num_accepted holds nan
    """
    import numpy as np

    a = np.asarray(values)
    if a.dtype.kind in "iub":
        return a.astype(np.int64)
    if a.dtype.kind != "f":
        raise ValueError(f"{name} holds {a.dtype} values, not integers")
    bad = ~np.isfinite(a) | (a != np.round(a)) | (np.abs(a) >= 2.0**63)
    if bad.any():
        raise MalformedValue(f"{name} holds {float(a[bad].flat[0])!r}, not an integer")
    return a.astype(np.int64)


def view_spec(phase: str, name: str) -> ViewSpec | None:
    """The spec of view ``name`` in ``phase`` (any draft_k), None if it is not declared."""
    return _SPEC_INDEX.get((phase_class(phase), name))


def phase_views(phase: str) -> dict[str, ViewSpec]:
    """Every view declared for ``phase``'s class, by name."""
    cls = phase_class(phase)
    return {name: s for (p, name), s in _SPEC_INDEX.items() if p == cls}


def view_panel(name: str | None, phase: str | None = None) -> str:
    """The Workbench figure that draws view ``name`` (of ``phase``, or its first declaration):
    ``token_order``, ``block_tables``, ``slot_mappings``, else ``timeline``."""
    if name is None:
        return "timeline"
    spec = view_spec(phase, name) if phase is not None and is_valid_phase(phase) else None
    spec = spec or next((s for s in VIEW_SPECS if s.name == name), None)
    return "timeline" if spec is None else spec.panel


def undeclared_views(phases: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """``"phase/view: why"`` for every view of one step's ``{phase: {view: value}}`` that the
    schema does not declare or whose dtype kind or number of axes does not fit."""
    out = []
    for phase, views in phases.items():
        for name, value in views.items():
            spec = view_spec(phase, name)
            why = "not declared in pcpviz.trace.schema" if spec is None else spec.problem(value)
            if why:
                out.append(f"{phase}/{name}: {why}")
    return out


def views_markdown() -> str:
    """The view table as Markdown (one row per declared view), for the docs."""
    lines = ["| phase | view | type | meaning | padding |", "|---|---|---|---|---|"]
    for s in VIEW_SPECS:
        lines.append(f"| {', '.join(s.phases)} | `{s.name}` | `{s.decl}` | {s.meaning} | {s.pad} |")
    return "\n".join(lines)


def _group(name: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for s in VIEW_SPECS:
        if s.group == name:
            out.setdefault(s.name, f"{s.decl}: {s.meaning}")
    return out


VIEW_GROUPS: dict[str, dict[str, str]] = {g: _group(g) for g in dict.fromkeys(s.group for s in VIEW_SPECS)}
"""Declared views by group, in display order: name -> ``"dtype[shape]: meaning"``."""

GLOBAL_BATCH_VIEWS = VIEW_GROUPS["global batch"]
LAYOUT_VIEWS = VIEW_GROUPS["layout"]
LOCAL_BATCH_VIEWS = VIEW_GROUPS["rank-local batch"]
BLOCK_TABLE_VIEWS = VIEW_GROUPS["block tables"]
SLOT_MAPPING_VIEWS = VIEW_GROUPS["slot mappings"]
DRAFT_VIEWS = VIEW_GROUPS["draft step"]
VERIFY_VIEWS = VIEW_GROUPS["verify"]
DIGEST_VIEWS = VIEW_GROUPS["digests"]

VIEWS: dict[str, str] = {name: doc for group in VIEW_GROUPS.values() for name, doc in group.items()}
"""Every declared view name -> one-line doc (its first declaration)."""

KNOWN_VIEWS: frozenset[str] = frozenset(VIEWS)
"""The set of declared view names."""

RUN_SPECIFIC_VIEWS: frozenset[str] = frozenset(s.name for s in VIEW_SPECS if s.run_specific)
"""Views two correct runs differ in (timestamps, hashes, request-state rows): diff ignores them."""

TIMING_VIEWS: frozenset[str] = frozenset(s.name for s in VIEW_SPECS if s.group == "timing")
"""Wall-clock views."""

DRAFT_VIEW_RANK_LOCAL = "rank_local"
"""Value of the ``view`` view for a draft step that ran on the rank-local rows."""
DRAFT_VIEW_REPLICATED = "replicated"
"""Value of the ``view`` view for a draft step replicated on the global batch."""

PAD_SLOT = -1
"""Slot-mapping value of a padding row (never written)."""

SEGMENT_DTYPE = np.dtype([("global_req_idx", "<i8"), ("global_start", "<i8"), ("global_stop", "<i8"),
                          ("local_start", "<i8"), ("local_stop", "<i8"), ("rank", "<i8")])
"""Row type of the ``segments`` view: one row per (rank, segment)."""

_SEGMENT_FIELDS = SEGMENT_DTYPE.names[:5]


def segments_table(segments_by_rank: Iterable[Iterable[Any]]) -> np.ndarray:
    """The ``segments`` view from per-rank segments (``PCPLayout.segments_by_rank``).

    Each segment is an object with the five ``SEGMENT_DTYPE`` attributes (``pcpviz.reference.layout.Segment``)
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
    return ARROW_SCHEMA.with_metadata({
        META_SCHEMA_KEY: str(SCHEMA_VERSION),
        META_RANK_KEY: str(int(rank)),
        "pcpviz_version": __version__,
        COMPLETION_KEY: COMPLETION_FILE,
    })


def run_meta_with_version(meta: Mapping[str, Any]) -> dict[str, Any]:
    """run.json content: ``meta`` plus the schema version (first key; an older trace's meta: this one's)."""
    if not isinstance(meta, Mapping):
        raise ValueError(f"run meta must be a dict, got {type(meta).__name__}")
    version = meta.get(META_SCHEMA_KEY)
    if META_SCHEMA_KEY in meta and (type(version) is not int or version not in SCHEMA_VERSIONS):
        raise ValueError(f"run meta has {META_SCHEMA_KEY}={meta[META_SCHEMA_KEY]!r}; "
                         f"this pcpviz writes version {SCHEMA_VERSION}")
    out: dict[str, Any] = {META_SCHEMA_KEY: SCHEMA_VERSION}
    for key, value in meta.items():
        if not isinstance(key, str):
            raise ValueError(f"run meta keys must be str, got {key!r}")
        out[key] = SCHEMA_VERSION if key == META_SCHEMA_KEY else value
    return out
