"""Recording hooks on vLLM 0.33.0's PCP + speculative-decoding path.

Shared by the CPU replay (``pcpviz.vllm.replay``) and the plugin
(``pcpviz.vllm.plugin``): both use exactly these classes, so a trace made on a laptop
and one made on a GPU cluster come from the same code. Where each view is taken
(``docs/design.md#where-each-view-is-recorded-in-vllm``):

=====================  ==========================================================
view(s)                hook
=====================  ==========================================================
global batch, layout,  ``RecordingPCPManager.partition_batch`` (its argument; the
rank-local batch       layout of ``_build_batch_layout``; its return value)
block_table_local,     ``RecordingPCPManager.prepare_attn`` (return value),
block_table_global     ``BlockTables.block_tables[g].gpu[global.idx_mapping]``
slot_mapping_global,   ``RecordingPCPManager.prepare_slot_mappings`` (the
slot_mapping_gathered  ``_global_batch_slot_mappings`` it filled; its return value)
sampled_logits_rows    ``RecordingPCPManager.restore_for_sampling`` (the batch it
                       hands to the sampler: ``logits_indices``, global or local)
verify                 ``GPUModelRunner.postprocess_sampled`` (its arguments)
draft_0 global ids     ``RecordingPCPManager.prepare_draft_prefill`` (argument)
draft_k inputs         ``TargetDependentARSpeculator._run_model`` entry snapshot
                       (ids, positions, seq_lens, block tables, slot mappings of
                       the forward that is about to run)
draft_k slot mapping   ``compute_slot_mappings`` on the speculator's BlockTables
(k >= 1)               instance; the block-table gather counted on that instance
draft_tokens           the return value of ``propose`` (``int64[R, K]``)
DSpark inputs          ``dflash.speculator.prepare_dflash_inputs`` (module global)
=====================  ==========================================================

Every override calls ``super()`` first and records copies: tensors are copied on their
device when the hook fires (``host.StepPack``: one byte-level ``cat`` per hook call into the
preallocated device ring, ``recording.ring``) and moved to the host off the step thread (one
copy of the step's span), so vLLM's persistent
buffers — which CUDA graphs replay by address — are never re-allocated and the recorded values are those of that moment.
Recording never changes what vLLM computes (tested: identical draft tokens, slot mappings
and KV caches with recording on and off).

Where traces go: a ``TraceSession`` (a run directory, one ``TraceWriter`` per PCP rank,
``run.json`` written by PCP rank 0). The replay opens one explicitly
(``with recording.session(run_dir, ...)``); the plugin opens one from the environment
variable ``PCPVIZ_TRACE_DIR`` in each worker (TP rank 0 only). Without a session a
``RecordingPCPManager`` is a plain ``PCPManager``.

A plugin session is *lenient*: an exception inside a hook is logged once and switches
recording off for that rank (serving is never broken); the replay's session is *strict*
and re-raises.

The package, one concern per module, from the top (each imports only those below it; no
circle, function-local imports included: ``tests/repo/test_import_graph.py``):

=====================  ==========================================================
``manager``            ``RecordingPCPManager`` (the ``PCPManager`` overrides)
``wrappers``           the speculator / runner / warm-up method wrappers; ``set_mode``
``sessions``           ``TraceSession``, ``session()``, ``active_session()`` (where traces go)
``recorder``           ``RankRecorder``: one rank's step, the target and verify views
``procsink``           the plugin's default sink: a writer process per rank (outside vLLM's
                       GIL); ``make_sink`` picks a recorder's sink
``sink``               the inline or threaded sink: rank file or flight ring
``drafts``             ``DraftContext``: one ``propose`` call, a phase per draft forward
``graphs``             the graph-replay ledger (CUDA-graph captures vs replays)
``patching``           wrapper marks, the speculator's instance and model-class patches
``consumed``           what each draft forward consumed (``fwd_*``), FULL-graph capture notes
``fingerprints``       the hidden-state fingerprint hooks
``host``               the hooks' copies (``StepPack``), staged at the step's end
``staged``             a staged step (``StagedStep``) and the drain that takes steps to the
                       host together (``drain_steps``), off the step thread
``ring``               the preallocated device ring they land in; overflow counted and stated
``copyplan``           the hooks' byte views, kept across steps (address, dtype, shape)
``replayplan``         a hook call planned once (FULL draft replays, the PCP=1 target,
                       verify), then one copy a call
``group_calls``        vLLM's PCP / DCP collectives on GPUs, a ledger per process (eager runs)
``backlog``            the bounded queue of staged steps a sink drains
``meta``               run.json keys learned from the process and the speculator
``state``              the shared process state: the running draft, warm-up, the session,
                       which recorder an object feeds
=====================  ==========================================================

Import this package only after ``pcpviz.vllm.cpu_patches.apply_cpu_patches()`` on a CPU-only
machine (it imports vLLM's worker classes).
"""

from __future__ import annotations

from pcpviz.vllm.recording.manager import RecordingPCPManager
from pcpviz.vllm.recording.recorder import RankRecorder
from pcpviz.vllm.recording.sessions import ENV_RECORD_DUMMY, ENV_TRACE_DIR, TraceSession, active_session, session
from pcpviz.vllm.recording.state import attach_runner, current_session, owner_recorder, recorder_of
from pcpviz.vllm.recording.wrappers import install_wrappers, set_mode, uninstall_wrappers, wrapped_targets

__all__ = [
    "ENV_TRACE_DIR", "ENV_RECORD_DUMMY", "RecordingPCPManager", "RankRecorder", "TraceSession",
    "session", "active_session", "install_wrappers", "uninstall_wrappers", "wrapped_targets", "recorder_of",
    "owner_recorder", "attach_runner", "current_session", "set_mode",
]
