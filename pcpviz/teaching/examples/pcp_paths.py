"""The PCP code paths the design review (notebooks 06 and 07) examines, each computed as vLLM
0.33.0 computes it: the draft prefill's CUDA-graph dispatch per rank
(``draft_prefill_dispatch``), the sparse indexer's k-cache fold (``indexer_k_write``), the
config DSpark's drafter receives (``dspark_drafter_config``, vLLM's own ``__init__``) and the
local batch's padding mask under a token-gathering MoE (``local_is_padding``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from pcpviz.reference.layout import PCPLayout, plan_layout  # noqa: F401 - plan_layout: the doctests

__all__ = ["DraftPrefillDispatch", "draft_prefill_dispatch", "IndexerKWrite", "indexer_k_write", "DSparkConfig",
           "dspark_drafter_config", "local_is_padding"]


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
        path = f"unexpanded: writes k[:{num_decode_tokens}] locally, no gather"
    elif shard_decode_requests:
        path = f"expanded: all-gathers {kept} rows per rank into slots[:{pcp * kept}]"
    elif num_decode_tokens == kept:
        path = "expanded, decode-only: writes the local rows"
    else:
        path = "expanded: local decode rows + all-gathered prefill rows"
    return IndexerKWrite(slot_mapping_rows, k_rows, kept, path)


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
        >>> local_is_padding(lay, 0, moe_gathers_tokens=False).shape
        (12,)
        >>> local_is_padding(lay, 0, moe_gathers_tokens=True).shape
        (24,)
    """
    layout.check_rank(rank)
    p = layout.padded_num_tokens
    if moe_gathers_tokens:
        return ~layout.is_real_row()
    return np.arange(p) >= layout.per_rank_num_tokens[rank]
