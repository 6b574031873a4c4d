"""One scheduler step on one PCP rank, through vLLM's own methods (``rank_step``), and the
profile run (``dummy_step``).

``rank_step`` does what ``GPUModelRunner.execute_model`` + ``sample_tokens`` + ``propose_draft``
do, in order: the request-state updates, ``gather_batch_req_state``, the CUDA-graph dispatch
(``need_eager=True``), ``prepare_inputs`` (``partition_batch`` inside), ``prepare_attn``, the
stand-in target forward under ``set_forward_context``, ``restore_for_sampling``, the scripted
rejection (``stand_in_sampler``) and ``postprocess_sampled``, then the speculator's ``propose``.

Scripted rejection, K=2: a decode scheduled drafts ``[41, 7]`` with ``rejections = 1`` accepts
``41``, then the target's top-1 at the next logits row is the bonus token:
``sampled_token_ids = [41, b, -1]``, ``num_sampled = 2``, ``num_rejected = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.forward_context import BatchDescriptor, set_forward_context
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer
from vllm.v1.worker.gpu.dp_utils import dispatch_cg_and_sync_dp
from vllm.v1.worker.gpu.input_batch import InputBatch, get_num_sampled_and_rejected
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_speculator
from vllm.v1.worker.gpu.spec_decode.utils import get_drafter_hidden_states

from pcpviz.vllm import recording
from pcpviz.vllm.fake_group import FakePCPGroup
from pcpviz.vllm.replay.ranks import RankState
from pcpviz.vllm.replay.scheduler import ScriptedScheduler

__all__ = ["StepOut", "stand_in_sampler", "rank_step", "dflash_inputs_without_gather", "dummy_step"]


@dataclass
class StepOut:
    req_ids: list[str]
    num_sampled: np.ndarray
    num_rejected: np.ndarray
    sampled: np.ndarray
    draft_tokens: np.ndarray
    slot_mapping_gathered: np.ndarray
    local_num_tokens: int
    dflash_no_gather: dict[str, np.ndarray] | None = None


def stand_in_sampler(st: RankState, hidden: torch.Tensor, batch: InputBatch, *, step: int,
                      sched: ScriptedScheduler) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rejection sampling on the restored global batch. With the tiny model (``st.c.models ==
    "tiny"``) it is greedy, as vLLM's rejection sampler at temperature 0: request i accepts its
    drafts while each equals the target's top-1 at its logits row; scripted stand-ins accept the
    first nd - rejected drafts the scenario names. Then the target's top-1 at the next logits row
    is the bonus token, and vLLM's get_num_sampled_and_rejected applies the chunked-prefill rule.
    Rows past num_sampled are -1."""
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
    greedy = st.c.models == "tiny"
    for i, rid in enumerate(batch.req_ids):
        drafts = batch.input_ids[int(qsl[i + 1]) - int(nd[i]):int(qsl[i + 1])].to(torch.int64)
        if greedy:  # temperature 0: accept while the draft is the target's top-1 at its row
            hits = (drafts == top1[int(cu[i]):int(cu[i]) + int(nd[i])]).to(torch.int64)
            accepted = int(hits.cumprod(0).sum()) if len(hits) else 0
        else:
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


def rank_step(st: RankState, out: SchedulerOutput, *, step: int, sched: ScriptedScheduler,
              eager_drafts: bool = True) -> StepOut:
    """One step on one rank. ``eager_drafts=False`` lets ``propose`` dispatch its draft forwards
    through the speculator's CUDA-graph managers (``pcpviz.vllm.replay.graph_dispatch``); by default it
    runs them eagerly (``is_profile=True``: there are no graph managers on CPU)."""
    c, runner, manager = st.c, st.runner, st.manager
    # execute_model: request-state updates (GPUModelRunner's own methods, stand-in self)
    GPUModelRunner.finish_requests(runner, out)
    GPUModelRunner.add_requests(runner, out)
    GPUModelRunner.update_requests(runner, out)
    st.block_tables.apply_staged_writes()
    batch_req_state, uniform = GPUModelRunner.gather_batch_req_state(runner, out, False)
    num_toks = batch_req_state.num_tokens if manager is None else manager.get_num_tokens_for_dispatch(
        batch_req_state.num_scheduled_tokens, batch_req_state.is_prefilling_np)
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
        hidden, aux, batch = (hidden, aux, local) if manager is None else manager.restore_for_sampling(hidden, aux)
        sampled, num_sampled, num_rejected = stand_in_sampler(st, hidden, batch, step=step, sched=sched)
        GPUModelRunner.postprocess_sampled(runner, batch.idx_mapping, sampled, num_sampled, num_rejected,
                                           batch.query_start_loc)
        st.spec.observe_verification(batch.idx_mapping, num_sampled, num_rejected)
        no_gather = None
        if st.drafter == "dspark":
            no_gather = dflash_inputs_without_gather(st, batch, num_sampled=num_sampled, num_rejected=num_rejected)
        draft_tokens = st.spec.propose(
            batch, attn_metadata, slot_by_layer, get_drafter_hidden_states(st.target, draft_hidden), aux,
            num_sampled, num_rejected, st.req_states.last_sampled_tokens, st.req_states.next_prefill_tokens,
            st.temperature, st.seeds, num_speculative_tokens=c.k, is_profile=eager_drafts)
        st.req_states.draft_tokens[batch.idx_mapping] = draft_tokens
    return StepOut(list(batch.req_ids), num_sampled.numpy().copy(), num_rejected.numpy().copy(),
                    sampled.numpy().copy(), draft_tokens.clone().numpy(), slot_mappings.clone().numpy(),
                    int(local.num_tokens), no_gather)


def dflash_inputs_without_gather(st: RankState, batch: InputBatch, *, num_sampled: torch.Tensor,
                                  num_rejected: torch.Tensor) -> dict[str, np.ndarray]:
    """What DSpark's prepare_dflash_inputs would compute if DFlashSpeculator.propose skipped
    its PCP block-table gather: the same kernel, into scratch buffers, on input_block_tables
    as they are before propose (the previous gather's rows, or zeros: the PCP target path
    never writes them). Recorded into draft_0 as *_no_gather views."""
    spec, sc = st.spec, st.scratch
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
    rec = recording.owner_recorder(st.runner)
    if rec is not None:
        rec.guard(rec.put, "draft_0", **out)
    return out


def dummy_step(st: RankState, group: FakePCPGroup) -> dict[str, Any]:
    """A profile run as ``GPUModelRunner._dummy_run(is_profile=True, skip_attn=True)`` does
    it: a dummy InputBatch staged in the PCP buffers, the target forward without attention,
    then ``propose(dummy_run=True)``. Returns what it did (all measured, not assumed).
    ``all_gathers`` counts the gathers other than a MoE layer's (each MoE forward under PCP makes
    two, its rows and router logits, per reduce-scatter: ``moe_runner.py:824-829, 853-861``), and
    ``moe_reduce_scatters`` the MoE layers' reduce-scatters (0 for a dense model)."""
    c, spec = st.c, st.spec
    num_reqs = min(c.max_num_reqs, 4)
    num_tokens = num_reqs * (1 + c.k)
    tables_before = [t.clone() for t in st.block_tables.input_block_tables]
    all_gathers_before = group.all_gather_calls[st.rank]
    scatters_before = group.reduce_scatter_calls[st.rank]
    with torch.inference_mode():
        batch = InputBatch.make_dummy(num_reqs, num_tokens, st.input_buffers)
        if st.manager is not None:
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
    scatters = group.reduce_scatter_calls[st.rank] - scatters_before
    out = {
        "all_gathers": group.all_gather_calls[st.rank] - all_gathers_before - 2 * scatters,
        "moe_reduce_scatters": scatters,
        "input_block_tables_unchanged": all(torch.equal(a, b) for a, b in zip(tables_before,
                                                                               st.block_tables.input_block_tables)),
        "draft_prefill_batch_none": st.manager is None or st.manager.draft_prefill_batch is None,
        "draft_tokens": draft.clone().numpy(),
    }
    if st.drafter == "mtp":
        out["idx_mapping_all_pad"] = bool((spec.idx_mapping == -1).all())
    return out
