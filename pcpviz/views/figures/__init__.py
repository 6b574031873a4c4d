"""Plotly figures: of a PCP layout (``layout.py``) and of one traced engine step (one module per
view), drawn from the recorded views only.

Pure functions: each takes the record mappings ``trace.record(step, rank, phase)`` returns (view
name -> NumPy array) and gives back a ``go.Figure``; its ``*_spec`` twin gives the same figure as
plain data (``{"data": [...], "layout": {...}}``, ``as_figure`` wraps one). The ``Workbench``
widget pushes specs into its ``FigureWidget``s (only what changed); ``pcpviz.views.export.html``
serialises the figures.

* ``token_order_figure``    (``token_order.py``) global batch vs each rank's local rows,
                            gather/restore maps, KV write mask
* ``block_tables_figure``   (``block_tables.py``) global rows, the rank's local rows, the draft
                            step's rows; zero/stale draft rows outlined in red
* ``slot_mappings_figure``  (``slot_mappings.py``) global ``[G, T]``, gathered ``[G, N*P]`` (PAD
                            shown), the write mask, and the draft step's slot mapping
* ``dcp_shards_spec``       (``dcp_shards.py``) DCP > 1: which DCP rank holds each token's KV,
                            this rank's share of the slots, local lengths, draft slots per rank
* ``draft_timeline_figure`` (``timeline.py``) target -> draft_0 (rank-local) -> gather ->
                            draft_1.. (replicated) -> verify
* ``acceptance_figure``     (``acceptance.py``) acceptance per draft position (vLLM's
                            definition), per request, and per step

Shared: ``canvas.py`` (drawing helpers, size limits, colours), ``aggregate.py`` (runs of long
strips), ``lod.py`` (level of detail: what a strip draws for its visible window), ``step_data.py`` (records, ``StepLayout``, request ids, check report),
``violations.py`` (which view a check violation is marked on). Per-token strips are
drawn at a level of detail (``lod.py``): runs snapped to pixels at low zoom, tokens and their
text when zoomed in, so a figure's size is bounded by its width in pixels whatever T, N*P or W are.

A PCP=2 step of the shipped trace (``data/traces/cpu-pcp2-mtp2``, step 0: req0 prefills 23
tokens, req1 25)::

    from pcpviz import trace

    from pcpviz.views import figures
    t = trace.open("data/traces/cpu-pcp2-mtp2")
    figures.token_order_figure(t.record(0, 0, "target"), rank=0)   # N=2, P=26, 48 global tokens
"""

from pcpviz.views.figures.acceptance import (AcceptanceStats, acceptance_figure, acceptance_spec, acceptance_stats,
                                       acceptance_step_marker, from_diff_acceptance, load_acceptance, trace_acceptance)
from pcpviz.views.figures.aggregate import run_edges
from pcpviz.views.figures.block_tables import RowFlag, block_tables_figure, block_tables_spec, draft_block_table_flags
from pcpviz.views.figures.canvas import (DIM_COLOR, FLAG_COLOR, TEMPLATE, TOKEN_LIMIT,
                                   as_figure, request_color_index, safe_spec, safe_text, shorten, validate_figure)
from pcpviz.views.figures.lod import PLOT_PX, draw_strip, lod_enabled, pixel_cells
from pcpviz.views.figures.slot_mappings import slot_mappings_figure, slot_mappings_inputs, slot_mappings_spec
from pcpviz.views.figures.dcp_shards import dcp_shards_spec
from pcpviz.views.figures.step_data import (ReqIdsFold, StepLayout, draft_source_phase, has_layout, layout_summary,
                                            load_check_report, recorded_phases, step_layout, trace_req_ids)
from pcpviz.views.figures.timeline import draft_timeline_figure, draft_timeline_spec
from pcpviz.views.figures.token_order import (token_order_figure, token_order_for_rank, token_order_inputs,
                                              token_order_spec)
from pcpviz.views.figures.violations import drawn, mark_violation, message_spec, violation_marks, violation_view

__all__ = [
    "TOKEN_LIMIT", "TEMPLATE", "FLAG_COLOR", "DIM_COLOR", "PLOT_PX",
    "StepLayout", "step_layout", "has_layout", "layout_summary", "recorded_phases", "run_edges", "pixel_cells", "draw_strip", "lod_enabled",
    "RowFlag", "draft_block_table_flags", "draft_source_phase",
    "AcceptanceStats", "acceptance_stats", "trace_acceptance",
    "token_order_figure", "block_tables_figure", "slot_mappings_figure",
    "draft_timeline_figure", "acceptance_figure", "acceptance_step_marker", "mark_violation",
    "violation_view", "violation_marks", "validate_figure", "load_acceptance", "from_diff_acceptance",
    "load_check_report", "trace_req_ids", "ReqIdsFold", "request_color_index",
    "token_order_spec", "block_tables_spec", "slot_mappings_spec", "dcp_shards_spec", "draft_timeline_spec", "acceptance_spec", "as_figure",
    "drawn", "message_spec", "safe_text", "safe_spec", "shorten",
    "token_order_inputs", "token_order_for_rank", "slot_mappings_inputs",
]
