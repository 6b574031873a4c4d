"""Replay vLLM 0.33.0's PCP + MTP step on CPU with the real vLLM classes, and record it.

``replay(pcp=2, mtp=2, trace_dir=..., scenario="mixed")`` runs a scripted multi-step
scenario through vLLM's own code, N PCP ranks as threads sharing a ``FakePCPGroup``
(``pcpviz.vllm.cpu_patches``), and writes a pcpviz trace (producer ``"vllm-replay"``)
through the *same* recording classes the plugin installs in a real deployment
(``pcpviz.vllm.recording``)::

    from pcpviz.vllm import replay
    res = replay(pcp=2, mtp=2, trace_dir="runs/replay", scenario="mixed")
    res.trace.record(1, 0, "draft_1")["slot_mapping_draft"]     # unexpanded, length R

What runs is vLLM's (``docs/vllm-0.33-pcp-mtp.md#running-the-pcp-code-on-cpu``):

* ``RequestState``, ``BlockTables`` and their Triton kernels (``TRITON_INTERPRET=1``);
* ``GPUModelRunner.finish_requests / add_requests / update_requests /
  gather_batch_req_state / prepare_inputs / prepare_attn / postprocess_sampled``, called
  unbound on a stand-in ``self`` (a ``SimpleNamespace`` holding the real request state,
  block tables, input buffers and PCP manager; ``GPUModelRunner.__init__`` needs CUDA);
* ``dispatch_cg_and_sync_dp(need_eager=True)``, ``maybe_build_pcp_manager(...,
  cls=RecordingPCPManager)`` and ``validate_config``, ``partition_batch``,
  ``prepare_attn``, ``restore_for_sampling``, ``prepare_draft_prefill``,
  ``get_draft_input_buffers``, ``restore_draft_prefill``;
* ``DefaultModelState.prepare_attn`` -> ``build_attn_metadata`` -> the real
  ``CommonAttentionMetadata``; ``set_forward_context`` / ``build_slot_mappings_by_layer``;
* ``MTPSpeculator.__init__`` and ``TargetDependentARSpeculator.propose`` (with
  ``is_profile=True``, which forces ``CUDAGraphMode.NONE``: there are no CUDA-graph
  managers on CPU) including its Triton ``prepare_prefill_inputs``,
  ``prepare_decode_inputs``, ``update_draft_inputs``, the block-table gather and the
  per-step ``compute_slot_mappings`` / ``_build_attn_metadata`` (with
  ``draft_is_prefilling``);
* ``get_num_sampled_and_rejected`` (the sampler's chunked-prefill rule);
* ``maybe_gather_mla_latent_cache_inputs`` (the MLA KV-write gather) and
  ``split_decodes_and_prefills`` (the MLA builder's decode/prefill split, with
  ``treat_short_extends_as_decodes=False`` as under PCP);
* ``InputBatch.make_dummy`` + ``prepare_inputs_for_capture_or_profile`` +
  ``propose(dummy_run=True)`` for the dummy (profile) run;
* for the ``dspark`` scenario: the block-table gather and ``prepare_dflash_inputs``
  (see ``DSPARK_STATUS``).

The models (declared in the trace's ``run.json`` under ``"models"`` and ``"stand_ins"``): by
default (``models="tiny"``) the shipped tiny DeepSeek-V3 checkpoint's target and MTP layer behind
vLLM's model interfaces, each MLA layer writing its latents through the real
``maybe_gather_mla_latent_cache_inputs`` and attending over the context read back through the
metadata's block table (``pcpviz.vllm.replay.tiny``), with greedy rejection sampling, so acceptance
is measured and a bug in vLLM's code moves it. ``model_dir="data/models/pcpviz-tiny-moe-dsa"`` runs the
MoE + DSA checkpoint the same way: its MoE layers all-gather rows and router logits and reduce-scatter
their output on vLLM's ``get_pcp_group()`` in every forward, its attention reads the indexer's top-k
(``pcpviz.vllm.replay.tiny_moe``), and run.json says ``model_moe: true``. ``models="scripted"`` (and
the ``dspark`` scenario) keeps the weightless stand-ins: deterministic functions of token and position, the target
predicting ``(5*token + 3*position + 7) % vocab``, the rejections scripted per scenario.
Stand-ins either way: the attention backend (a metadata builder that only calls
``split_decodes_and_prefills``), the scheduler (scripted: async scheduling, so the CPU cursor runs
ahead by the last step's rejected drafts), the vLLM config (``SimpleNamespace`` with the fields
the code reads) and the runner's sampler/model-state bookkeeping (no-ops). ``graph_mode`` builds the
speculator's CUDA-graph managers (vLLM's sizing and dispatch, stand-in graphs, ``graphs``);
``fixes`` patches the findings' fixes in (``pcpviz.vllm.fixes``).

The package, one concern per module:

================  ================================================================
``scenarios``     ``Scenario``, ``ScenarioRequest``, ``SCENARIOS`` (plain data)
``stand_ins``     the stand-in models and attention group; what run.json declares
``tiny``          the tiny checkpoint behind vLLM's target and MTP interfaces; the prompts
``tiny_moe``      the MoE + DSA checkpoint's MoE collectives, indexer-key cache, sparse attention
``ranks``         ``RankState``: one rank's vLLM objects; the stand-in ``VllmConfig``
``scheduler``     ``ScriptedScheduler``: ``SchedulerOutput`` per step
``step``          one step on one rank (``rank_step``), the profile run (``dummy_step``)
``driver``        ``replay()`` and ``ReplayResult``
``graphs``        vLLM's CUDA-graph sizing, managers and dispatch; stand-in graphs
``full_graphs``   ``probe_full_graphs()``: the FULL draft-prefill control flow
``dummy_runs``    ``probe_dummy_run()``: dummy runs with and without attention
================  ================================================================

The probes (``full_graphs``, ``dummy_runs``) drive the same classes outside ``replay()`` and
return what they measured; docs/findings/full-draft-prefill-state.md and
docs/findings/dspark-dummy-run-stale-block-tables.md are written from them.

Importing this package applies ``pcpviz.vllm.cpu_patches`` and imports vLLM (about 15 s); its
modules import vLLM inside ``cpu_environment()`` (interpreted Triton kernels), and the process
environment is left as it was.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from pcpviz.vllm.cpu_patches import apply_cpu_patches, cpu_environment

apply_cpu_patches()

with cpu_environment():  # vLLM modules imported here define interpreted (CPU) Triton kernels
    from pcpviz.vllm.replay.driver import PRODUCER, ReplayResult, replay
    from pcpviz.vllm.replay.scenarios import SCENARIOS, Scenario, ScenarioRequest
    from pcpviz.vllm.replay.stand_ins import DSPARK_STATUS, MODELS_DECLARATION, STAND_INS

__all__ = ["replay", "ReplayResult", "Scenario", "ScenarioRequest", "SCENARIOS", "MODELS_DECLARATION",
           "STAND_INS", "DSPARK_STATUS", "PRODUCER"]


class _CallableModule(types.ModuleType):
    """``pcpviz.vllm.replay(...)`` calls ``replay()``: the package attribute ``replay`` is this
    package once it is imported, so the package itself is made callable."""

    def __call__(self, *args: Any, **kwargs: Any) -> ReplayResult:
        return replay(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
