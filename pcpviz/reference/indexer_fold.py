"""The sparse-MLA indexer's PCP fold: what each indexer call is handed, whether it folds, and
whether folding is right (a re-derivation of vLLM 0.33.0, read from its source).

Before writing its key cache the indexer reads ``num_tokens = slot_mapping.shape[0]`` and, ``if
use_pcp and num_tokens > k.shape[0]``, divides it by the PCP size N; then keeps ``k[:num_tokens]``
(``model_executor/layers/sparse_attn_indexer.py`` lines 554-559). No flag says which kind of
mapping arrived: the fold is right exactly when it folds the rank-major gathered ``[N*P]``
mapping (*expanded*) and leaves an unexpanded one alone. Paths below are relative to the
``vllm`` package.

What each call is handed (``slot_mapping_rows`` = line 554's ``num_tokens``, ``k_rows`` =
``k.shape[0]``):

* **k rows are the forward's token rows.** DeepSeek-V3.2's attention computes the indexer key
  from the layer's ``hidden_states`` and hands a same-shaped copy to the indexer
  (``models/deepseek_v32/attention.py`` lines 309-311, 347, 493; the older module computes it
  the same way, ``model_executor/models/deepseek_v2.py`` lines 777-778, 788-789, 820-821); the
  forward runs on the batch's padded token count.
* **The indexer's mapping is the forward's, untouched.** ``build_attn_metadata`` hands each KV
  group its whole slot-mapping row (``v1/worker/gpu/attn_utils.py`` lines 505, 537) and the
  indexer builder keeps it (``v1/attention/backends/mla/indexer.py`` lines 1426, 1430, 1772; the
  compressed slice of ``compress_ratio > 1`` is not modelled here).
* ``target``: the rank-local batch has ``P`` rows, ``P = batch_desc.num_tokens`` under a graph
  and the largest rank's real count when eager (``v1/worker/gpu/pcp_manager.py`` lines 483-484,
  373-374, 545-547, 699, 725); ``prepare_attn`` returns the gathered ``[G, N*P]`` mapping (lines
  771-798, 805-831; ``N*P`` at line 380). P >= 1: a step with no token never runs the model
  (``v1/worker/gpu/model_runner.py`` lines 1792-1797). DP padding only enlarges
  ``batch_desc.num_tokens`` (``v1/worker/gpu/dp_utils.py`` lines 180-200), which is P.
* ``target_dummy`` (profiling, an idle DP rank) and ``target_capture`` (with its warm-up passes): a
  dummy batch of ``T = batch_desc.num_tokens`` rows, identical on every rank (``model_runner.py``
  lines 1887-1893, 1900-1903), and ``get_dummy_slot_mappings(T)``: ``T*N`` PAD entries
  (``model_runner.py`` lines 1617-1631, ``pcp_manager.py`` lines 800-803; capture:
  ``v1/worker/gpu/cudagraph_utils.py`` lines 849-851 with the PCP manager). A profile run that skips
  attention builds no metadata, and the indexer returns before the fold when the metadata is not a
  dict (``sparse_attn_indexer.py`` lines 482-535).
* ``draft_prefill`` (MTP step 0): the target's mapping and the rank-local batch
  (``v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py`` lines 238-245, 285-289),
  run on ``T' = prefill_batch_desc.num_tokens`` rows (lines 258-266, 287, 416-418). ``T' >= P``,
  and ``T' > P`` needs a graph (an eager dispatch keeps P): the drafter dispatches P again, with
  the uniform count of its own rank's tokens. Eagerly, ``T' > P`` would hand the MTP layer
  ``input_ids`` of P rows (a view of the local batch) and ``hidden_states`` of T' rows, which its
  ``torch.cat`` refuses (``model_executor/models/deepseek_mtp.py`` lines 127-128); a PIECEWISE
  replay reads the buffers it was captured with (``docs/findings/piecewise-draft-prefill.md``),
  so it may reach the indexer with T' rows. Whether it does is not determined here (not run):
  such a call is ``reached=None``, judged as if it reached.
* ``draft_prefill_full_replay``: a FULL draft-prefill graph replays what it was captured on: the
  speculator's capture passes no PCP manager, so its mapping was the unexpanded
  ``BlockTables.get_dummy_slot_mappings(T')`` (``target_dependent_ar/cudagraph_utils.py`` lines
  88-98, ``cudagraph_utils.py`` lines 849-851, ``v1/worker/gpu/block_table.py`` lines 262-271).
  The fold decided at capture, on ``(T', T')``. That the replay reads the wrong buffers is
  ``docs/findings/full-draft-prefill-state.md``, not the fold.
* ``draft_decode`` (MTP steps 1..K-1, replicated, also their FULL capture and replay):
  ``compute_slot_mappings(..., batch_desc.num_tokens)`` gives ``[G, T_d]`` and the model runs
  on ``T_d = batch_desc.num_tokens`` rows (``target_dependent_ar/speculator.py`` lines 511-540,
  567-590, 615-630, 647-652; ``block_table.py`` line 260); capture: ``(T_d, T_d)`` from
  ``get_dummy_slot_mappings``.

A PIECEWISE graph runs the indexer outside its pieces, at replay, on the graph's rows (a splitting
op, ``config/compilation.py`` line 784; an eager break in DeepSeek-V3.2,
``models/deepseek_v32/attention.py`` line 466); a FULL graph decided at capture, on the capture's
shapes. Dual batch overlap, which slices the slot mapping per microbatch
(``v1/worker/gpu/ubatch_utils.py`` line 367), is refused under context parallelism
(``config/vllm.py`` lines 3245-3249).

**The inequality.** Expanded calls hand ``(N*P, P)`` with ``P >= 1``: ``N*P > P`` whenever
N >= 2, so they fold, to ``P``. Unexpanded calls hand ``(T, T)``: ``T > T`` never holds, so they
do not fold. With N = 1 ``use_pcp`` is false and nothing folds. The heuristic is therefore right
on every call that reaches it, for any P, T, K, batch and graph size, as long as the two
identities (k rows = P on an expanded call, k rows = mapping length on an unexpanded one) hold.
The first can fail in one place: a draft prefill whose own graph pads past P (T' > P). vLLM's
default capture sizes never do that (``tests/vllm/test_indexer_fold_vllm.py``); explicit ones can,
and with ``T' >= N*P`` the fold would miss an expanded mapping, were that forward to reach it;
``search`` tallies calls and keeps the wrong ones (``tests/vllm/test_indexer_fold_vllm.py`` feeds
it every call of a configuration space, its shapes from vLLM's own dispatch).

The CPU replay runs the fold on real writes: with the MoE + DSA checkpoint
(``pcpviz.vllm.replay.tiny_moe``) every indexer-key write goes through vLLM's fold and
``maybe_gather_indexer_k``, logged as ``IndexerWrite``; ``tests/vllm/test_replay_moe.py`` judges
each with ``indexer_call`` against the slot mappings the trace recorded (the target's and draft
step 0's expanded, folding to P; the replicated draft decodes' unexpanded, not folding).

PCP=2, a target step of a 13-token prefill and decodes of 1 and 4 tokens (per-rank 6 and 12
tokens, eager: P = 12), then K = 3 drafts of the 3 requests (eager: T_d = 3)::

    >>> [c.describe() for c in step_calls(2, [13, 1, 4], [True, False, False], k=3,
    ...                                   shard_decode_requests=True)]   # doctest: +NORMALIZE_WHITESPACE
    ['target: mapping 24 rows, k 12 rows -> folds to 12 (expanded: right)',
     'draft_prefill: mapping 24 rows, k 12 rows -> folds to 12 (expanded: right)',
     'draft_decode: mapping 3 rows, k 3 rows -> no fold (unexpanded: right)',
     'draft_decode: mapping 3 rows, k 3 rows -> no fold (unexpanded: right)']
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pcpviz.reference.layout import plan_layout

__all__ = [
    "CALL_KINDS",
    "EXPANDED_KINDS",
    "IndexerCall",
    "fold_num_tokens",
    "folds",
    "indexer_call",
    "target_padded_tokens",
    "step_calls",
    "FoldSearch",
    "search",
]

# The call sites of the indexer's key write under PCP, and whether each hands the gathered mapping.
EXPANDED_KINDS = ("target", "target_dummy", "target_capture", "draft_prefill")
UNEXPANDED_KINDS = ("draft_prefill_full_replay", "draft_prefill_capture", "draft_decode", "draft_decode_capture")
CALL_KINDS = EXPANDED_KINDS + UNEXPANDED_KINDS


def folds(slot_mapping_rows: int, k_rows: int, pcp_world_size: int) -> bool:
    """``use_pcp and num_tokens > k.shape[0]`` (``sparse_attn_indexer.py`` line 557);
    ``use_pcp`` is PCP > 1 (line 1058)."""
    return pcp_world_size > 1 and slot_mapping_rows > k_rows


def fold_num_tokens(slot_mapping_rows: int, k_rows: int, pcp_world_size: int) -> int:
    """The rows of ``k`` kept: ``k[:num_tokens]`` after the fold (lines 554-559).

        >>> fold_num_tokens(24, 12, 2), fold_num_tokens(3, 3, 2), fold_num_tokens(3, 8, 2)
        (12, 3, 3)
    """
    num_tokens = slot_mapping_rows
    if folds(slot_mapping_rows, k_rows, pcp_world_size):
        num_tokens //= pcp_world_size
    return min(num_tokens, k_rows)


@dataclass(frozen=True)
class IndexerCall:
    """One call of the indexer's key write: the two shapes the fold compares, and its verdict."""

    kind: str  # one of CALL_KINDS
    pcp_world_size: int  # N
    slot_mapping_rows: int  # slot_mapping.shape[0] at sparse_attn_indexer.py line 554
    k_rows: int  # k.shape[0]: the forward's padded token rows
    reached: bool | None = True  # None: not determined whether the forward gets here (T' > P)

    @property
    def expanded(self) -> bool:
        """The mapping is the rank-major gathered ``[N*P]`` one (only under PCP)."""
        return self.pcp_world_size > 1 and self.kind in EXPANDED_KINDS

    @property
    def folds(self) -> bool:
        return folds(self.slot_mapping_rows, self.k_rows, self.pcp_world_size)

    @property
    def kept_rows(self) -> int:
        return fold_num_tokens(self.slot_mapping_rows, self.k_rows, self.pcp_world_size)

    @property
    def right(self) -> bool:
        """The fold agrees with the mapping's kind (for ``reached=None``: were it reached)."""
        return self.folds == self.expanded

    def describe(self) -> str:
        verdict = f"folds to {self.kept_rows}" if self.folds else "no fold"
        kind = "expanded" if self.expanded else "unexpanded"
        text = (f"{self.kind}: mapping {self.slot_mapping_rows} rows, k {self.k_rows} rows -> {verdict} "
                f"({kind}: {'right' if self.right else 'WRONG'})")
        return text if self.reached else text + " if the forward gets here"


def indexer_call(kind: str, pcp_world_size: int, num_tokens: int, *,
                 draft_num_tokens: int | None = None) -> IndexerCall:
    """The call of ``kind`` on a forward of ``num_tokens`` padded rows.

    ``num_tokens`` is P for ``target`` and ``draft_prefill``, the dummy or captured T for the
    ``*_dummy`` / ``*_capture`` kinds and T_d for ``draft_decode``. ``draft_num_tokens`` is the
    draft prefill's own graph size T' (``prefill_batch_desc.num_tokens``, default P).

        >>> indexer_call("draft_prefill", 2, 2, draft_num_tokens=8).describe()
        'draft_prefill: mapping 4 rows, k 8 rows -> no fold (expanded: WRONG) if the forward gets here'
        >>> indexer_call("draft_decode", 4, 16).folds
        False
    """
    if kind not in CALL_KINDS:
        raise ValueError(f"unknown indexer call kind {kind!r}; expected one of {CALL_KINDS}")
    if pcp_world_size < 1 or num_tokens < 1:
        raise ValueError(f"need PCP >= 1 and at least one token, got PCP={pcp_world_size}, {num_tokens} tokens")
    n = pcp_world_size
    if kind == "draft_prefill":
        t_prime = num_tokens if draft_num_tokens is None else draft_num_tokens
        if t_prime < num_tokens:
            raise ValueError(f"a graph never pads below its batch: T'={t_prime} < P={num_tokens}")
        return IndexerCall(kind, n, n * num_tokens, t_prime, reached=True if t_prime == num_tokens else None)
    if kind in EXPANDED_KINDS:
        return IndexerCall(kind, n, n * num_tokens, num_tokens)
    return IndexerCall(kind, n, num_tokens, num_tokens)


def target_padded_tokens(num_scheduled_tokens: Sequence[int] | np.ndarray, is_prefilling: Sequence[bool] | np.ndarray,
                         pcp_world_size: int, *, graph_num_tokens: int | None = None,
                         shard_decode_requests: bool | None = None, dcp_world_size: int = 1) -> int:
    """P, the rank-local padded token count of a target step: ``graph_num_tokens`` (the batch
    descriptor's, under a graph) or the largest rank's real count (eager).

        >>> target_padded_tokens([13, 1, 4], [True, False, False], 2, shard_decode_requests=True)
        12
    """
    layout = plan_layout(num_scheduled_tokens, is_prefilling, pcp_world_size,
                         shard_decode_requests=shard_decode_requests, dcp_world_size=dcp_world_size,
                         padded_num_tokens=graph_num_tokens)
    return int(layout.padded_num_tokens)


def step_calls(pcp_world_size: int, num_scheduled_tokens: Sequence[int] | np.ndarray,
               is_prefilling: Sequence[bool] | np.ndarray, *, k: int, graph_num_tokens: int | None = None,
               draft_prefill_num_tokens: int | None = None, draft_prefill_full: bool = False,
               draft_decode_num_tokens: int | None = None, shard_decode_requests: bool | None = None,
               dcp_world_size: int = 1, num_speculative_tokens: int | None = None) -> tuple[IndexerCall, ...]:
    """The indexer calls of one real PCP + MTP step on one rank, per layer with an indexer: the
    target, draft step 0, and the K-1 replicated draft decodes.

    ``draft_prefill_full``: the draft prefill replays a FULL graph (its capture's unexpanded
    mapping, ``draft_prefill_num_tokens`` rows). ``draft_decode_num_tokens`` is the draft
    decodes' ``batch_desc.num_tokens`` (default R, eager). ``num_speculative_tokens`` is the step's
    scheduled K (``propose`` returns after step 0 when it is <= 1, ``target_dependent_ar/speculator.py``
    line 297).
    """
    p = target_padded_tokens(num_scheduled_tokens, is_prefilling, pcp_world_size, graph_num_tokens=graph_num_tokens,
                             shard_decode_requests=shard_decode_requests, dcp_world_size=dcp_world_size)
    calls = [indexer_call("target", pcp_world_size, p)]
    if draft_prefill_full:
        calls.append(indexer_call("draft_prefill_full_replay", pcp_world_size, draft_prefill_num_tokens or p))
    else:
        calls.append(indexer_call("draft_prefill", pcp_world_size, p, draft_num_tokens=draft_prefill_num_tokens))
    steps = k if num_speculative_tokens is None else num_speculative_tokens
    num_reqs = len(np.asarray(num_scheduled_tokens).reshape(-1))
    t_d = draft_decode_num_tokens if draft_decode_num_tokens is not None else num_reqs
    calls += [indexer_call("draft_decode", pcp_world_size, t_d) for _ in range(1, steps)]
    return tuple(calls)


@dataclass(frozen=True)
class FoldSearch:
    """What ``search`` covered and what it found."""

    num_calls: int
    kinds: dict[str, int]  # calls per kind
    wrong: tuple[IndexerCall, ...]  # reached calls where the fold disagrees with the mapping's kind
    undetermined: tuple[IndexerCall, ...]  # draft prefills on T' > P rows (``reached=None``)
    wrong_if_reached: tuple[IndexerCall, ...]  # those of them whose fold would be wrong


def search(calls: Iterable[IndexerCall]) -> FoldSearch:
    """Tally ``calls`` (e.g. every shape a configuration space reaches) and keep the wrong ones.

        >>> s = search(indexer_call(kind, n, t) for kind in CALL_KINDS for n in range(1, 9) for t in range(1, 65))
        >>> s.num_calls, s.wrong
        (4096, ())
    """
    kinds: dict[str, int] = {}
    wrong, undetermined = [], []
    n = 0
    for call in calls:
        n += 1
        kinds[call.kind] = kinds.get(call.kind, 0) + 1
        if call.reached is None:
            undetermined.append(call)
        elif not call.right:
            wrong.append(call)
    return FoldSearch(n, kinds, tuple(wrong), tuple(undetermined), tuple(c for c in undetermined if not c.right))
