"""The views of the graph-replay ledger (``pcpviz.vllm.recording.graphs``): what the CUDA graphs a
phase replayed were handed, against what they were captured with.

PCP=2, PIECEWISE, the draft prefill on rank 1 (docs/findings/piecewise-draft-prefill.md)::

    draft_0  graph_replays       12
             graph_inputs_moved  ["graph PIECEWISE#0 num_tokens=120 (draft_0): input 0 int32[120] handed at
                                   0x7f2a1c000400, captured at 0x7f2a1bfe6400 int32[120]", ...]
"""

__all__ = ["GRAPH_ROWS"]

_PHASES, _DRAFTS = ("target", "draft_0", "draft_k"), ("draft_0", "draft_k")

GRAPH_ROWS: list[tuple[tuple[str, ...], list[tuple], dict]] = [
    (_PHASES, [
        ("graph_replays", "int64", "[]", "vLLM only: pieces of PIECEWISE CUDA graphs this phase replayed (the "
         "graph-replay ledger; each replay's inputs compared with the capture's)"),
        ("graph_full_replays", "int64", "[]", "vLLM only: FULL CUDA graphs this phase replayed (nothing is handed "
         "to those: they read their captured buffers)"),
        ("graph_inputs_moved", "str", "[M]", "vLLM only: one line per replay input handed at another address than "
         "its graph was captured with (graph, input, dtype[shape], both addresses): the replay reads the "
         "captured buffer, not it"),
    ], dict(run_specific="CUDA-graph bookkeeping of this run (eager runs have none)")),
    (_DRAFTS, [
        ("graph_mode", "str", "[]", "vLLM only: the CUDA-graph mode the draft forward ran in (NONE, PIECEWISE; "
         "FULL: a replay, whose inputs are not recorded)"),
    ], dict(run_specific="CUDA-graph mode of this run")),
]
"""(phase classes, schema rows (name, dtype, shape, meaning), common ViewSpec fields)."""
