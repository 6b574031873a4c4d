"""The pcpviz trace: one run directory, one append-only Arrow IPC stream per rank.

Producers (the engine, the vLLM CPU replay, the vLLM plugin) write it with ``TraceWriter``;
everything downstream (checks, diff, widgets, export) reads it with ``open``::

    import pcpviz.trace as pt
    pt.write_run_meta(run_dir, {"producer": "pcpviz-engine", "pcp": 2, ...})
    with pt.TraceWriter(run_dir, rank) as w:
        w.write_step(0, {"target": {"positions": pos}, "verify": {"num_accepted": acc}})

    t = pt.open(run_dir)
    t.steps, t.ranks, t.phases(0, rank), t.record(0, rank, "target")["positions"]
    t.run_meta.pcp, t.run_meta.kv_block_sizes, t.run_meta.extra  # run.json decoded once; extra: unknown keys

See ``schema`` for the on-disk layout and the names (phases, views), ``reader`` for the error
policy on damaged traces, ``meta_model`` for run.json as one typed value (``RunMeta``),
``validate`` for run.json's schema and what a complete trace is, and ``owner`` for how one
writer at a time owns a run directory.
"""

from .errors import TraceError, TraceWarning
from .reader import RankFile, Record, Trace, open
from .schema import (
    DRAFT_VIEW_RANK_LOCAL,
    DRAFT_VIEW_REPLICATED,
    KNOWN_VIEWS,
    PAD_SLOT,
    PHASE_DUMMY,
    PHASE_TARGET,
    PHASE_VERIFY,
    PHASES,
    SCHEMA_VERSION,
    SEGMENT_DTYPE,
    VIEW_GROUPS,
    VIEWS,
    draft_index,
    draft_phase,
    is_valid_phase,
    is_valid_view_name,
    phase_sort_key,
    segments_table,
)
from .owner import claim
from .meta_model import LaunchMeta, RunMeta
from .validate import INCOMPLETE, INVALID, Problem, TraceStatus, validate, validate_meta
from .summary import run_summary
from .writer import TraceWriter, write_run_meta

__all__ = [
    "run_summary", "RunMeta", "LaunchMeta",
    "TraceError", "TraceWarning", "Trace", "Record", "RankFile", "open", "TraceWriter",
    "write_run_meta", "SCHEMA_VERSION", "PHASES", "PHASE_TARGET", "PHASE_VERIFY", "PHASE_DUMMY",
    "VIEWS", "VIEW_GROUPS", "KNOWN_VIEWS", "SEGMENT_DTYPE", "PAD_SLOT", "DRAFT_VIEW_RANK_LOCAL",
    "DRAFT_VIEW_REPLICATED", "draft_phase", "draft_index", "is_valid_phase", "is_valid_view_name",
    "phase_sort_key", "segments_table", "claim", "validate", "validate_meta", "TraceStatus", "Problem",
    "INVALID", "INCOMPLETE",
]
