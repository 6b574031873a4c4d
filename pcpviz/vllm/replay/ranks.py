"""One PCP rank's persistent objects in the replay, wired as ``GPUModelRunner.__init__`` /
``load_model`` / ``initialize_kv_cache`` wire them on a GPU, with the stand-in configuration.

A ``RankState`` is built on its rank's thread (vLLM's ``maybe_build_pcp_manager`` reads the
PCP rank from the thread's ``FakePCPGroup``): the real ``RequestState``, ``BlockTables``,
``InputBuffers``, PCP manager and speculator (``MTPSpeculator`` or ``DSparkSpeculator``), the
stand-in models, and ``runner``, a ``SimpleNamespace`` that GPUModelRunner's methods are
called on unbound. With PCP=2, ``run_ranks(group, lambda r: RankState(...))`` gives two
states whose ``manager.pcp_rank`` is 0 and 1.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.input_batch import InputBuffers
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.pcp_manager import PCPManager, maybe_build_pcp_manager
from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator
from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator
from vllm.v1.worker.gpu.states import RequestState

from pcpviz.vllm.replay.stand_ins import (DSPARK_LAYER, MTP_LAYER, TARGET_LAYER, StandInDSpark,
                                          StandInMLAGroup, StandInMTP, StandInTarget)
from pcpviz.vllm.replay.tiny import TinyMTP, TinyTarget, tiny_model

__all__ = ["CPU", "ReplayConfig", "stand_in_vllm_config", "RankState"]

CPU = torch.device("cpu")


@dataclass(frozen=True)
class ReplayConfig:
    pcp: int
    k: int
    shard: bool
    block_size: int
    max_num_reqs: int
    max_num_tokens: int
    max_model_len: int
    vocab: int
    hidden: int
    models: str = "scripted"  # "tiny": the checkpoint's weights (pcpviz.vllm.replay.tiny); "scripted": stand_ins
    model_dir: str | None = None  # models="tiny": the checkpoint (None: data/models/pcpviz-tiny-dsv3)
    moe_experts: int = 0  # the checkpoint's routed experts (0: dense), hf_config.n_routed_experts

    @property
    def max_blocks(self) -> int:
        return -(-self.max_model_len // self.block_size)


def stand_in_vllm_config(c: ReplayConfig, drafter: str = "mtp") -> SimpleNamespace:
    """The fields of VllmConfig that the driven code reads (a real VllmConfig needs a model
    on disk). The model registry is a stand-in that resolves to ``StandInTarget``. For the
    DSpark drafter the parallel config is a real ``ParallelConfig`` (DFlashSpeculator
    ``replace``s it with PCP=1)."""
    hf_config = SimpleNamespace(architectures=["PcpvizStandInTarget"], model_type="deepseek_v3",
                                n_routed_experts=c.moe_experts or None)  # read for run.json's model_moe
    model_config = SimpleNamespace(
        model=c.model_dir or "pcpviz-stand-in", use_mla=True, is_encoder_decoder=False, hf_text_config=hf_config,
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
            data_parallel_size=1, data_parallel_rank=0, use_sequence_parallel_moe=False,
            is_moe_model=bool(c.moe_experts),
            tensor_parallel_size=1, pipeline_parallel_size=1)
    return SimpleNamespace(
        parallel_config=parallel_config,
        model_config=model_config,
        lora_config=None,
        speculative_config=SimpleNamespace(
            method="dspark" if dspark else "mtp", num_speculative_tokens=c.k, use_dspark=lambda: dspark,
            use_multi_module_mtp=lambda: False, draft_model_config=draft_model_config,
            use_local_argmax_reduction=False, enable_adaptive_verification=False, draft_sample_method="greedy",
            uses_dynamic_speculative_decoding=lambda: False),
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE, fast_moe_cold_start=False,
                                           static_forward_context={}, cudagraph_capture_sizes=[],
                                           max_cudagraph_capture_size=0),
        scheduler_config=SimpleNamespace(max_num_seqs=c.max_num_reqs, max_num_batched_tokens=c.max_num_tokens),
        cache_config=SimpleNamespace(use_kda_recoverssm=False),  # read by the CUDA-graph managers
        num_speculative_tokens=c.k,
    )


def _noop(*_: Any, **__: Any) -> None:
    return None


def _target(c: ReplayConfig, num_slots: int, kv: torch.Tensor) -> torch.nn.Module:
    """The target model: the tiny checkpoint (``c.models == "tiny"``) or the weightless stand-in."""
    if c.models == "tiny":
        tiny = tiny_model(c.model_dir)
        return TinyTarget(TARGET_LAYER, tiny, num_slots=num_slots, block_size=c.block_size, bookkeeping=kv,
                          shard_decodes=c.shard, use_pcp=c.pcp > 1, layer_ids=list(range(tiny.config.num_layers)))
    return StandInTarget(TARGET_LAYER, c.vocab, c.hidden, kv, c.shard, 0, use_pcp=c.pcp > 1)


def _mtp(c: ReplayConfig, num_slots: int, kv: torch.Tensor) -> torch.nn.Module:
    """The MTP module: the checkpoint's MTP layer (layer ``num_hidden_layers``) or the stand-in."""
    if c.models == "tiny":
        tiny = tiny_model(c.model_dir)
        return TinyMTP(MTP_LAYER, tiny, num_slots=num_slots, block_size=c.block_size, bookkeeping=kv,
                       shard_decodes=c.shard, use_pcp=c.pcp > 1, layer_ids=[tiny.config.num_layers])
    return StandInMTP(MTP_LAYER, c.vocab, c.hidden, kv, c.shard, 1, use_pcp=c.pcp > 1)


class RankState:
    """One PCP rank's persistent objects (built on its thread: the PCP manager reads its rank
    from the fake group)."""

    def __init__(self, c: ReplayConfig, vllm_config: SimpleNamespace, manager_cls: type[PCPManager],
                 num_slots: int, drafter: str) -> None:
        self.c, self.drafter, self.vllm_config = c, drafter, vllm_config
        self.req_states = RequestState(max_num_reqs=c.max_num_reqs, max_model_len=c.max_model_len,
                                       max_num_batched_tokens=c.max_num_tokens, num_speculative_steps=c.k,
                                       vocab_size=c.vocab, device=CPU)
        self.block_tables = BlockTables([c.block_size], c.max_num_reqs, c.max_num_tokens, [c.max_blocks], CPU)
        self.manager = maybe_build_pcp_manager(vllm_config, CPU, False, cls=manager_cls)  # None at PCP = 1
        assert self.manager is None if c.pcp == 1 else type(self.manager) is manager_cls
        if self.manager is not None:
            self.manager.set_block_tables(self.block_tables)  # initialize_kv_cache
        self.rank = 0 if self.manager is None else self.manager.pcp_rank
        self.input_buffers = InputBuffers(c.max_num_reqs, c.max_num_tokens, CPU)
        self.kv_target = torch.full((num_slots, 2), -1.0)
        self.kv_draft = torch.full((num_slots, 2), -1.0)
        self.target = _target(c, num_slots, self.kv_target)
        self.target.aux_hidden_states = drafter == "dspark"  # requires_aux_hidden_states("dspark")
        draft_layer = DSPARK_LAYER if drafter == "dspark" else MTP_LAYER
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[TARGET_LAYER,
                                                                                             draft_layer])])
        self.attn_groups = [[StandInMLAGroup([TARGET_LAYER, draft_layer], 1 + c.k)]]
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
            spec.model = _mtp(c, num_slots, self.kv_draft)
        spec.draft_attn_layer_names = {draft_layer}
        # set_attn(), with a stand-in attention group instead of init_attn_backend():
        spec.model_state = model_state
        spec.kv_cache_config = self.kv_cache_config
        spec.attn_groups = [[StandInMLAGroup([draft_layer], 1 + c.k)]]
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
        self.spec = runner.speculator = spec  # runner.speculator: recording.attach_runner (PCP = 1)
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
