"""The real vLLM 0.33.0 PCP code, called on CPU, with NumPy in and NumPy out.

Each function here builds vLLM's own objects (``PCPManager``, ``InputBatch``,
``BlockTables``, ``BatchExecutionDescriptor``) and calls the vLLM method named in
its docstring; nothing of vLLM's logic is re-implemented. The conformance tests
compare ``pcpviz.reference.layout`` / ``pcpviz.reference.blocks`` against these. Exceptions raised by
vLLM propagate unchanged (same type, same message).

Importing this module applies ``pcpviz.vllm.cpu_patches`` (and so imports vLLM); the process
environment is left as it was (``cpu_patches.cpu_environment``).

Scenario A of ``docs/vllm-0.33-pcp-mtp.md`` (PCP=2, sharded decodes): rows d0, d1 (decodes of
4 tokens), p1 (10 prefill tokens), p0 (13)::

    >>> lay = vllm_build_batch_layout([4, 4, 10, 13], [False, False, True, True], 2,
    ...                               shard_decode_requests=True)
    >>> lay["per_rank_num_tokens"]
    [13, 18]
    >>> lay["padded_gather_idx"][:13].tolist()
    [0, 1, 2, 3, 8, 9, 10, 17, 18, 19, 20, 21, 30]
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from pcpviz.vllm.cpu_patches import apply_cpu_patches, cpu_environment

apply_cpu_patches()

with cpu_environment():  # vLLM modules imported here define interpreted (CPU) Triton kernels
    import torch  # noqa: E402

    from vllm.config import CUDAGraphMode  # noqa: E402
    from vllm.v1.worker.gpu.block_table import BlockTables  # noqa: E402
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor  # noqa: E402
    from vllm.v1.worker.gpu.input_batch import InputBatch  # noqa: E402
    from vllm.v1.worker.gpu.pcp_manager import PCPManager  # noqa: E402

CPU = torch.device("cpu")

ArrayLike = Sequence[int] | np.ndarray


# --- shared builders ----------------------------------------------------------------------------


def _qsl(num_scheduled_tokens: np.ndarray) -> np.ndarray:
    qsl = np.zeros(len(num_scheduled_tokens) + 1, dtype=np.int32)
    np.cumsum(num_scheduled_tokens, out=qsl[1:])
    return qsl


def _input_batch(
    req_ids: Sequence[str],
    idx_mapping: ArrayLike,
    num_scheduled_tokens: ArrayLike,
    num_computed_tokens: ArrayLike,
    positions: ArrayLike,
    input_ids: ArrayLike,
    prefill_len: ArrayLike,
    is_prefilling: ArrayLike,
    padded_num_tokens: int | None = None,
) -> InputBatch:
    """A global InputBatch as GPUModelRunner.prepare_inputs leaves it (no drafts
    bookkeeping; partition_batch does not read it). As in the runner, the token
    tensors are views of length ``max(num_tokens, graph size)`` (the rows past
    num_tokens are the runner buffer's stale contents; zeros here): PCP padding
    rows gather global row 0, which exists only through this padding when a
    batch has no tokens."""
    q = np.asarray(num_scheduled_tokens, dtype=np.int32).reshape(-1)
    num_reqs = len(q)
    qsl = _qsl(q)
    num_tokens = int(qsl[-1])
    computed = np.asarray(num_computed_tokens, dtype=np.int32).reshape(-1)
    prefill = np.asarray(prefill_len, dtype=np.int32).reshape(-1)
    prefilling = np.asarray(is_prefilling, dtype=np.bool_).reshape(-1)
    idx_np = np.asarray(idx_mapping, dtype=np.intp).reshape(-1)
    pos = torch.tensor(np.asarray(positions, dtype=np.int64).reshape(-1)[:num_tokens])
    ids = torch.tensor(np.asarray(input_ids, dtype=np.int64).reshape(-1)[:num_tokens], dtype=torch.int32)
    for name, arr in [("idx_mapping", idx_np), ("num_computed_tokens", computed), ("prefill_len", prefill),
                      ("is_prefilling", prefilling)]:
        if len(arr) != num_reqs:
            raise ValueError(f"{name} has {len(arr)} entries for {num_reqs} requests")
    if len(pos) != num_tokens or len(ids) != num_tokens:
        raise ValueError(f"positions/input_ids need {num_tokens} entries, got {len(pos)}/{len(ids)}")
    # GPU seq_lens (prepare_pos_seq_lens): GPU cursor + query length, i.e. last position + 1.
    seq_lens = (computed + q).astype(np.int32)
    real = q > 0
    seq_lens[real] = pos.numpy()[qsl[1:][real] - 1] + 1
    num_tokens_after_padding = max(num_tokens, padded_num_tokens or 0)
    pad = num_tokens_after_padding - num_tokens
    pos, ids = torch.nn.functional.pad(pos, (0, pad)), torch.nn.functional.pad(ids, (0, pad))
    is_padding = torch.arange(num_tokens_after_padding) >= num_tokens
    idx = torch.from_numpy(idx_np.astype(np.int64))
    return InputBatch(
        req_ids=list(req_ids),
        num_reqs=num_reqs,
        num_reqs_after_padding=num_reqs,
        idx_mapping=idx,
        idx_mapping_np=idx_np,
        expanded_idx_mapping=idx,
        expanded_local_pos=torch.zeros(num_reqs, dtype=torch.int32),
        num_scheduled_tokens=q,
        num_tokens=num_tokens,
        num_tokens_after_padding=num_tokens_after_padding,
        num_draft_tokens=0,
        num_draft_tokens_per_req=None,
        query_start_loc=torch.from_numpy(qsl.copy()),
        query_start_loc_np=qsl,
        seq_lens=torch.from_numpy(seq_lens),
        seq_lens_cpu_upper_bound=torch.from_numpy((computed + q).astype(np.int32)),
        dcp_local_seq_lens=None,
        num_computed_tokens_np=computed,
        prefill_len_np=prefill,
        num_computed_prefill_tokens_np=np.minimum(computed, prefill),
        is_prefilling_np=prefilling,
        has_prefill=bool(prefilling.any()),
        decode_graph_eligible=not bool(prefilling.any()),
        input_ids=ids,
        positions=pos,
        is_padding=is_padding,
        logits_indices=torch.from_numpy((qsl[1:] - 1).astype(np.int64)),
        cu_num_logits=torch.arange(num_reqs + 1, dtype=torch.int32),
        cu_num_logits_np=np.arange(num_reqs + 1, dtype=np.int32),
        has_structured_output_reqs=False,
        prompt_lens=None,
    )


def _batch_desc(padded_num_tokens: int | None, padded_num_reqs: int | None) -> BatchExecutionDescriptor:
    """NONE (eager), PIECEWISE (pads tokens to the graph size) or FULL (also pads requests)."""
    if padded_num_reqs is not None:
        if padded_num_tokens is None:
            raise ValueError("padded_num_reqs (a FULL graph) needs padded_num_tokens too")
        return BatchExecutionDescriptor(CUDAGraphMode.FULL, padded_num_tokens, padded_num_reqs)
    if padded_num_tokens is not None:
        return BatchExecutionDescriptor(CUDAGraphMode.PIECEWISE, padded_num_tokens, None)
    return BatchExecutionDescriptor(CUDAGraphMode.NONE, 0, None)


def _block_tables(rows: Sequence[Sequence[int]], block_size: int, *, num_slots: int = 0, max_num_tokens: int = 1,
                  max_num_blocks: int | None = None, cp_size: int = 1, cp_rank: int = 0,
                  cp_interleave: int = 1) -> BlockTables:
    """A real one-group BlockTables holding ``rows[slot]`` for each request-state slot,
    written through vLLM's staged-write path (append_block_ids + apply_staged_writes)."""
    width = max_num_blocks if max_num_blocks is not None else max([len(r) for r in rows] + [1])
    tables = BlockTables([block_size], max(len(rows), num_slots, 1), max(max_num_tokens, 1), [width], CPU,
                         cp_size=cp_size, cp_rank=cp_rank, cp_interleave=cp_interleave)
    for slot, row in enumerate(rows):
        tables.append_block_ids(slot, ([int(b) for b in row],), overwrite=True)
    tables.apply_staged_writes()
    return tables


def _managers(batch: InputBatch, pcp_world_size: int, shard_decode_requests: bool, dcp_world_size: int,
              padded_num_tokens: int | None, padded_num_reqs: int | None, moe_gathers_tokens: bool,
              block_tables: BlockTables | None = None) -> list[PCPManager]:
    """One real PCPManager per rank, with input buffers big enough for the batch."""
    max_num_reqs = max(batch.num_reqs, padded_num_reqs or 0, 1)
    max_num_tokens = max(batch.num_tokens, padded_num_tokens or 0, 1)
    return [
        PCPManager(pcp_world_size, rank, CPU, shard_decode_requests, max_num_reqs=max_num_reqs,
                   max_num_tokens=max_num_tokens, block_tables=block_tables, dcp_world_size=dcp_world_size,
                   moe_gathers_tokens=moe_gathers_tokens)
        for rank in range(pcp_world_size)
    ]


def _np(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy().copy() if isinstance(x, torch.Tensor) else np.array(x, copy=True)


# --- layout --------------------------------------------------------------------------------------


def vllm_build_batch_layout(
    num_scheduled_tokens: ArrayLike,
    is_prefilling: ArrayLike,
    pcp_world_size: int,
    *,
    shard_decode_requests: bool,
    dcp_world_size: int = 1,
    padded_num_tokens: int | None = None,
) -> dict[str, Any]:
    """``PCPManager._build_batch_layout`` on a buffer-less manager.

    Returns ``segments_by_rank`` (per rank, tuples ``(global_req_idx, global_start,
    global_stop, local_start, local_stop)``), ``per_rank_num_tokens``,
    ``padded_gather_idx`` (int64[N*P]), ``hidden_restore_idx`` (int64[T]) and
    ``kv_write_mask`` (bool[N*P]).
    """
    q = np.asarray(num_scheduled_tokens, dtype=np.int32).reshape(-1)
    prefilling = np.asarray(is_prefilling, dtype=np.bool_).reshape(-1)
    manager = PCPManager(pcp_world_size, 0, CPU, shard_decode_requests, dcp_world_size=dcp_world_size)
    segments_by_rank, per_rank = manager._build_batch_layout(
        q, np.zeros(len(q), dtype=np.int32), prefilling, _qsl(q), padded_num_tokens=padded_num_tokens
    )
    return {
        "segments_by_rank": [
            [(s.global_batch_req_idx, s.global_batch_slice.start, s.global_batch_slice.stop,
              s.rank_local_batch_slice.start, s.rank_local_batch_slice.stop) for s in segments]
            for segments in segments_by_rank
        ],
        "per_rank_num_tokens": [int(n) for n in per_rank],
        "padded_gather_idx": _np(manager._padded_gather_idx).astype(np.int64),
        "hidden_restore_idx": _np(manager._hidden_restore_idx).astype(np.int64),
        "kv_write_mask": _np(manager._gathered_kv_write_mask).astype(np.bool_),
    }


# --- rank-local batch ------------------------------------------------------------------------


def _local_view(local: InputBatch, manager: PCPManager) -> dict[str, Any]:
    pcp = local.pcp
    return {
        "req_ids": list(local.req_ids),
        "idx_mapping": _np(local.idx_mapping),
        "num_scheduled_tokens": _np(local.num_scheduled_tokens),
        "query_start_loc": _np(local.query_start_loc),  # int32[R_loc_pad + 1]
        "input_ids": _np(local.input_ids),  # int32[P]
        "positions": _np(local.positions),  # int64[P]
        "seq_lens": _np(local.seq_lens),  # int32[R_loc_pad]
        "logits_indices": _np(local.logits_indices),
        "cu_num_logits": _np(local.cu_num_logits),
        "is_prefilling": _np(local.is_prefilling_np),  # bool[R_loc_pad]
        "is_padding": _np(local.is_padding),  # bool[P], or bool[N*P] with moe_gathers_tokens
        "num_computed_tokens": _np(local.num_computed_tokens_np),  # local_start_pos
        "seq_lens_cpu_upper_bound": _np(local.seq_lens_cpu_upper_bound),
        "prefill_len": _np(local.prefill_len_np),
        "num_reqs": int(local.num_reqs),
        "num_tokens": int(local.num_tokens),
        "num_tokens_after_padding": int(local.num_tokens_after_padding),
        "num_reqs_after_padding": int(local.num_reqs_after_padding),
        "has_prefill": bool(local.has_prefill),
        "global_num_tokens": int(pcp.global_num_tokens),
        "global_query_lens": _np(pcp.global_query_lens_np),
        "global_seq_lens_cpu_upper_bound": _np(pcp.global_seq_lens_cpu_upper_bound_np),
        "dcp_local_seq_lens_cpu_upper_bound": (
            None if pcp.dcp_local_seq_lens_cpu_upper_bound is None else _np(pcp.dcp_local_seq_lens_cpu_upper_bound)
        ),
        "local_gather_idx": _np(manager._local_gather_idx),
    }


def vllm_partition_batch(
    *,
    req_ids: Sequence[str],
    idx_mapping: ArrayLike,
    num_scheduled_tokens: ArrayLike,
    num_computed_tokens: ArrayLike,
    positions: ArrayLike,
    input_ids: ArrayLike,
    prefill_len: ArrayLike,
    is_prefilling: ArrayLike,
    pcp_world_size: int,
    shard_decode_requests: bool,
    dcp_world_size: int = 1,
    padded_num_tokens: int | None = None,
    padded_num_reqs: int | None = None,
    moe_gathers_tokens: bool = False,
) -> list[dict[str, Any]]:
    """``PCPManager.partition_batch(global InputBatch, batch_desc)`` on every rank.

    ``num_computed_tokens`` is the CPU cursor, ``positions`` the GPU cursor per token
    (they differ after a rejection). ``padded_num_tokens`` models a PIECEWISE graph
    of that size; adding ``padded_num_reqs`` models a FULL graph. Returns one dict of
    NumPy arrays per rank (see ``_local_view`` for the keys).
    """
    batch = _input_batch(req_ids, idx_mapping, num_scheduled_tokens, num_computed_tokens, positions, input_ids,
                         prefill_len, is_prefilling, padded_num_tokens)
    desc = _batch_desc(padded_num_tokens, padded_num_reqs)
    managers = _managers(batch, pcp_world_size, shard_decode_requests, dcp_world_size, padded_num_tokens,
                         padded_num_reqs, moe_gathers_tokens)
    return [_local_view(m.partition_batch(batch, desc), m) for m in managers]


# --- block tables and slot mappings ------------------------------------------------------------


def vllm_compute_slot_mappings(
    block_table_rows: Sequence[Sequence[int]],
    block_size: int,
    idx_mapping: ArrayLike,
    *,
    query_start_loc: ArrayLike,
    positions: ArrayLike,
    num_tokens: int,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
) -> np.ndarray:
    """``BlockTables.compute_slot_mappings`` (the Triton kernel): int64[1, num_tokens],
    PAD (-1) past ``query_start_loc[-1]``. ``block_table_rows[slot]`` is the block-id
    row of request-state slot ``slot``; ``idx_mapping`` maps batch rows to slots."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    idx = np.asarray(idx_mapping, dtype=np.int64).reshape(-1)
    tables = _block_tables(block_table_rows, block_size, num_slots=int(idx.max(initial=-1)) + 1,
                           max_num_tokens=max(num_tokens, len(pos)), cp_size=cp_size, cp_rank=cp_rank,
                           cp_interleave=cp_interleave)
    out = tables.compute_slot_mappings(
        torch.from_numpy(idx),
        torch.tensor(np.asarray(query_start_loc, dtype=np.int32).reshape(-1)),
        torch.from_numpy(pos),
        num_tokens,
    )
    return _np(out)


def vllm_gather_block_tables(
    block_table_rows: Sequence[Sequence[int]],
    block_size: int,
    idx_mapping: ArrayLike,
    *,
    num_reqs_padded: int,
    max_num_blocks: int | None = None,
) -> np.ndarray:
    """``BlockTables.gather_block_tables`` (the Triton kernel) into the shared
    ``input_block_tables``: int32[num_reqs_padded, max_num_blocks], rows in batch
    order, padded rows zeroed. ``max_num_blocks`` (the table width) defaults to the
    longest row."""
    idx = np.asarray(idx_mapping, dtype=np.int64).reshape(-1)
    tables = _block_tables(block_table_rows, block_size, num_slots=max(num_reqs_padded, int(idx.max(initial=-1)) + 1),
                           max_num_blocks=max_num_blocks)
    (out,) = tables.gather_block_tables(torch.from_numpy(idx), num_reqs_padded)
    return _np(out)


def vllm_prepare_attn(
    block_table_rows: Sequence[Sequence[int]],
    block_size: int,
    *,
    rank: int = 0,
    max_num_blocks: int | None = None,
    **batch: Any,
) -> dict[str, np.ndarray]:
    """``PCPManager.set_block_tables`` + ``partition_batch`` + ``prepare_attn`` on ``rank``.

    ``batch`` takes ``vllm_partition_batch``'s keyword arguments. Returns
    ``block_tables`` (int32[R_loc_pad, width]: full rows per local segment),
    ``slot_mappings`` (int64[1, N*P]: gathered, PAD outside the KV write mask) and
    ``global_slot_mappings`` (int64[1, T]: the global batch's, before the gather).
    """
    padded_num_tokens, padded_num_reqs = batch.pop("padded_num_tokens", None), batch.pop("padded_num_reqs", None)
    n, shard = batch.pop("pcp_world_size"), batch.pop("shard_decode_requests")
    dcp, moe = batch.pop("dcp_world_size", 1), batch.pop("moe_gathers_tokens", False)
    global_batch = _input_batch(**batch, padded_num_tokens=padded_num_tokens)
    idx = global_batch.idx_mapping_np
    tables = _block_tables(block_table_rows, block_size, num_slots=int(idx.max(initial=-1)) + 1,
                           max_num_tokens=global_batch.num_tokens, max_num_blocks=max_num_blocks)
    manager = _managers(global_batch, n, shard, dcp, padded_num_tokens, padded_num_reqs, moe)[rank]
    manager.set_block_tables(tables)
    local = manager.partition_batch(global_batch, _batch_desc(padded_num_tokens, padded_num_reqs))
    (local_block_table,), slot_mappings = manager.prepare_attn(local)
    return {
        "block_tables": _np(local_block_table),
        "slot_mappings": _np(slot_mappings),
        "global_slot_mappings": _np(manager._global_batch_slot_mappings[:, : global_batch.num_tokens]),
    }


def vllm_prepare_slot_mappings(
    block_table_rows: Sequence[Sequence[int]], block_size: int, *, rank: int = 0, **batch: Any
) -> np.ndarray:
    """``PCPManager.prepare_slot_mappings()`` after ``partition_batch`` on ``rank``:
    the gathered int64[1, N*P] slot mapping (PAD = -1 outside the KV write mask)."""
    return vllm_prepare_attn(block_table_rows, block_size, rank=rank, **batch)["slot_mappings"]


# --- configuration ------------------------------------------------------------------------------


def vllm_validate_config(
    *,
    pcp_size: int,
    dcp_size: int = 1,
    use_mla: bool = True,
    is_encoder_decoder: bool = False,
    supports_mm_inputs: bool = False,
    lora: bool = False,
    speculative_method: str | None = None,
    multi_module_mtp: bool = False,
    draft_use_mla: bool = True,
    sparse_mla: bool = False,
    model_type: str = "deepseek_v3",
    cudagraph_mode: str = "NONE",
    dcp_comm_backend: str = "ag_rs",
) -> str | None:
    """``PCPManager.validate_config``: None if accepted, else vLLM's message.

    The configuration is given as the handful of fields validate_config reads,
    on namespaces (building a full VllmConfig needs a model on disk);
    ``cudagraph_mode`` is a real ``CUDAGraphMode`` member name and
    ``speculative_method`` ``"dspark"`` stands for ``use_dspark()``.
    """
    hf_text_config = SimpleNamespace(model_type=model_type, **({"index_topk": 2048} if sparse_mla else {}))
    speculative_config = None
    if speculative_method is not None:
        speculative_config = SimpleNamespace(
            method=speculative_method,
            use_dspark=lambda: speculative_method == "dspark",
            use_multi_module_mtp=lambda: multi_module_mtp,
            draft_model_config=SimpleNamespace(use_mla=draft_use_mla),
        )
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(prefill_context_parallel_size=pcp_size,
                                        decode_context_parallel_size=dcp_size,
                                        dcp_comm_backend=dcp_comm_backend),
        model_config=SimpleNamespace(use_mla=use_mla, is_encoder_decoder=is_encoder_decoder,
                                     hf_text_config=hf_text_config),
        lora_config=object() if lora else None,
        speculative_config=speculative_config,
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode[cudagraph_mode]),
    )
    try:
        PCPManager.validate_config(config, supports_mm_inputs)
    except NotImplementedError as exc:
        return str(exc)
    return None


__all__ = [
    "vllm_build_batch_layout",
    "vllm_compute_slot_mappings",
    "vllm_gather_block_tables",
    "vllm_partition_batch",
    "vllm_prepare_attn",
    "vllm_prepare_slot_mappings",
    "vllm_validate_config",
]
