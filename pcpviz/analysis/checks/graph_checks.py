"""Checks on what the CUDA graphs of a step read: the graph-replay ledger of the vLLM plugin
(``pcpviz.vllm.recording.graphs``).

A replayed CUDA graph runs its kernels on the addresses it was captured with; tensors handed to it
at replay are not read. PCP=2, PIECEWISE: vLLM's draft prefill graph was captured on the
speculator's ``input_ids`` buffer and is handed the rank-local batch's, so it embeds the global
ids (docs/findings/piecewise-draft-prefill.md); the ledger records that replay as::

    graph PIECEWISE#0 num_tokens=120 (draft_0): input 0 int32[120] handed at 0x7f2a1c000400,
    captured at 0x7f2a1bfe6400 int32[120]
"""

from __future__ import annotations

from pcpviz.trace.schema import causal_phase_key

from .columns import Block, bulk_skip
from .context import Ctx, Skip, check


_NO_REPLAYS = ("no graph_replays (no CUDA-graph replay observed: an eager run, or a trace recorded "
               "without the graph-replay ledger)")


@check("graph_inputs_are_captured",
       "every CUDA-graph replay was handed its inputs at the addresses its graph was captured with "
       "(a replay reads the captured buffers: a tensor handed at another address is never read); "
       "from the plugin's graph-replay ledger, so eager runs and older traces skip it")
def graph_inputs_are_captured(c: Ctx) -> None:
    phases = sorted((p for p, rec in c.phases.items() if "graph_replays" in rec), key=causal_phase_key)
    if not phases:
        raise Skip(_NO_REPLAYS)
    for phase in phases:
        moved = c.get(phase, "graph_inputs_moved")
        if moved is not None and moved.size:
            more = f" (and {moved.size - 1} more)" if moved.size > 1 else ""
            c.fail(phase, "graph_inputs_moved", f"{moved.flat[0]}{more}", index=(0,))


@bulk_skip("graph_inputs_are_captured")
def _no_graph_replays(b: Block, rank: int) -> list:
    """The check's first test: no phase of the rank recorded graph_replays."""
    return [None if any("graph_replays" in rec for rec in sv.recs.get(rank, {}).values()) else _NO_REPLAYS
            for sv in b.svs]
