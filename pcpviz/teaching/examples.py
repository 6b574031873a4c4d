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
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import numpy as np

from pcpviz.reference.batch import GlobalBatch, order_batch
from pcpviz.reference.blocks import PAD_SLOT_ID, BlockTable, draft_decode_slot_mapping
from pcpviz.reference.drafts import draft_decode_positions, draft_prefill_inputs, unwritten_rows
from pcpviz.reference.layout import PCPLayout, plan_layout

__all__ = [
    "CacheWrites", "cache_writes", "DraftDecodeIO", "draft_decode_io", "DraftInputs", "draft_inputs",
    "DraftPrefillDispatch", "draft_prefill_dispatch", "IndexerKWrite", "indexer_k_write",
    "describe_acceptance_change", "TracePick", "pick_trace", "trace_pairs", "vllm_acceptance_metric",
    "BlockExample", "block_example", "DraftExample", "draft_example",
    "Exercise", "EXERCISES", "check", "STALE", "DSparkConfig", "dspark_drafter_config", "local_is_padding",
]

STALE = -1
"""Marks a draft input row ``prepare_prefill_inputs`` does not write (a rejected row keeps
whatever the buffer held; it is never read)."""


# --------------------------------------------------------------------------- target KV writes


@dataclass(frozen=True)
class CacheWrites:
    """The rows one rank's KV-cache write receives in the target (or draft-prefill) forward.

    ``tokens[i]`` is the global token whose KV row ``i`` carries, ``source_rank[i]`` the rank
    that computed it, ``slots[i]`` where it is written (PAD = -1: not written)."""

    rank: int
    tokens: np.ndarray  # int64[M]
    source_rank: np.ndarray  # int64[M]
    slots: np.ndarray  # int64[M]

    def written(self) -> dict[int, int]:
        """{global token: slot} of the rows actually written."""
        keep = self.slots != PAD_SLOT_ID
        return dict(zip(self.tokens[keep].tolist(), self.slots[keep].tolist()))

    def summary(self) -> str:
        """One line: how many tokens this rank's cache receives, from its own rows and from others."""
        real = self.slots != PAD_SLOT_ID
        own = real & (self.source_rank == self.rank)
        times = "once each" if int(real.sum()) == len(self.written()) else "some more than once"
        return (f"rank {self.rank}: writes {len(self.written())} tokens ({times}); from its own rows "
                f"{self.tokens[own].tolist()}, all-gathered from other ranks {self.tokens[real & ~own].tolist()}")


def cache_writes(layout: PCPLayout, gathered_slots: np.ndarray, rank: int) -> CacheWrites:
    """What rank ``rank`` writes into its own KV replica, as ``_gather_prefill_cache_inputs`` does.

    ``gathered_slots`` is one group's ``[N*P]`` mapping (``blocks.gathered_slot_mapping``).

    * sharded decodes (DCP = 1, vLLM's default): every local row is all-gathered and written
      through the whole ``[N*P]`` mapping; the mask made padding rows PAD;
    * replicated decodes (DCP > 1): the rank writes **its own** local decode rows with rank 0's
      slots (``rank_slot_mappings[0, :num_decode_tokens]``) and all-gathers only the prefill rows.
      The write mask therefore matters only for the gathered prefill rows (duplicates of a
      replicated short prefill) and for which copy ``hidden_restore_idx`` picks.

    PCP=2, DCP=2, batch ``d1, p13`` (decode first): both ranks hold the decode; rank 1's cache
    gets the decode's KV from rank 1's own row, at the slot rank 0's copy is mapped to::

        >>> lay = plan_layout([1, 13], [False, True], 2, shard_decode_requests=False, dcp_world_size=2)
        >>> w = cache_writes(lay, np.arange(lay.padded_gather_idx.size) + 100, 1)
        >>> int(w.tokens[0]), int(w.source_rank[0]), int(w.slots[0])
        (0, 1, 100)
    """
    layout.check_rank(rank)
    n, p = layout.pcp_world_size, layout.padded_num_tokens
    slots = np.asarray(gathered_slots, dtype=np.int64).reshape(-1)
    if slots.shape[0] != n * p:
        raise ValueError(f"gathered slot mapping has {slots.shape[0]} rows, the layout has N*P = {n * p}")
    gidx = layout.padded_gather_idx
    src = np.repeat(np.arange(n, dtype=np.int64), p)
    if layout.shard_decode_requests:
        return CacheWrites(rank, gidx.copy(), src, slots.copy())
    # Replicated decodes: equal on every rank, first in every rank's rows.
    decode_reqs = ~layout.is_prefilling
    nd = sum(s.num_tokens for s in layout.segments_by_rank[rank] if decode_reqs[s.global_req_idx])
    if nd == p:
        return CacheWrites(rank, gidx[rank * p: rank * p + nd].copy(), np.full(nd, rank), slots[:nd].copy())
    prefill_rows = (np.arange(n * p) % p) >= nd
    tokens = np.concatenate([gidx[rank * p: rank * p + nd], gidx[prefill_rows]])
    source = np.concatenate([np.full(nd, rank, dtype=np.int64), src[prefill_rows]])
    out = np.concatenate([slots[:nd], slots[prefill_rows]])
    return CacheWrites(rank, tokens, source, out)


# --------------------------------------------------------------------------- draft decodes


@dataclass(frozen=True)
class DraftDecodeIO:
    """One replicated draft decode step: where it writes and what its attention reads."""

    slot_mapping: np.ndarray  # int64[R]: from the request-indexed table through idx_mapping
    block_rows: np.ndarray  # int32[R, W]: input_block_tables[:R], the rows attention reads
    read_blocks: tuple[tuple[int, ...], ...]  # per request, the blocks its context spans

    def summary(self, names: Sequence[str]) -> str:
        return "\n".join(f"{name}: writes slot {int(s)}, reads blocks {list(b)}"
                         for name, s, b in zip(names, self.slot_mapping, self.read_blocks))


def draft_decode_io(table: np.ndarray, block_size: int, idx_mapping: np.ndarray, *, positions: np.ndarray,
                    input_block_tables: np.ndarray) -> DraftDecodeIO:
    """A draft decode's writes and reads, the way vLLM 0.33.0 splits them.

    * **writes**: ``BlockTables.compute_slot_mappings`` reads the persistent, request-indexed
      table (``block_table_ptrs``) through ``idx_mapping`` — it never looks at
      ``input_block_tables``, so its slots are right with or without the gather;
    * **reads**: the draft attention metadata takes ``block_tables=input_block_tables[:R]``,
      which only ``gather_block_tables(idx_mapping)`` in ``propose`` fills under PCP.

    ``input_block_tables`` is what that buffer holds when the step runs (the gathered rows, or
    zeros / a previous step's rows when the gather is skipped). Example (block size 4, request
    ``a`` in request-state slot 2 owning blocks [7, 3], at position 6)::

        >>> t = np.zeros((4, 2), np.int32); t[2] = [7, 3]
        >>> io = draft_decode_io(t, 4, np.array([2]), positions=np.array([6]),
        ...                      input_block_tables=np.zeros((4, 2), np.int32))
        >>> io.slot_mapping.tolist(), io.read_blocks
        ([14], ((0, 0),))
    """
    idx = np.asarray(idx_mapping, dtype=np.int64)
    pos = np.asarray(positions, dtype=np.int64)
    r = idx.shape[0]
    slots = draft_decode_slot_mapping(table, block_size, idx, positions=pos)[0]
    rows = np.asarray(input_block_tables)[:r].astype(np.int32)
    reads = tuple(tuple(int(b) for b in rows[i, : int(pos[i]) // block_size + 1]) for i in range(r))
    return DraftDecodeIO(slots, rows, reads)


@dataclass(frozen=True)
class BlockExample:
    """Notebook 02's example: block size 4, PCP=2; ``a`` (fresh 6-token prefill) lives in
    request-state slot 2 with blocks [7, 3], ``b`` (decode at position 2) in slot 0 with [5]."""

    names: tuple[str, ...]
    table: BlockTable
    block_size: int
    idx_mapping: np.ndarray  # int64[R]: batch row -> request-state slot
    query_start_loc: np.ndarray  # int64[R+1]
    positions: np.ndarray  # int64[T]
    layout: PCPLayout
    draft_positions: np.ndarray  # int64[R]: draft_1's positions
    stale_input_block_tables: np.ndarray  # int32[max_reqs, W]: what PCP leaves there (zeros)


def block_example() -> BlockExample:
    table = BlockTable(max_num_reqs=4, max_blocks_per_req=4)
    table.append(2, [7, 3])
    table.append(0, [5])
    return BlockExample(
        names=("b", "a"), table=table, block_size=4, idx_mapping=np.array([0, 2]),
        query_start_loc=np.array([0, 1, 7]), positions=np.array([2, 0, 1, 2, 3, 4, 5]),
        layout=plan_layout([1, 6], [False, True], 2), draft_positions=np.array([3, 6]),
        stale_input_block_tables=np.zeros((4, 4), np.int32),
    )


# --------------------------------------------------------------------------- draft arithmetic


@dataclass(frozen=True)
class DraftInputs:
    """The MTP drafter's inputs for one step, on the global batch.

    ``input_ids`` is draft_0's input per global token (``STALE`` on rows past a request's
    valid ones); ``last_token_indices`` the row whose hidden state gives draft token 0 (graph
    padding requests: 0); ``decode_positions[s-1]`` / ``decode_seq_lens[s-1]`` are draft_s's
    position and ``seq_len`` per request (padding requests: ``seq_len`` 0)."""

    input_ids: np.ndarray  # int64[T]
    last_token_indices: np.ndarray  # int64[R_pad]
    decode_positions: np.ndarray  # int64[K-1, R]
    decode_seq_lens: np.ndarray  # int64[K-1, R_pad]

    def local_input_ids(self, layout: PCPLayout, rank: int) -> np.ndarray:
        """int64[P]: draft_0's ids on ``rank`` (``prepare_draft_prefill``: an ``index_select``
        with the rank's ``padded_gather_idx`` slice; padding rows repeat global token 0's id)."""
        return self.input_ids[layout.local_gather_idx(rank)]


def draft_inputs(batch: GlobalBatch, *, num_sampled: Sequence[int], num_rejected: Sequence[int],
                 last_sampled: Sequence[int], next_prefill_tokens: Sequence[int],
                 num_speculative_tokens: int, num_reqs_padded: int | None = None) -> DraftInputs:
    """``prepare_prefill_inputs`` then ``prepare_decode_inputs`` (advancing positions), computed by
    ``pcpviz.reference.drafts`` and laid out for the notebook (rows the prefill does not write
    marked ``STALE``, padding requests appended).

    Per request ``i`` with ``q`` query rows of which ``num_rejected`` were rejected drafts:

    * valid rows ``q - num_rejected``; row ``j < valid-1`` takes the target id of row ``j+1``;
      the last valid row takes ``last_sampled[i]``, or ``next_prefill_tokens[i]`` when
      ``num_sampled == 0`` (a partial prefill chunk: nothing was sampled);
    * ``last_token_indices[i] = query_start + valid - 1``;
    * draft_1: position = ``positions[last_token_indices[i]] + 1``,
      ``seq_len = seq_len_target - num_rejected + 1``; each later step adds 1 to both.

    ``last_sampled`` / ``next_prefill_tokens`` are given per batch row here (vLLM indexes them
    by request-state slot). PCP=2 example: a decode at positions 20..23 with 2 of its 3 drafts
    rejected samples at row 1 (position 21); draft_1 runs at position 22 with seq_len 23::

        >>> b = GlobalBatch.build([4], [20], prefill_len=[10], input_ids=[5, 6, 7, 8])
        >>> d = draft_inputs(b, num_sampled=[2], num_rejected=[2], last_sampled=[9],
        ...                  next_prefill_tokens=[0], num_speculative_tokens=3)
        >>> d.input_ids.tolist(), d.last_token_indices.tolist(), d.decode_seq_lens[:, 0].tolist()
        ([6, 9, -1, -1], [1], [23, 24])
    """
    r = batch.num_reqs
    pad = r if num_reqs_padded is None else int(num_reqs_padded)
    if pad < r:
        raise ValueError(f"num_reqs_padded {pad} < {r} requests")
    arrays = {name: np.asarray(v, dtype=np.int64) for name, v in (
        ("num_sampled", num_sampled), ("num_rejected", num_rejected), ("last_sampled", last_sampled),
        ("next_prefill_tokens", next_prefill_tokens))}
    for name, a in arrays.items():
        if a.shape != (r,):
            raise ValueError(f"{name} needs one entry per request ({r}), got shape {a.shape}")
    ids, last = draft_prefill_inputs(batch.input_ids, batch.query_start_loc, num_rejected=arrays["num_rejected"],
                                     num_sampled=arrays["num_sampled"], last_sampled=arrays["last_sampled"],
                                     next_prompt_tokens=arrays["next_prefill_tokens"])
    ids[unwritten_rows(batch.query_start_loc, last)] = STALE
    dpos = draft_decode_positions(batch.positions, last, int(num_speculative_tokens))  # int64[K-1, R]
    dlen = np.zeros((dpos.shape[0], pad), dtype=np.int64)  # graph padding requests: seq_len 0
    dlen[:, :r] = dpos + 1
    last_padded = np.zeros(pad, dtype=np.int64)
    last_padded[:r] = last
    return DraftInputs(ids, last_padded, dpos, dlen)


@dataclass(frozen=True)
class DraftExample:
    """Notebook 03's worked step (PCP=2, K=3): ``d0`` decodes at positions 20..23 carrying 3
    drafts, 2 rejected; ``p1`` is the first 6-token chunk of a 10-token prompt (nothing
    sampled); one CUDA-graph padding request (``num_reqs_padded = 3``)."""

    batch: GlobalBatch
    num_sampled: np.ndarray
    num_rejected: np.ndarray
    last_sampled: np.ndarray
    next_prefill_tokens: np.ndarray
    num_speculative_tokens: int
    num_reqs_padded: int
    layout: PCPLayout

    def inputs(self) -> DraftInputs:
        return draft_inputs(self.batch, num_sampled=self.num_sampled, num_rejected=self.num_rejected,
                            last_sampled=self.last_sampled, next_prefill_tokens=self.next_prefill_tokens,
                            num_speculative_tokens=self.num_speculative_tokens,
                            num_reqs_padded=self.num_reqs_padded)


def draft_example() -> DraftExample:
    # d0: last sampled 120 at position 20, drafts 121 122 123; the target accepted 121, then
    # sampled 131 instead of 122 (so 122, 123 are rejected: num_sampled 2, num_rejected 2).
    # p1: prompt ids 200..209, this step schedules 200..205; its next prompt token is 206.
    batch = GlobalBatch.build([4, 6], [20, 0], prefill_len=[12, 10], req_ids=["d0", "p1"],
                              input_ids=[120, 121, 122, 123, 200, 201, 202, 203, 204, 205])
    return DraftExample(batch, np.array([2, 0]), np.array([2, 0]), np.array([131, 0]), np.array([0, 206]),
                        3, 3, plan_layout([4, 6], [False, True], 2))


# --------------------------------------------------------------------------- CUDA-graph dispatch


@dataclass(frozen=True)
class DraftPrefillDispatch:
    """The arguments one rank passes to ``dispatch_cg_and_sync_dp`` for the MTP draft prefill."""

    rank: int
    num_reqs: int  # the global R
    num_tokens: int  # this rank's real (unpadded) local tokens
    num_tokens_padded: int  # P: the same on every rank
    uniform_token_count: int | None


def draft_prefill_dispatch(layout: PCPLayout) -> tuple[DraftPrefillDispatch, ...]:
    """Per rank, what ``TargetDependentARSpeculator.propose`` dispatches the draft prefill with.

    After ``prepare_draft_prefill`` the token counts are the local batch's:
    ``num_tokens_padded = P`` on every rank, but ``uniform_token_count =
    get_uniform_decode_token_count(R_global, local num_tokens, global max_query_len,
    global decode_graph_eligible)`` is computed from the *unpadded* local count, so it differs
    per rank. PCP=2, one decode carrying 3 drafts (sharded to rank 0)::

        >>> [(d.num_tokens_padded, d.uniform_token_count) for d in draft_prefill_dispatch(plan_layout([4], [False], 2))]
        [(4, 4), (4, None)]
    """
    r = layout.num_reqs
    q = layout.num_scheduled_tokens
    max_q = int(q.max()) if r else 0
    eligible = not bool(layout.is_prefilling.any())
    out = []
    for rank, n in enumerate(layout.per_rank_num_tokens):
        uniform = max_q if eligible and r > 0 and int(n) == max_q * r else None
        out.append(DraftPrefillDispatch(rank, r, int(n), layout.padded_num_tokens, uniform))
    return tuple(out)


# --------------------------------------------------------------------------- sparse indexer fold


@dataclass(frozen=True)
class IndexerKWrite:
    """The sparse indexer's k-cache write for one forward (``sparse_attn_indexer``)."""

    slot_mapping_rows: int
    k_rows: int
    k_rows_kept: int  # after the fold and ``k = k[:num_tokens]``
    path: str  # what _gather_prefill_cache_inputs does with them

    def __str__(self) -> str:
        return (f"slot mapping {self.slot_mapping_rows} rows, k {self.k_rows} rows -> keeps "
                f"{self.k_rows_kept}: {self.path}")


def indexer_k_write(*, slot_mapping_rows: int, k_rows: int, pcp: int, num_decode_tokens: int,
                    shard_decode_requests: bool = True, pre_fix: bool = False) -> IndexerKWrite:
    """The fold of ``sparse_attn_indexer.py`` (0.33.0 lines 554-559) and where the k rows go.

    Fixed (0.33.0): ``num_tokens = len(slot_mapping)``, divided by the PCP size only when it
    exceeds the k rows (an expanded ``[N*P]`` mapping); ``pre_fix`` folds whenever PCP > 1 (the
    review's ``if use_pcp:``). Only ``k`` is truncated; the slot mapping goes on untouched into
    ``_gather_prefill_cache_inputs``, which asserts ``num_decode_tokens <= len(k)`` and writes
    locally when the mapping is not longer than ``k``. Only the indexer's key cache is
    involved, never the latent KV. PCP=2, a replicated draft decode of 3 requests::

        >>> indexer_k_write(slot_mapping_rows=3, k_rows=3, pcp=2, num_decode_tokens=3).k_rows_kept
        3
        >>> indexer_k_write(slot_mapping_rows=3, k_rows=3, pcp=2, num_decode_tokens=3, pre_fix=True).path
        'AssertionError: num_decode_tokens 3 > 1 k rows (the write never happens)'
    """
    num_tokens = slot_mapping_rows
    if pcp > 1 and (pre_fix or num_tokens > k_rows):
        num_tokens //= pcp
    kept = min(num_tokens, k_rows)
    if not 0 <= num_decode_tokens <= kept:
        path = f"AssertionError: num_decode_tokens {num_decode_tokens} > {kept} k rows (the write never happens)"
    elif pcp <= 1:
        path = "no PCP: written as is"
    elif slot_mapping_rows <= kept:
        path = f"unexpanded: writes k[:{num_decode_tokens}] locally, no collective"
    elif shard_decode_requests:
        path = f"expanded: all-gathers {kept} rows per rank into slots[:{pcp * kept}]"
    elif num_decode_tokens == kept:
        path = "expanded, decode-only: writes the local rows"
    else:
        path = "expanded: local decode rows + all-gathered prefill rows"
    return IndexerKWrite(slot_mapping_rows, k_rows, kept, path)


# --------------------------------------------------------------------------- DSpark and MoE padding


@dataclass(frozen=True)
class DSparkConfig:
    """What ``DFlashSpeculator.__init__`` (DSpark's base) hands its drafter, next to the target's."""

    target_pcp: int
    target_dcp: int
    draft_pcp: int | None  # None when vLLM refused the drafter's config (see ``error``)
    draft_dcp: int | None
    config_copied: bool  # the drafter got a new VllmConfig object (copy.copy)
    speculative_config_shared: bool  # ...whose other sub-objects are the target's (a shallow copy)
    error: str | None = None  # vLLM's message when building the drafter's ParallelConfig fails


def dspark_drafter_config(pcp: int, dcp: int = 1, *, tp: int = 1, draft_use_mla: bool = False) -> DSparkConfig:
    """Run vLLM 0.33.0's own ``DFlashSpeculator.__init__`` up to its ``super().__init__`` call on a
    real ``ParallelConfig`` and report the config the drafter receives (imports vLLM on CPU).

    The drafter's config is a shallow ``copy.copy`` with ``prefill_context_parallel_size=1`` and
    DCP kept only for an MLA drafter; PCP=2: its layers get ``use_pcp`` False. With PCP gone,
    ``ParallelConfig`` refuses ``tp % dcp != 0`` again: an MLA drafter whose TP is not a multiple
    of DCP (TP 1 or 3, DCP = PCP = 2) is refused here (``error``), though ``validate_config`` passed."""
    from pcpviz.vllm.cpu_patches import apply_cpu_patches

    apply_cpu_patches()
    from vllm.config import ParallelConfig
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    class _Captured(Exception):
        pass

    class _Capture(DFlashSpeculator.__mro__[1]):  # DraftModelSpeculator: stop where DFlash calls super()
        def __init__(self, vllm_config, device):  # noqa: D401 - raises with the config it was given
            raise _Captured(vllm_config)

    class _Probe(DFlashSpeculator, _Capture):
        pass

    spec = SimpleNamespace(draft_model_config=SimpleNamespace(use_mla=draft_use_mla))
    cfg = SimpleNamespace(parallel_config=ParallelConfig(prefill_context_parallel_size=pcp,
                                                         decode_context_parallel_size=dcp, tensor_parallel_size=tp),
                          speculative_config=spec)
    try:
        _Probe(cfg, "cpu")
    except _Captured as e:
        got = e.args[0]
    except ValueError as e:  # pydantic's ValidationError from vllm.config.replace
        msg = next((ln.strip() for ln in str(e).splitlines() if "Value error" in ln), str(e).splitlines()[0])
        return DSparkConfig(pcp, dcp, None, None, False, False, msg.split(" [type=")[0])
    else:  # pragma: no cover - vLLM changed
        raise RuntimeError("DFlashSpeculator.__init__ did not call super().__init__")
    return DSparkConfig(pcp, dcp, got.parallel_config.prefill_context_parallel_size,
                        got.parallel_config.decode_context_parallel_size, got is not cfg,
                        got.speculative_config is cfg.speculative_config)


def local_is_padding(layout: PCPLayout, rank: int, *, moe_gathers_tokens: bool) -> np.ndarray:
    """The local batch's ``is_padding`` (``partition_batch``): ``bool[P]`` — or, when the MoE
    all-gathers tokens (expert parallelism off), the rank-major ``bool[N*P]`` gathered mask,
    identical on every rank. A per-local-row reader must not assume ``[P]``. PCP=2,
    per-rank tokens [6, 12]::

        >>> lay = plan_layout([13, 1, 4], [True, False, False], 2)
        >>> local_is_padding(lay, 0, moe_gathers_tokens=False).shape, local_is_padding(lay, 0, moe_gathers_tokens=True).shape
        ((12,), (24,))
    """
    layout.check_rank(rank)
    p = layout.padded_num_tokens
    if moe_gathers_tokens:
        return ~layout.is_real_row()
    return np.arange(p) >= layout.per_rank_num_tokens[rank]


# --------------------------------------------------------------------------- acceptance prose


def describe_acceptance_change(clean: Sequence[float], other: Sequence[float], *, tol: float = 0.05) -> str:
    """One line per draft position saying how ``other`` compares with ``clean``, from the numbers.

        >>> print(describe_acceptance_change([0.9, 0.5], [0.88, 0.1]))
        position 0: 0.90 -> 0.88 (unchanged, within 0.05)
        position 1: 0.50 -> 0.10 (dropped by 0.40)
    """
    if len(clean) != len(other):
        raise ValueError(f"{len(clean)} vs {len(other)} draft positions")
    lines = []
    for k, (a, b) in enumerate(zip(clean, other)):
        if math.isnan(a) or math.isnan(b):
            verdict = "no drafts"
        elif abs(b - a) <= tol:
            verdict = f"unchanged, within {tol:g}"
        else:
            verdict = f"{'dropped' if b < a else 'rose'} by {abs(b - a):.2f}"
        lines.append(f"position {k}: {a:.2f} -> {b:.2f} ({verdict})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- shipped traces


@dataclass(frozen=True)
class TracePick:
    path: Path
    producer: str
    recorded_by_vllm: bool  # by the vLLM plugin on a real deployment

    def __str__(self) -> str:
        return f"{self.path.name} (producer {self.producer})"


_PRODUCER_RANK = {"vllm-plugin": 0, "vllm-replay": 1, "pcpviz-engine": 2}


def pick_trace(root: str | Path) -> TracePick:
    """The trace directory under ``root`` a notebook should open: the first (by name) recorded by
    the vLLM plugin (``run.json`` ``producer == "vllm-plugin"``), else a vLLM CPU replay, else an
    engine trace; among those, one with K >= 2 first (it shows the view switch). Raises
    ValueError naming ``root`` when it holds no trace."""
    root = Path(root)
    found = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        try:
            meta = json.loads((d / "run.json").read_text())
            producer = str(meta.get("producer", ""))
            k = meta.get("num_speculative_tokens")
        except (OSError, ValueError, AttributeError):
            continue
        shows_switch = isinstance(k, int) and k >= 2  # K <= 1: propose returns before the gather
        found.append((_PRODUCER_RANK.get(producer, 3), not shows_switch, d.name, d, producer))
    if not found:
        raise ValueError(f"{root}: no trace directory (with a run.json) found")
    *_, path, producer = min(found)
    return TracePick(path, producer, producer == "vllm-plugin")


def _prompts_key(meta: dict) -> str | None:
    """Runs worth diffing: the same prompts under the same PCP size and K."""
    prompts = meta.get("prompt_token_ids", meta.get("prompts"))
    if prompts is None:
        return None
    return json.dumps([prompts, meta.get("pcp"), meta.get("num_speculative_tokens")])


def trace_pairs(root: str | Path) -> list[tuple[TracePick, TracePick]]:
    """Pairs of trace directories under ``root`` that recorded the same prompts (``run.json``
    ``prompt_token_ids`` or ``prompts``) with the same ``pcp`` and K, the ones to ``diff_traces``:
    vLLM-plugin recordings first, then by name. A directory without prompts in its ``run.json``
    pairs with nothing."""
    root = Path(root)
    groups: dict[str, list[tuple[int, str, TracePick]]] = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        try:
            meta = json.loads((d / "run.json").read_text())
        except (OSError, ValueError):
            continue
        key = _prompts_key(meta) if isinstance(meta, dict) else None
        if key is None:
            continue
        producer = str(meta.get("producer", ""))
        groups.setdefault(key, []).append((_PRODUCER_RANK.get(producer, 3), d.name,
                                           TracePick(d, producer, producer == "vllm-plugin")))
    pairs = []
    for members in groups.values():
        members.sort(key=lambda m: m[:2])
        picks = [m[2] for m in members]
        pairs += [(a, b) for i, a in enumerate(picks) for b in picks[i + 1:]]
    rank = lambda t: _PRODUCER_RANK.get(t.producer, 3)  # noqa: E731
    return sorted(pairs, key=lambda ab: (rank(ab[0]), rank(ab[1]), ab[0].path.name, ab[1].path.name))


METRIC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_acceptance_metric(meta: Any) -> list[int] | None:
    """vLLM's own per-position accepted-token counter (``vllm:spec_decode_num_accepted_tokens_per_pos``,
    from ``LLM.get_metrics()``) if a recording stored it anywhere in its ``run.json``, else None."""
    if isinstance(meta, dict):
        for key, value in meta.items():
            if key in (METRIC_PER_POS, "num_accepted_tokens_per_pos") and isinstance(value, list):
                return [int(v) for v in value]
            found = vllm_acceptance_metric(value)
            if found is not None:
                return found
    elif isinstance(meta, list):
        for value in meta:
            found = vllm_acceptance_metric(value)
            if found is not None:
                return found
    return None


# --------------------------------------------------------------------------- exercises


@dataclass(frozen=True)
class Exercise:
    name: str
    notebook: str
    question: str
    solve: Callable[[], Any]  # the answer, computed with the library
    why: str


def _owner_of(layout: PCPLayout, req: int) -> int:
    return next(r for r, segs in enumerate(layout.segments_by_rank) for s in segs if s.global_req_idx == req)


def _scheduler_names() -> list[str]:
    # K = 3: decode_query_len = 4. Inputs: prefill p (13), decodes d (1 token) and e (4 = 1 + 3 drafts).
    return order_batch([13], [1, 4], prefill_names=["p"], decode_names=["d", "e"])[2]


def _write_slot_a_without_gather() -> int:
    ex = block_example()
    io = draft_decode_io(ex.table.as_array(), ex.block_size, ex.idx_mapping, positions=ex.draft_positions,
                         input_block_tables=ex.stale_input_block_tables)
    return int(io.slot_mapping[1])


def _read_blocks_a_without_gather() -> list[int]:
    ex = block_example()
    io = draft_decode_io(ex.table.as_array(), ex.block_size, ex.idx_mapping, positions=ex.draft_positions,
                         input_block_tables=ex.stale_input_block_tables)
    return list(io.read_blocks[1])


EXERCISES: dict[str, Exercise] = {e.name: e for e in (
    Exercise("empty_tail_chunk", "01",
             "PCP=2, a fresh 5-token prefill alone in the batch. How many tokens does each rank "
             "compute? Answer [rank 0, rank 1].",
             lambda: list(plan_layout([5], [True], 2).per_rank_num_tokens),
             "4 chunks of ceil(5/4) = 2: [0:2] [2:4] [4:5] and an empty 4th chunk; rank 0 takes "
             "chunks 0 and 3 (the empty one is skipped), rank 1 chunks 1 and 2."),
    Exercise("decode_owner_moves", "01",
             "PCP=2, sharded decodes. Step A schedules the 1-token decodes a then b; in step B a has "
             "finished and b decodes alone. Which rank owns b in step A, and in step B? Answer [A, B].",
             lambda: [_owner_of(plan_layout([1, 1], [False, False], 2), 1),
                      _owner_of(plan_layout([1], [False], 2), 0)],
             "the owner is decode_ordinal % N, counted over this step's decodes only; ownership "
             "does not persist (every rank holds the whole KV, so it need not)."),
    Exercise("scheduler_order", "01",
             "K=3. The scheduler hands over a 13-token prefill p, a plain decode d (1 token) and a "
             "decode e carrying 3 drafts. In which order does vLLM put the rows? Answer a list of names.",
             _scheduler_names,
             "sort_batch_req_ids sorts by (no drafts, query != 1+K, query length): e has drafts; d "
             "and p both differ from 1+K = 4, so they go by length."),
    Exercise("skip_gather_write_slot", "02",
             "In the example, the gather before the draft decodes is skipped. Which slot does "
             "draft_1 write for request a (position 6)?",
             _write_slot_a_without_gather,
             "the slot comes from the request-indexed table through idx_mapping (compute_slot_mappings), "
             "not from input_block_tables: block 3, offset 2 -> 3*4 + 2 = 14, gather or not."),
    Exercise("skip_gather_read_blocks", "02",
             "Same step, gather skipped: which blocks does draft_1's attention read for request a? "
             "Answer a list of block ids.",
             _read_blocks_a_without_gather,
             "attention reads input_block_tables[:R], which the PCP target path never writes: all "
             "zeros, the null block, for both of a's blocks."),
    Exercise("last_token_indices", "03",
             "In the worked step, predict last_token_indices for [d0, p1, padding request].",
             lambda: draft_example().inputs().last_token_indices.tolist(),
             "d0: rows 0..3, 2 rejected -> 2 valid -> row 0 + 2 - 1 = 1; p1: rows 4..9, nothing "
             "rejected -> 9; a padding request gets 0."),
    Exercise("draft1_seq_len", "03",
             "d0's target seq_len is 24 (positions 20..23). What seq_len does draft_1 use for d0?",
             lambda: int(draft_example().inputs().decode_seq_lens[0, 0]),
             "prepare_decode_inputs: seq_len = target seq_len - num_rejected + 1 = 24 - 2 + 1; "
             "draft_1 sits at position 22 (the last valid position 21, plus 1)."),
    Exercise("partial_prefill_last_id", "03",
             "p1 is a partial prefill (num_sampled == 0). Which token id does its last draft_0 row "
             "(global row 9) get?",
             lambda: int(draft_example().inputs().input_ids[9]),
             "nothing was sampled, so the last valid row takes next_prefill_tokens: the prompt's "
             "next token, 206."),
)}


def _norm(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return _norm(x.tolist())
    if isinstance(x, (list, tuple)):
        return [_norm(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def check(name: str, answer: Any) -> str:
    """Compare ``answer`` with the exercise's computed answer; ``None`` reveals it.

        >>> check("empty_tail_chunk", [2, 3]).startswith("right")
        True
    """
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}; known: {', '.join(EXERCISES)}")
    ex = EXERCISES[name]
    expected = _norm(ex.solve())
    if answer is None:
        return f"answer: {expected!r} — {ex.why}"
    if _norm(answer) == expected:
        return f"right: {expected!r} — {ex.why}"
    return f"not quite: you said {_norm(answer)!r}, the library computes {expected!r} — {ex.why}"
