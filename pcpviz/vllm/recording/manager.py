"""``RecordingPCPManager``: vLLM 0.33.0's ``PCPManager`` that records what it computes.

The target phase of a step is taken from the PCP manager's own methods, each override
calling ``super()`` first and returning its result unchanged:

==============================  =====================================================================
override                        records (phase ``target`` unless noted)
==============================  =====================================================================
``_build_batch_layout``         the layout: segments per rank, ``per_rank_num_tokens``
``partition_batch``             begins the step; the global batch (its argument), the gather
                                indices and the rank-local batch (its return value)
``prepare_attn``                ``block_table_local`` (return value), ``block_table_global``
``prepare_slot_mappings``       ``slot_mapping_global`` (``_global_batch_slot_mappings``) and
                                ``slot_mapping_gathered`` (return value)
``restore_for_sampling``        ``sampled_logits_rows``, ``sampled_from`` (global or local batch),
                                ``hidden_fp`` (the restored rows' fingerprints)
``prepare_draft_prefill``       ``draft_global_input_ids`` of ``draft_0`` (its argument)
``restore_draft_prefill``       ``draft_prefill_restored`` of the last draft phase; draft_0's
                                ``hidden_last_fp`` and ``hidden_out_fp`` (``fingerprints``)
``restore_hidden_states``       counts the hidden-state all-gathers of a ``propose`` (``dummy``)
==============================  =====================================================================

Scenario A of ``docs/vllm-0.33-pcp-mtp.md`` (PCP=2, decodes sharded): decodes d0, d1 of 4 tokens
and prefills p1 (10 tokens), p0 (13). ``partition_batch`` on each rank receives the global
batch (31 tokens) and returns that rank's local batch; the recorder stores both, with
``per_rank_num_tokens = [13, 18]`` from the layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm.v1.worker.gpu.pcp_manager import PCPManager

from pcpviz.vllm.recording import fingerprints
from pcpviz.vllm.recording.host import now_us
from pcpviz.vllm.recording.recorder import RankRecorder
from pcpviz.vllm.recording.sessions import active_session
from pcpviz.vllm.recording.state import current_draft, recorder_of
from pcpviz.vllm.recording.wrappers import ensure_warm_up_wrapper

__all__ = ["RecordingPCPManager"]


class RecordingPCPManager(PCPManager):
    """vLLM 0.33.0's ``PCPManager`` that records what it computes (see the module docstring).

    Installed by the plugin through ``GPUModelRunner.pcp_manager_cls`` and built by the
    replay through ``maybe_build_pcp_manager(..., cls=RecordingPCPManager)``. Every override
    calls ``super()`` and returns its result unchanged.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ensure_warm_up_wrapper()
        s = active_session()
        self._pcpviz_recorder: RankRecorder | None = s.recorder_for(self) if s is not None else None

    def _build_batch_layout(self, *args: Any, **kwargs: Any):
        segments_by_rank, per_rank_num_tokens = super()._build_batch_layout(*args, **kwargs)
        rec = recorder_of(self)
        if rec is not None:
            rec.guard(rec.on_layout, segments_by_rank, per_rank_num_tokens)
        return segments_by_rank, per_rank_num_tokens

    def partition_batch(self, input_batch, batch_desc):
        rec = recorder_of(self)
        if rec is None:
            return super().partition_batch(input_batch, batch_desc)
        t0 = now_us()
        rec.guard(rec.begin_step)
        local = super().partition_batch(input_batch, batch_desc)
        rec.guard(rec.on_partition, self, input_batch, local, t0=t0)
        return local

    def prepare_attn(self, input_batch):
        block_tables, slot_mappings = super().prepare_attn(input_batch)
        rec = recorder_of(self)
        if rec is not None:
            rec.guard(rec.on_prepare_attn, self, input_batch, block_tables)
        return block_tables, slot_mappings

    def prepare_slot_mappings(self):
        gathered = super().prepare_slot_mappings()
        rec = recorder_of(self)
        if rec is not None:
            rec.guard(rec.on_slot_mappings, self, gathered)
        return gathered

    def restore_hidden_states(self, hidden_states):
        ctx = current_draft()
        if ctx is not None and self._hidden_restore_idx is not None and ctx.spec.pcp_manager is self:
            ctx.hidden_gathers += 1
        return super().restore_hidden_states(hidden_states)

    def restore_for_sampling(self, hidden_states, aux_hidden_states):
        hidden, aux, batch = super().restore_for_sampling(hidden_states, aux_hidden_states)
        rec = recorder_of(self)
        if rec is not None:
            rec.guard(rec.on_restore_for_sampling, self, batch, len(aux) if aux else 0)
            rec.guard(fingerprints.on_restored_target, rec, hidden)
        return hidden, aux, batch

    def prepare_draft_prefill(self, input_batch, input_ids):
        super().prepare_draft_prefill(input_batch, input_ids)
        ctx = current_draft()
        if ctx is not None and ctx.spec.pcp_manager is self and self.draft_prefill_batch is not None:
            # The global shifted draft ids (prepare_prefill_inputs' output), before the gather.
            ctx.global_draft_ids = input_ids[: input_batch.num_tokens].detach().clone()

    def restore_draft_prefill(self, last_hidden_states, hidden_states):
        was_local = self.draft_prefill_batch is not None
        out = super().restore_draft_prefill(last_hidden_states, hidden_states)
        ctx = current_draft()
        if ctx is not None and ctx.spec.pcp_manager is self and ctx.phases and not ctx.dummy:
            ctx.rec.guard(ctx.rec.put, ctx.phases[-1], draft_prefill_restored=np.array(was_local))
            if was_local:
                ctx.rec.guard(fingerprints.on_restored_draft, ctx, *out)
        return out
