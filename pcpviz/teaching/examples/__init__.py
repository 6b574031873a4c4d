"""Small computations the teaching notebooks show, each re-derived from vLLM 0.33.0.

The notebooks hold narrative and calls; every number they claim comes from here (or from
``pcpviz.reference.layout`` / ``pcpviz.reference.blocks``), so a wrong claim fails a test instead of sitting in
prose. What is here:

* ``cache_writes``          which (token, slot) pairs one rank's KV cache receives in the target
                            forward (``v1/attention/ops/pcp.py::_gather_prefill_cache_inputs``);
* ``draft_decode_io``       what a replicated draft decode writes (slots: request table through
                            ``idx_mapping``) and what its attention reads (``input_block_tables``);
* ``draft_inputs``          the draft-step arithmetic of ``prepare_prefill_inputs`` and
                            ``prepare_decode_inputs`` (MTP ``TargetDependentARSpeculator``);
* ``draft_prefill_dispatch``  the per-rank arguments of the draft-prefill CUDA-graph dispatch;
* ``indexer_k_write``       the sparse indexer's k-cache fold, fixed and pre-fix;
* ``describe_acceptance_change``  a sentence about two runs' acceptance, computed from the numbers;
* ``pick_trace``            which trace under ``data/traces`` a notebook should open;
* the worked examples of notebooks 02 and 03 and the exercises of 01-03 (``check``).

The notebooks import this package (``from pcpviz.teaching import examples as teach``); each
name lives in one module: ``kv_writes`` (notebook 02), ``draft_steps`` (03), ``pcp_paths``
(06, 07), ``traces`` (which trace to open), ``exercises``.
"""

from pcpviz.teaching.examples.draft_steps import STALE, DraftExample, DraftInputs, draft_example, draft_inputs
from pcpviz.teaching.examples.exercises import EXERCISES, Exercise, check
from pcpviz.teaching.examples.kv_writes import (BlockExample, CacheWrites, DraftDecodeIO, block_example, cache_writes,
                                                draft_decode_io)
from pcpviz.teaching.examples.pcp_paths import (DraftPrefillDispatch, DSparkConfig, IndexerKWrite,
                                                draft_prefill_dispatch, dspark_drafter_config, indexer_k_write,
                                                local_is_padding)
from pcpviz.teaching.examples.traces import (METRIC_PER_POS, TracePick, describe_acceptance_change, pick_trace,
                                             trace_pairs, vllm_acceptance_metric)

__all__ = [
    "CacheWrites", "cache_writes", "DraftDecodeIO", "draft_decode_io", "DraftInputs", "draft_inputs",
    "DraftPrefillDispatch", "draft_prefill_dispatch", "IndexerKWrite", "indexer_k_write",
    "describe_acceptance_change", "TracePick", "pick_trace", "trace_pairs", "vllm_acceptance_metric", "METRIC_PER_POS",
    "BlockExample", "block_example", "DraftExample", "draft_example",
    "Exercise", "EXERCISES", "check", "STALE", "DSparkConfig", "dspark_drafter_config", "local_is_padding",
]
