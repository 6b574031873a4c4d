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

What is a stand-in (declared in the trace's ``run.json`` under ``"models"`` and
``"stand_ins"``): the target and MTP models (deterministic functions of token and
position, no weights: the target predicts ``(5*token + 3*position + 7) % vocab`` for the
next position, the MTP module the same one position further; both emulate the MLA KV
write into a per-rank cache through the real ``maybe_gather_mla_latent_cache_inputs``),
the attention backend (a metadata builder that only calls ``split_decodes_and_prefills``),
the rejection outcome (scripted per scenario: accepted drafts are the scheduled drafts,
the bonus token is the target's top-1), the scheduler (scripted: async scheduling, so the
CPU cursor runs ahead by the last step's rejected drafts), the vLLM config
(``SimpleNamespace`` with the fields the code reads; a stand-in model registry resolves
the architecture to the stand-in target) and the runner's sampler/model-state
bookkeeping (no-ops).
"""

from __future__ import annotations

import os
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pcpviz.vllm.cpu_patches import FakePCPGroup, apply_cpu_patches, run_ranks

apply_cpu_patches()

import numpy as np  # noqa: E402
import torch  # noqa: E402

import vllm  # noqa: E402
from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context  # noqa: E402
from vllm.v1.attention.backends.utils import split_decodes_and_prefills  # noqa: E402
from vllm.v1.attention.ops.pcp import maybe_gather_mla_latent_cache_inputs  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer  # noqa: E402
from vllm.v1.worker.gpu.block_table import BlockTables  # noqa: E402
from vllm.v1.worker.gpu.dp_utils import dispatch_cg_and_sync_dp  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers, get_num_sampled_and_rejected  # noqa: E402
from vllm.v1.worker.gpu.model_runner import GPUModelRunner  # noqa: E402
from vllm.v1.worker.gpu.model_states.default import DefaultModelState  # noqa: E402
from vllm.v1.worker.gpu.pcp_manager import PCPManager, maybe_build_pcp_manager  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_speculator  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.utils import get_drafter_hidden_states  # noqa: E402
from vllm.v1.worker.gpu.states import RequestState  # noqa: E402

from pcpviz.vllm import recording  # noqa: E402
from pcpviz.vllm.recording import RecordingPCPManager  # noqa: E402

__all__ = ["replay", "ReplayResult", "Scenario", "ScenarioRequest", "SCENARIOS", "MODELS_DECLARATION",
           "STAND_INS", "DSPARK_STATUS", "PRODUCER"]

PRODUCER = "vllm-replay"
CPU = torch.device("cpu")
TARGET_LAYER = "model.layers.0.self_attn.attn"
MTP_LAYER = "model.layers.1.self_attn.attn"  # DeepSeek's MTP module is layer num_hidden_layers
DSPARK_LAYER = "dspark.layers.0.self_attn.attn"

MODELS_DECLARATION = (
    "stand-ins: target = deterministic function of (token, position), next token "
    "(5*token + 3*position + 7) % vocab, hidden = [token, position, ...]; MTP = the same "
    "function one position ahead (input draft id, position + 1); both emulate the MLA KV "
    "write into a per-rank [slots, 2] cache through vLLM's maybe_gather_mla_latent_cache_inputs; "
    "no weights, no real attention kernels"
)
DSPARK_MODEL_DECLARATION = (
    "DSpark drafter = stand-in: combine_hidden_states takes the restored aux state, context K/V = "
    "(token, position) at the context slots, query forward like the MTP stand-in, Markov head a small bias "
    "toward the previous token; drafter PCP=1, so its K/V is written locally on every rank"
)
STAND_INS = {
    "target_model": "deterministic (token, position) function; emulated MLA KV write via the real PCP gather helper",
    "mtp_model": "deterministic (token, position) function; emulated MLA KV write via the real PCP gather helper",
    "attention_backend": "metadata builder calling the real split_decodes_and_prefills "
                         "(treat_short_extends_as_decodes=False, as under PCP)",
    "rejection_sampler": "scripted per scenario: accepted = the scheduled drafts, bonus = target top-1; "
                         "then the real get_num_sampled_and_rejected; -1 past num_sampled",
    "scheduler": "scripted requests/chunks; async scheduling (CPU cursor ahead by the last rejection)",
    "vllm_config": "SimpleNamespace with the fields the code reads; stand-in model registry",
    "runner": "GPUModelRunner methods called unbound on a SimpleNamespace self; sampler/model-state "
              "bookkeeping are no-ops",
}
DSPARK_STATUS = (
    "DSpark (replicated drafter, scenario 'dspark'): real = DSparkSpeculator.__init__ (with a real "
    "vllm.config.ParallelConfig: vllm.config.replace raises TypeError on a namespace "
    "ParallelConfig) and DFlashSpeculator.propose on the global batch: the block-table gather into "
    "input_block_tables, the Triton prepare_dflash_inputs (query/context positions and slots, unexpanded, "
    "drafter PCP=1), _store_hidden_states on the aux hidden states restored by restore_for_sampling, "
    "_precompute_context_kv, _build_uniform_attn_metadata (draft_is_prefilling), _generate_draft -> "
    "_run_model (set_forward_context) and DSpark's sequential Markov sampling loop; prepare_dflash_inputs "
    "is also run once on the pre-gather tables to record what a drafter without the gather would write "
    "(views *_no_gather). Stand-ins: the DSpark model (combine_hidden_states, precompute_and_store_context_kv, "
    "forward, compute_draft_logits, markov_embed/markov_bias, map_draft_to_target: deterministic functions "
    "writing a per-rank draft KV cache) and set_attn's init_attn_backend (a stand-in attention group). "
    "Not run: load_dspark_model (checkpoint weights), the FULL CUDA-graph replay "
    "(query_cudagraph_manager), real attention kernels, probabilistic/top-k drafting."
)


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class ScenarioRequest:
    """One scripted request: ``prompt_len`` prompt tokens, first scheduled at step ``arrive``,
    at most ``chunk`` prompt tokens a step (chunked prefill), last scheduled at ``finish``."""

    req_id: str
    prompt_len: int
    arrive: int = 0
    chunk: int | None = None
    finish: int | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    requests: tuple[ScenarioRequest, ...]
    num_steps: int
    # (step, req_id) -> drafts rejected when that step verifies (clipped to the drafts scheduled)
    rejections: Mapping[tuple[int, str], int] = field(default_factory=dict)
    drafter: str = "mtp"


SCENARIOS: dict[str, Scenario] = {
    "mixed": Scenario(
        "mixed",
        "fresh and chunked prefills next to decodes carrying K drafts, with full, partial and no "
        "rejections (docs/vllm-0.33-pcp-mtp.md's Scenario A over several steps)",
        (ScenarioRequest("d0", 13), ScenarioRequest("p1", 26, chunk=10), ScenarioRequest("d2", 5, arrive=1),
         ScenarioRequest("p3", 17, arrive=2), ScenarioRequest("d4", 7, arrive=3)),
        num_steps=5,
        rejections={(1, "d0"): 9, (2, "d0"): 1, (2, "d2"): 0, (3, "d0"): 0, (3, "d2"): 9, (3, "p1"): 1,
                    (4, "d0"): 1, (4, "d2"): 0, (4, "p1"): 9, (4, "p3"): 1},
    ),
    "decode_only": Scenario(
        "decode_only",
        "one prefill step, then decode-only steps with K drafts and rejections; requests finish until "
        "fewer decodes than ranks remain (a rank gets vLLM's zero-length placeholder row)",
        (ScenarioRequest("a0", 6), ScenarioRequest("a1", 3, finish=4), ScenarioRequest("a2", 9, finish=3)),
        num_steps=6,
        rejections={(1, "a0"): 1, (1, "a2"): 9, (2, "a1"): 1, (3, "a0"): 9, (3, "a1"): 0, (4, "a0"): 0,
                    (4, "a1"): 1, (5, "a0"): 1},
    ),
    "dspark": Scenario(
        "dspark",
        "the mixed batch with the replicated DSpark drafter's input preparation (block-table gather + "
        "prepare_dflash_inputs on the global batch), recorded with and without the gather",
        (ScenarioRequest("d0", 13), ScenarioRequest("p1", 26, chunk=10), ScenarioRequest("d2", 5, arrive=1),
         ScenarioRequest("p3", 17, arrive=2)),
        num_steps=4,
        rejections={(1, "d0"): 9, (2, "d0"): 1, (2, "d2"): 0, (3, "d0"): 0, (3, "d2"): 1, (3, "p1"): 1},
        drafter="dspark",
    ),
}


# --------------------------------------------------------------------------- stand-in models


def _next_token(tokens: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    return (5 * tokens.to(torch.int64) + 3 * positions.to(torch.int64) + 7) % vocab


class _StandInModel(torch.nn.Module):
    """Shared by the stand-in target and MTP module: hidden = [token, position + shift, ...];
    logits put their maximum on ``_next_token(hidden[:, 0], hidden[:, 1])``; the forward
    emulates an MLA layer's KV write (``update_kv_cache``) through vLLM's PCP gather."""

    def __init__(self, layer: str, vocab: int, hidden: int, kv_cache: torch.Tensor, shard_decodes: bool,
                 position_shift: int, use_pcp: bool = True) -> None:
        super().__init__()
        self.layer, self.vocab, self.hidden = layer, vocab, hidden
        self.kv_cache, self.shard_decodes, self.position_shift = kv_cache, shard_decodes, position_shift
        self.use_pcp = use_pcp  # the layer's own parallel config (False for a DSpark drafter: PCP=1)
        self.aux_hidden_states = False  # the target returns (hidden, [aux]) when the drafter wants it

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, carry: torch.Tensor | None) -> torch.Tensor:
        h = torch.zeros(ids.shape[0], self.hidden, dtype=torch.float32)
        h[:, 0] = ids.to(torch.float32)
        h[:, 1] = (positions + self.position_shift).to(torch.float32)
        h[:, 2] = torch.sin(ids.to(torch.float32) * 0.1 + positions.to(torch.float32) * 0.01)
        if carry is not None:
            h[:, 3] = carry[:, 0]
        return h

    def _write_kv(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """The MLA KV write: kv_c = [token, position] per row, slot from the forward context,
        gathered across PCP ranks exactly as MLAAttention.update_kv_cache does under PCP."""
        ctx = get_forward_context()
        md = ctx.attn_metadata.get(self.layer) if isinstance(ctx.attn_metadata, dict) else None
        slot_mapping = ctx.slot_mapping.get(self.layer) if isinstance(ctx.slot_mapping, dict) else None
        if md is None or slot_mapping is None:
            return  # profile/dummy run: attention (and the KV write) is skipped
        kv_c = torch.stack([ids.to(torch.float32), positions.to(torch.float32)], dim=1)
        k_pe = positions.to(torch.float32).reshape(-1, 1, 1)
        kv_c, _, slots = maybe_gather_mla_latent_cache_inputs(kv_c, k_pe, slot_mapping, md.num_decode_tokens,
                                                              use_pcp=self.use_pcp,
                                                              pcp_shard_decode_requests=self.shard_decodes)
        keep = slots >= 0
        self.kv_cache[slots[keep]] = kv_c[keep]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        nxt = _next_token(hidden[:, 0].round(), hidden[:, 1].round(), self.vocab)
        return -(torch.arange(self.vocab).unsqueeze(0) - nxt.unsqueeze(1)).abs().to(torch.float32)


class StandInTarget(_StandInModel):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **_: Any) -> Any:
        self._write_kv(input_ids, positions)
        hidden = self._hidden(input_ids, positions, None)
        if self.aux_hidden_states:
            return hidden, [hidden.clone()]  # one aux layer (DSpark reads the target's aux states)
        return hidden


class StandInMTP(_StandInModel):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        self._write_kv(input_ids, positions)
        return self._hidden(input_ids, positions, hidden_states)


class StandInDSpark(_StandInModel):
    """The DSpark drafter's model interface as DSparkSpeculator calls it. Query forward:
    hidden = [input id, position + 1, ...] (anchor = bonus token, the others the noise token);
    draft logits peak at ``_next_token``; the Markov head adds a small bias toward the
    previously sampled token. Context K/V and query K/V go into a per-rank draft cache
    (drafter PCP=1: no gather)."""

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states[:, : self.hidden]

    def precompute_and_store_context_kv(self, hidden_states: torch.Tensor, positions: torch.Tensor,
                                        context_slots: Any = None) -> None:
        if context_slots is None:  # dummy run
            return
        slots = context_slots[0] if isinstance(context_slots, list) else context_slots
        keep = slots >= 0
        kv = torch.stack([hidden_states[:, 0], positions.to(torch.float32)], dim=1)
        self.kv_cache[slots[keep]] = kv[keep]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: Any = None) -> torch.Tensor:
        self._write_kv(input_ids, positions)
        return self._hidden(input_ids, positions, None)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor:
        return prev.to(torch.float32).unsqueeze(1)

    def markov_bias(self, embed: torch.Tensor) -> torch.Tensor:
        return -1e-3 * (torch.arange(self.vocab).unsqueeze(0) - embed).abs()

    def map_draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


class _StandInMLAGroup:
    """An AttentionGroup stand-in: its builder computes what the MLA builder needs for the KV
    write, through vLLM's own ``split_decodes_and_prefills`` (which asserts the
    ``is_prefilling`` vLLM passes under PCP)."""

    supports_draft_decode_metadata_update = False
    kv_cache_spec = None

    def __init__(self, layer_names: list[str], decode_threshold: int) -> None:
        self.layer_names = layer_names
        self.decode_threshold = decode_threshold
        self.backend = SimpleNamespace(get_name=lambda: "PCPVIZ_STAND_IN_MLA")
        self._builder = SimpleNamespace(supports_update_block_table=False)

    def get_metadata_builder(self, ubatch_idx: int = 0) -> Any:
        return self._builder

    def build_metadata(self, common: Any, ubatch_idx: int = 0, **_: Any) -> Any:
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            common, decode_threshold=self.decode_threshold, treat_short_extends_as_decodes=False)
        return SimpleNamespace(num_decodes=num_decodes, num_prefills=num_prefills,
                               num_decode_tokens=num_decode_tokens, num_prefill_tokens=num_prefill_tokens,
                               num_actual_tokens=common.num_actual_tokens, slot_mapping=common.slot_mapping,
                               seq_lens=common.seq_lens, block_table=common.block_table_tensor)


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class _Config:
    pcp: int
    k: int
    shard: bool
    block_size: int
    max_num_reqs: int
    max_num_tokens: int
    max_model_len: int
    vocab: int
    hidden: int

    @property
    def max_blocks(self) -> int:
        return -(-self.max_model_len // self.block_size)


def _vllm_config(c: _Config, drafter: str = "mtp") -> SimpleNamespace:
    """The fields of VllmConfig that the driven code reads (a real VllmConfig needs a model
    on disk). The model registry is a stand-in that resolves to ``StandInTarget``. For the
    DSpark drafter the parallel config is a real ``ParallelConfig`` (DFlashSpeculator
    ``replace``s it with PCP=1)."""
    hf_config = SimpleNamespace(architectures=["PcpvizStandInTarget"], model_type="deepseek_v3")
    model_config = SimpleNamespace(
        model="pcpviz-stand-in", use_mla=True, is_encoder_decoder=False, hf_text_config=hf_config,
        hf_config=hf_config, max_model_len=c.max_model_len, dtype=torch.float32, use_fp64_gumbel=False,
        rswa_window=None, convert_type="none", runner_type="generate", trust_remote_code=False,
        model_impl="vllm", registry=SimpleNamespace(resolve_model_cls=lambda archs, model_config: (StandInTarget,
                                                                                                   archs[0])),
        _get_transformers_backend_cls=lambda: "TransformersForCausalLM", is_mm_prefix_lm=False,
        get_vocab_size=lambda: c.vocab)
    dspark = drafter == "dspark"
    draft_hf_config = SimpleNamespace()
    if dspark:
        draft_hf_config = SimpleNamespace(model_type="dspark_stand_in", num_hidden_layers=1,
                                          dspark_noise_token_id=c.vocab - 1, dspark_target_layer_ids=[0])
    draft_model_config = SimpleNamespace(use_mla=not dspark, hf_config=draft_hf_config,
                                         get_hidden_size=lambda: c.hidden, get_vocab_size=lambda: c.vocab)
    if dspark:
        from vllm.config import ParallelConfig

        parallel_config: Any = ParallelConfig(prefill_context_parallel_size=c.pcp)
        assert parallel_config.pcp_shard_decode_requests == c.shard
    else:
        parallel_config = SimpleNamespace(
            prefill_context_parallel_size=c.pcp, decode_context_parallel_size=1, dcp_comm_backend="ag_rs",
            pcp_shard_decode_requests=c.shard, cp_kv_cache_interleave_size=1, enable_expert_parallel=False,
            data_parallel_size=1, data_parallel_rank=0, use_sequence_parallel_moe=False, is_moe_model=False,
            tensor_parallel_size=1, pipeline_parallel_size=1)
    return SimpleNamespace(
        parallel_config=parallel_config,
        model_config=model_config,
        lora_config=None,
        speculative_config=SimpleNamespace(
            method="dspark" if dspark else "mtp", num_speculative_tokens=c.k, use_dspark=lambda: dspark,
            use_multi_module_mtp=lambda: False, draft_model_config=draft_model_config,
            use_local_argmax_reduction=False, enable_adaptive_verification=False, draft_sample_method="greedy"),
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE, fast_moe_cold_start=False,
                                           static_forward_context={}),
        scheduler_config=SimpleNamespace(max_num_seqs=c.max_num_reqs, max_num_batched_tokens=c.max_num_tokens),
    )


def _noop(*_: Any, **__: Any) -> None:
    return None


class _Rank:
    """One PCP rank's persistent objects (built on its thread: the PCP manager reads its rank
    from the fake group)."""

    def __init__(self, c: _Config, vllm_config: SimpleNamespace, manager_cls: type[PCPManager],
                 num_slots: int, drafter: str) -> None:
        self.c = c
        self.drafter = drafter
        self.vllm_config = vllm_config
        self.req_states = RequestState(max_num_reqs=c.max_num_reqs, max_model_len=c.max_model_len,
                                       max_num_batched_tokens=c.max_num_tokens, num_speculative_steps=c.k,
                                       vocab_size=c.vocab, device=CPU)
        self.block_tables = BlockTables([c.block_size], c.max_num_reqs, c.max_num_tokens, [c.max_blocks], CPU)
        self.manager = maybe_build_pcp_manager(vllm_config, CPU, False, cls=manager_cls)
        assert self.manager is not None and type(self.manager) is manager_cls
        self.manager.set_block_tables(self.block_tables)  # initialize_kv_cache
        self.rank = self.manager.pcp_rank
        self.input_buffers = InputBuffers(c.max_num_reqs, c.max_num_tokens, CPU)
        self.kv_target = torch.full((num_slots, 2), -1.0)
        self.kv_draft = torch.full((num_slots, 2), -1.0)
        self.target = StandInTarget(TARGET_LAYER, c.vocab, c.hidden, self.kv_target, c.shard, 0)
        self.target.aux_hidden_states = drafter == "dspark"  # requires_aux_hidden_states("dspark")
        draft_layer = DSPARK_LAYER if drafter == "dspark" else MTP_LAYER
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[TARGET_LAYER,
                                                                                             draft_layer])])
        self.attn_groups = [[_StandInMLAGroup([TARGET_LAYER, draft_layer], 1 + c.k)]]
        model_state = SimpleNamespace(
            num_new_sampled_tokens_per_step=1, supports_mm_inputs=False, encoder_cache=None,
            max_model_len=c.max_model_len, model_config=vllm_config.model_config,
            add_request=_noop, remove_request=_noop, apply_staged_writes=_noop, postprocess_state=_noop)
        model_state.prepare_attn = types.MethodType(DefaultModelState.prepare_attn, model_state)
        self.model_state = model_state
        # The stand-in `self` of GPUModelRunner's methods: the real state objects.
        runner = SimpleNamespace(
            req_states=self.req_states, block_tables=self.block_tables, pcp_manager=self.manager,
            input_buffers=self.input_buffers, device=CPU, max_num_reqs=c.max_num_reqs,
            decode_query_len=1 + c.k, use_pp=False, adaptive_verification=None, fast_prefill=None,
            model_config=vllm_config.model_config, model_state=model_state, is_last_pp_rank=True,
            sampler=SimpleNamespace(penalties_state=SimpleNamespace(output_bin_counts=None),
                                    apply_staged_writes=_noop, add_request=_noop),
            prompt_logprobs_worker=SimpleNamespace(add_request=_noop, remove_request=_noop),
            lora_state=SimpleNamespace(add_request=_noop, remove_request=_noop),
            pooling_runner=None, pp_handler=None, encoder_cache=None, kv_block_zeroer=None)
        runner._remove_request = types.MethodType(GPUModelRunner._remove_request, runner)
        self.runner = runner
        # The speculator, wired as GPUModelRunner.load_model / initialize_kv_cache do.
        if drafter == "dspark":
            spec = DSparkSpeculator(vllm_config, CPU)
            spec.model = StandInDSpark(draft_layer, c.vocab, c.hidden, self.kv_draft, c.shard, 1, use_pcp=False)
        else:
            spec = MTPSpeculator(vllm_config, CPU)
            spec.model = StandInMTP(draft_layer, c.vocab, c.hidden, self.kv_draft, c.shard, 1)
        spec.draft_attn_layer_names = {draft_layer}
        # set_attn(), with a stand-in attention group instead of init_attn_backend():
        spec.model_state = model_state
        spec.kv_cache_config = self.kv_cache_config
        spec.attn_groups = [[_StandInMLAGroup([draft_layer], 1 + c.k)]]
        spec.block_tables = self.block_tables
        spec.target_input_buffers = self.input_buffers
        spec.target_attn_groups = self.attn_groups
        spec._configure_decode_metadata_update()
        if drafter == "dspark":
            # DFlashSpeculator.set_attn's own part (one draft KV-cache group, shared context slots).
            spec.draft_kv_cache_group_ids = [0]
            spec.draft_kv_cache_group_id = 0
            spec._context_slot_mappings = torch.zeros(1, c.max_num_tokens, dtype=torch.int64)
            spec._layer_group_idx = None
            spec._group_causal = not spec.requires_non_causal
        spec.pcp_manager = self.manager
        self.spec = spec
        self.temperature = torch.zeros(c.max_num_reqs, dtype=torch.float32)
        self.seeds = torch.zeros(c.max_num_reqs, dtype=torch.int64)
        if drafter == "dspark":
            # Scratch buffers for prepare_dflash_inputs on the pre-gather tables (the *_no_gather views).
            n_samples = c.max_num_reqs * c.k
            self.scratch = dict(
                input_buffers=InputBuffers(c.max_num_reqs, c.max_num_tokens, CPU),
                query_slots=torch.zeros(c.max_num_tokens, dtype=torch.int64),
                context_positions=torch.zeros(c.max_num_tokens, dtype=torch.int64),
                context_slots=torch.zeros(c.max_num_tokens, dtype=torch.int64),
                sample=(torch.zeros(n_samples, dtype=torch.int64), torch.zeros(n_samples, dtype=torch.int64),
                        torch.full((n_samples,), -1, dtype=torch.int64)),
                temperature=torch.zeros(c.max_num_reqs, dtype=torch.float32),
                seeds=torch.zeros(c.max_num_reqs, dtype=torch.int64))


# --------------------------------------------------------------------------- the scripted scheduler


class _Scheduler:
    """Deterministic scheduler: prompts (chunked when asked), decodes with K drafts once a
    request has sampled, async scheduling (the CPU cursor it sends runs ahead of the GPU
    cursor by the drafts rejected in the previous step), one block allocator for all ranks."""

    def __init__(self, scenario: Scenario, c: _Config) -> None:
        self.s, self.c = scenario, c
        self.reqs = {r.req_id: r for r in scenario.requests}
        self.prompts = {r.req_id: [int(1 + (17 * i + 5 * j) % (c.vocab - 1)) for j in range(r.prompt_len)]
                        for i, r in enumerate(scenario.requests)}
        self.computed: dict[str, int] = {}  # GPU truth: tokens computed and kept
        self.lag: dict[str, int] = {}  # rejected drafts the scheduler has not seen yet
        self.sampled: dict[str, bool] = {}  # sampled in the previous step (so it has drafts)
        self.blocks: dict[str, list[int]] = {}
        self.next_block = 1  # block 0 is the null block
        self.finished: set[str] = set()

    @property
    def num_slots(self) -> int:
        total = sum(-(-(r.prompt_len + (self.s.num_steps + 1) * (self.c.k + 1) + self.c.k) // self.c.block_size)
                    for r in self.s.requests)
        return (total + 2) * self.c.block_size

    def _active(self, step: int) -> list[str]:
        return [r.req_id for r in self.s.requests
                if r.arrive <= step and (r.finish is None or step <= r.finish)]

    def schedule(self, step: int, drafts: bool) -> tuple[SchedulerOutput, dict[str, int]]:
        """The step's SchedulerOutput and the drafts scheduled per request."""
        c = self.c
        out = SchedulerOutput.make_empty()
        cached = CachedRequestData.make_empty()
        num_drafts: dict[str, int] = {}
        finished = {rid for rid, r in self.reqs.items()
                    if r.finish is not None and step == r.finish + 1 and rid not in self.finished}
        self.finished |= finished
        out.finished_req_ids = finished
        for rid in self._active(step):
            r = self.reqs[rid]
            new = rid not in self.computed
            done = self.computed.get(rid, 0)
            if done < r.prompt_len:
                q = r.prompt_len - done if r.chunk is None else min(r.chunk, r.prompt_len - done)
                nd = 0
            else:
                nd = c.k if (drafts and self.sampled.get(rid, False)) else 0
                q = 1 + nd
            cpu_cursor = done + self.lag.get(rid, 0)
            need = -(-(cpu_cursor + q + c.k) // c.block_size)
            have = self.blocks.setdefault(rid, [])
            fresh = list(range(self.next_block, self.next_block + max(0, need - len(have))))
            self.next_block += len(fresh)
            have.extend(fresh)
            out.num_scheduled_tokens[rid] = q
            if nd:
                out.scheduled_spec_decode_tokens[rid] = [-1] * nd
                num_drafts[rid] = nd
            if new:
                out.scheduled_new_reqs.append(NewRequestData(
                    req_id=rid, prompt_token_ids=self.prompts[rid], mm_features=[], sampling_params=None,
                    pooling_params=None, block_ids=(list(have),), num_computed_tokens=0, lora_request=None,
                    prefill_token_ids=self.prompts[rid]))
            else:
                cached.req_ids.append(rid)
                cached.num_computed_tokens.append(cpu_cursor)
                cached.new_block_ids.append((fresh,) if fresh else None)
                cached.num_output_tokens.append(0)
        out.scheduled_cached_reqs = cached
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.num_spec_tokens_to_schedule = c.k if drafts else 0
        return out, num_drafts

    def rejected(self, step: int, rid: str, num_drafts: int) -> int:
        return min(int(self.s.rejections.get((step, rid), 0)), num_drafts)

    def update(self, out: SchedulerOutput, req_ids: Sequence[str], num_sampled: np.ndarray,
               num_rejected: np.ndarray) -> None:
        for i, rid in enumerate(req_ids):
            q = out.num_scheduled_tokens[rid]
            self.computed[rid] = self.computed.get(rid, 0) + q - int(num_rejected[i])
            self.lag[rid] = int(num_rejected[i])
            self.sampled[rid] = bool(num_sampled[i] > 0)


# --------------------------------------------------------------------------- one step on one rank


@dataclass
class _StepOut:
    req_ids: list[str]
    num_sampled: np.ndarray
    num_rejected: np.ndarray
    sampled: np.ndarray
    draft_tokens: np.ndarray
    slot_mapping_gathered: np.ndarray
    local_num_tokens: int
    dflash_no_gather: dict[str, np.ndarray] | None = None


def _stand_in_sampler(st: _Rank, hidden: torch.Tensor, batch: InputBatch, step: int,
                      sched: _Scheduler) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scripted rejection sampling on the restored global batch: request i accepts its first
    nd - rejected drafts (the scheduled drafts themselves), then the target's top-1 at the
    next logits row is the bonus token; vLLM's get_num_sampled_and_rejected then applies the
    chunked-prefill rule. Rows past num_sampled are -1."""
    k = st.c.k
    r = batch.num_reqs
    logits = st.target.compute_logits(hidden[batch.logits_indices])
    top1 = logits.argmax(dim=-1)
    cu = batch.cu_num_logits_np
    nd = np.zeros(r, dtype=np.int64) if batch.num_draft_tokens_per_req is None else \
        batch.num_draft_tokens_per_req.astype(np.int64)
    sampled = torch.full((r, k + 1), -1, dtype=torch.int64)
    num_sampled = torch.zeros(r, dtype=torch.int32)
    qsl = batch.query_start_loc_np
    for i, rid in enumerate(batch.req_ids):
        accepted = int(nd[i]) - sched.rejected(step, rid, int(nd[i]))
        draft_rows = int(qsl[i + 1]) - int(nd[i]) + np.arange(accepted)
        if accepted:
            sampled[i, :accepted] = batch.input_ids[torch.from_numpy(draft_rows)].to(torch.int64)
        sampled[i, accepted] = top1[int(cu[i]) + accepted]
        num_sampled[i] = accepted + 1
    num_sampled, num_rejected = get_num_sampled_and_rejected(
        num_sampled, batch.seq_lens, batch.cu_num_logits, batch.idx_mapping, st.req_states.prefill_len.gpu)
    past = torch.arange(k + 1).unsqueeze(0) >= num_sampled.to(torch.int64).unsqueeze(1)
    sampled[past] = -1
    return sampled, num_sampled, num_rejected


def _rank_step(st: _Rank, out: SchedulerOutput, step: int, sched: _Scheduler) -> _StepOut:
    c, runner, manager = st.c, st.runner, st.manager
    # execute_model: request-state updates (GPUModelRunner's own methods, stand-in self)
    GPUModelRunner.finish_requests(runner, out)
    GPUModelRunner.add_requests(runner, out)
    GPUModelRunner.update_requests(runner, out)
    st.block_tables.apply_staged_writes()
    batch_req_state, uniform = GPUModelRunner.gather_batch_req_state(runner, out, False)
    num_toks = manager.get_num_tokens_for_dispatch(batch_req_state.num_scheduled_tokens,
                                                   batch_req_state.is_prefilling_np)
    batch_desc, _ = dispatch_cg_and_sync_dp(None, len(out.num_scheduled_tokens), num_toks, uniform, 1, 0,
                                            need_eager=True)
    local = GPUModelRunner.prepare_inputs(runner, out, batch_req_state, batch_desc, 0)  # partition_batch inside
    block_tables, slot_mappings = GPUModelRunner.prepare_attn(runner, local)
    attn_metadata = st.model_state.prepare_attn(local, batch_desc.cg_mode, block_tables, slot_mappings,
                                                st.attn_groups, st.kv_cache_config)
    slot_by_layer = build_slot_mappings_by_layer(slot_mappings, st.kv_cache_config)
    with torch.inference_mode():
        with set_forward_context(attn_metadata, st.vllm_config, num_tokens=local.num_tokens_after_padding,
                                 cudagraph_runtime_mode=batch_desc.cg_mode,
                                 batch_descriptor=BatchDescriptor(num_tokens=local.num_tokens_after_padding),
                                 slot_mapping=slot_by_layer, is_padding=local.is_padding):
            model_output = st.target(local.input_ids, local.positions)
        hidden, aux = model_output if isinstance(model_output, tuple) else (model_output, None)
        # sample_tokens
        draft_hidden = hidden
        hidden, aux, batch = manager.restore_for_sampling(hidden, aux)
        sampled, num_sampled, num_rejected = _stand_in_sampler(st, hidden, batch, step, sched)
        GPUModelRunner.postprocess_sampled(runner, batch.idx_mapping, sampled, num_sampled, num_rejected,
                                           batch.query_start_loc)
        st.spec.observe_verification(batch.idx_mapping, num_sampled, num_rejected)
        no_gather = None
        if st.drafter == "dspark":
            no_gather = _dflash_inputs_without_gather(st, batch, num_sampled, num_rejected)
        draft_tokens = st.spec.propose(
            batch, attn_metadata, slot_by_layer, get_drafter_hidden_states(st.target, draft_hidden), aux,
            num_sampled, num_rejected, st.req_states.last_sampled_tokens, st.req_states.next_prefill_tokens,
            st.temperature, st.seeds, num_speculative_tokens=c.k, is_profile=True)
        st.req_states.draft_tokens[batch.idx_mapping] = draft_tokens
    return _StepOut(list(batch.req_ids), num_sampled.numpy().copy(), num_rejected.numpy().copy(),
                    sampled.numpy().copy(), draft_tokens.clone().numpy(), slot_mappings.clone().numpy(),
                    int(local.num_tokens), no_gather)


def _dflash_inputs_without_gather(st: _Rank, batch: InputBatch, num_sampled: torch.Tensor,
                                  num_rejected: torch.Tensor) -> dict[str, np.ndarray]:
    """What DSpark's prepare_dflash_inputs would compute if DFlashSpeculator.propose skipped
    its PCP block-table gather: the same kernel, into scratch buffers, on input_block_tables
    as they are before propose (the previous gather's rows, or zeros: the PCP target path
    never writes them). Recorded into draft_0 as *_no_gather views."""
    c, spec, sc = st.c, st.spec, st.scratch
    r, gid = batch.num_reqs, 0
    table = st.block_tables.input_block_tables[gid]
    rows = table[:r].clone()
    dflash_speculator.prepare_dflash_inputs(
        sc["input_buffers"], sc["query_slots"], sc["context_positions"], sc["context_slots"], *sc["sample"],
        sc["temperature"], sc["seeds"], batch, num_sampled, num_rejected, st.req_states.last_sampled_tokens,
        st.req_states.next_prefill_tokens, st.temperature, st.seeds, table, st.block_tables.block_sizes[gid],
        st.block_tables.cp_rank, spec.dcp_size, st.block_tables.cp_interleave, spec.parallel_drafting_token_id,
        spec.num_query_per_req, spec.num_speculative_steps, spec.max_num_reqs, spec.max_num_tokens,
        spec.max_model_len, spec.sample_from_anchor, r)
    nq = r * spec.num_query_per_req
    out = {"slot_mapping_draft_no_gather": sc["query_slots"][:nq].clone().numpy()[None],
           "draft_context_slot_mapping_no_gather": sc["context_slots"][: batch.num_tokens].clone().numpy()[None],
           "block_table_draft_no_gather": rows.numpy()[None]}
    rec = recording.recorder_of(st.manager)
    if rec is not None:
        rec.guard(rec.put, "draft_0", **out)
    return out


def _dummy_step(st: _Rank, group: FakePCPGroup) -> dict[str, Any]:
    """A profile run as ``GPUModelRunner._dummy_run(is_profile=True, skip_attn=True)`` does
    it: a dummy InputBatch staged in the PCP buffers, the target forward without attention,
    then ``propose(dummy_run=True)``. Returns what it did (all measured, not assumed)."""
    c, spec = st.c, st.spec
    num_reqs = min(c.max_num_reqs, 4)
    num_tokens = num_reqs * (1 + c.k)
    tables_before = [t.clone() for t in st.block_tables.input_block_tables]
    all_gathers_before = group.all_gather_calls[st.rank]
    with torch.inference_mode():
        batch = InputBatch.make_dummy(num_reqs, num_tokens, st.input_buffers)
        batch = st.manager.prepare_inputs_for_capture_or_profile(batch)
        with set_forward_context(None, st.vllm_config, num_tokens=num_tokens):
            model_output = st.target(batch.input_ids, batch.positions)
        hidden, aux = model_output if isinstance(model_output, tuple) else (model_output, None)
        draft = spec.propose(
            input_batch=batch, attn_metadata=None, slot_mappings=None,
            last_hidden_states=get_drafter_hidden_states(st.target, hidden), aux_hidden_states=aux,
            num_sampled=torch.ones(num_reqs, dtype=torch.int32), num_rejected=torch.zeros(num_reqs, dtype=torch.int32),
            last_sampled=st.req_states.last_sampled_tokens, next_prefill_tokens=st.req_states.next_prefill_tokens,
            temperature=st.temperature, seeds=st.seeds, dummy_run=True, skip_attn_for_dummy_run=True,
            is_profile=True)
    out = {
        "all_gathers": group.all_gather_calls[st.rank] - all_gathers_before,
        "input_block_tables_unchanged": all(torch.equal(a, b) for a, b in zip(tables_before,
                                                                               st.block_tables.input_block_tables)),
        "draft_prefill_batch_none": st.manager.draft_prefill_batch is None,
        "draft_tokens": draft.clone().numpy(),
    }
    if st.drafter == "mtp":
        out["idx_mapping_all_pad"] = bool((spec.idx_mapping == -1).all())
    return out


# --------------------------------------------------------------------------- the driver


@dataclass
class ReplayResult:
    """What a replay did. ``trace_path`` is None when nothing was recorded."""

    trace_path: Path | None
    scenario: str
    pcp: int
    num_speculative_tokens: int
    shard_decode_requests: bool
    steps: list[list[_StepOut]]  # [step][rank]
    dummy: list[dict[str, Any]] | None  # per rank
    kv_target: list[np.ndarray]  # per rank, [slots, 2] (token, position) or -1
    kv_draft: list[np.ndarray]
    all_gathers: list[int]  # per rank, every collective of the run
    seconds: float
    step_seconds: list[float]
    recording_seconds: float
    meta: dict[str, Any]
    manager_class: type = PCPManager  # the PCPManager (sub)class every rank was built with

    @property
    def trace(self):
        """The recorded trace (``pcpviz.trace.open(trace_path)``)."""
        if self.trace_path is None:
            raise ValueError("this replay recorded no trace (record=False or no trace_dir)")
        from pcpviz.trace import open as open_trace

        return open_trace(self.trace_path)

    def draft_tokens(self, rank: int = 0) -> list[np.ndarray | None]:
        return [s[rank].draft_tokens for s in self.steps]


def _validate(pcp: int, mtp: int, scenario: str, decodes: str, block_size: int) -> Scenario:
    if not isinstance(pcp, int) or pcp < 2:
        raise ValueError(f"pcp must be an int >= 2 (PCP is off at 1), got {pcp!r}")
    if pcp > 8:
        raise ValueError(f"pcp={pcp}: the CPU replay runs ranks as threads; use at most 8")
    if not isinstance(mtp, int) or not 1 <= mtp <= 4:
        raise ValueError(f"mtp (num_speculative_tokens) must be an int in 1..4, got {mtp!r}")
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    if decodes not in ("sharded", "replicated"):
        raise ValueError(f"decodes must be 'sharded' or 'replicated', got {decodes!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if SCENARIOS[scenario].drafter == "dspark" and decodes != "sharded":
        raise ValueError("the dspark scenario runs with a real ParallelConfig, whose pcp_shard_decode_requests "
                         "is PCP > 1 and DCP == 1: decodes are sharded")
    return SCENARIOS[scenario]


def replay(
    pcp: int = 2,
    mtp: int = 2,
    trace_dir: str | os.PathLike | None = None,
    scenario: str = "mixed",
    decodes: str = "sharded",
    *,
    record: bool = True,
    block_size: int = 4,
    dummy: bool = True,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> ReplayResult:
    """Run ``scenario`` through vLLM 0.33.0's real PCP + MTP code on CPU, ``pcp`` ranks as
    threads, ``mtp`` speculative tokens; record a trace into ``trace_dir`` (when given and
    ``record``) through ``RecordingPCPManager`` and the speculator wrappers.

    ``decodes="sharded"`` is vLLM's default for PCP without DCP; ``"replicated"`` runs
    decodes on every rank with rank 0 as the canonical KV writer (what vLLM does under
    DCP > 1; the replay sets the flag directly with DCP kept at 1, as in Scenario B of
    ``docs/vllm-0.33-pcp-mtp.md``). ``record=False`` builds plain ``PCPManager``s (the recording-off
    baseline). ``dummy`` appends a profile run (``propose(dummy_run=True)``) as the last
    step, phase ``dummy``; it must do no block-table gather and no collective (asserted).
    Raises ValueError for bad arguments.
    """
    sc = _validate(pcp, mtp, scenario, decodes, block_size)
    c = _Config(pcp=pcp, k=mtp, shard=decodes == "sharded", block_size=block_size, max_num_reqs=8,
                max_num_tokens=96, max_model_len=128, vocab=97, hidden=8)
    recording.install_wrappers()
    sched = _Scheduler(sc, c)
    vllm_config = _vllm_config(c, sc.drafter)
    if not record:
        manager_cls: type[PCPManager] = PCPManager
    elif trace_dir is not None:
        manager_cls = RecordingPCPManager
    else:
        # What GPUModelRunner.__init__ would build: its pcp_manager_cls property (the plugin's
        # RecordingPCPManager when the plugin is enabled), recording into the plugin's session.
        manager_cls = GPUModelRunner.__dict__["pcp_manager_cls"].fget(None)
    meta = {
        "producer": PRODUCER, "vllm_version": vllm.__version__, "pcp": pcp, "dcp": 1,
        "num_speculative_tokens": mtp, "block_size": block_size, "block_sizes": [block_size],
        "shard_decode_requests": c.shard, "scenario": sc.name, "scenario_description": sc.description,
        "speculative_method": "dspark" if sc.drafter == "dspark" else "mtp",
        "models": MODELS_DECLARATION, "stand_ins": STAND_INS, "model": "pcpviz stand-in (no weights)",
        "max_num_seqs": c.max_num_reqs, "max_num_batched_tokens": c.max_num_tokens,
        "max_model_len": c.max_model_len, "vocab_size": c.vocab, "cudagraph_mode": "NONE",
        "prompt_token_ids": {rid: p for rid, p in sched.prompts.items()},
    }
    if sc.drafter == "dspark":
        meta["dspark_status"] = DSPARK_STATUS
        meta["models"] = MODELS_DECLARATION + "; " + DSPARK_MODEL_DECLARATION
        meta["stand_ins"] = {**STAND_INS, "dspark_model": DSPARK_MODEL_DECLARATION}
    group = FakePCPGroup(pcp, timeout=120.0)
    t_start = time.perf_counter()
    states: list[_Rank | None] = [None] * pcp
    steps: list[list[_StepOut]] = []
    step_seconds: list[float] = []
    dummy_out = None

    def build(rank: int) -> None:
        states[rank] = _Rank(c, vllm_config, manager_cls, sched.num_slots, sc.drafter)

    def run_all(sess: recording.TraceSession | None) -> None:
        nonlocal dummy_out
        run_ranks(group, build)
        for step in range(sc.num_steps):
            t0 = time.perf_counter()
            out, _ = sched.schedule(step, True)
            outs = run_ranks(group, lambda rank: _rank_step(states[rank], out, step, sched))
            step_seconds.append(time.perf_counter() - t0)
            ref = outs[0]
            for rank, o in enumerate(outs[1:], start=1):
                for name in ("num_sampled", "num_rejected", "sampled"):
                    if not np.array_equal(getattr(ref, name), getattr(o, name)):
                        raise RuntimeError(f"step {step}: rank {rank} {name} differs from rank 0's")
                if not np.array_equal(ref.draft_tokens, o.draft_tokens):
                    raise RuntimeError(f"step {step}: rank {rank} drafted other tokens than rank 0")
            sched.update(out, ref.req_ids, ref.num_sampled, ref.num_rejected)
            steps.append(outs)
            if progress is not None:
                progress(f"step {step}: {len(ref.req_ids)} requests, local tokens "
                         f"{[o.local_num_tokens for o in outs]}, drafts "
                         f"{ref.draft_tokens.tolist()}")
        if dummy:
            dummy_out = run_ranks(group, lambda rank: _dummy_step(states[rank], group))
            for rank, d in enumerate(dummy_out):
                bad = {k: v for k, v in d.items() if k != "draft_tokens" and v not in (0, True)}
                if bad:
                    raise RuntimeError(f"dummy run on rank {rank}: {bad} (expected no block-table gather, "
                                       "no all_gather, idx_mapping all -1)")

    trace_path = None
    rec_seconds = 0.0
    if record and trace_dir is not None:
        trace_path = Path(trace_dir)
        _check_run_dir(trace_path, overwrite)
        with recording.session(trace_path, producer=PRODUCER, meta=meta, strict=True, record_dummy=True,
                               overwrite=overwrite) as sess:
            run_all(sess)
        rec_seconds = sess.seconds_recording
    else:
        run_all(None)
        ambient = recording.active_session() if issubclass(manager_cls, RecordingPCPManager) else None
        mine = [recording.recorder_of(s.manager) or getattr(s.manager, "_pcpviz_recorder", None) for s in states]
        if ambient is not None and any(r is not None for r in mine):
            for r in mine:
                if r is not None:
                    r.close()
            trace_path = ambient.run_dir
            rec_seconds = sum(r.seconds for r in mine if r is not None)
    return ReplayResult(
        trace_path=trace_path, scenario=sc.name, pcp=pcp, num_speculative_tokens=mtp, shard_decode_requests=c.shard,
        steps=steps, dummy=dummy_out,
        kv_target=[s.kv_target.numpy().copy() for s in states], kv_draft=[s.kv_draft.numpy().copy() for s in states],
        all_gathers=list(group.all_gather_calls), seconds=time.perf_counter() - t_start, step_seconds=step_seconds,
        recording_seconds=rec_seconds, meta=meta, manager_class=type(states[0].manager))


def _check_run_dir(path: Path, overwrite: bool) -> None:
    if path.exists() and not path.is_dir():
        raise ValueError(f"trace dir {path} exists and is not a directory")
    if path.is_dir() and not overwrite and any(path.glob("rank*.arrow")):
        raise ValueError(f"trace dir {path} already holds a trace; pass overwrite=True or choose a new directory")


class _CallableModule(types.ModuleType):
    """``pcpviz.vllm.replay(...)`` calls ``replay()``: the package attribute ``replay`` is this
    module once it is imported, so the module itself is made callable."""

    def __call__(self, *args: Any, **kwargs: Any) -> ReplayResult:
        return replay(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
