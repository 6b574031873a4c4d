"""``pcpviz.reference.indexer_fold`` held to vLLM 0.33.0 on CPU, and the exhaustive search of the fold.

What runs as vLLM's own code here:

* the fold and the key write's gather: vLLM's ``sparse_attn_indexer`` function itself
  (``model_executor/layers/sparse_attn_indexer.py`` lines 438-573), called with a stand-in forward
  context and with ``ops.indexer_k_quant_and_cache`` (a CUDA kernel) replaced by a recorder that
  stops the call there (line 573), so lines 548-572 (the fold, ``maybe_gather_indexer_k``,
  ``_gather_prefill_cache_inputs`` of ``v1/attention/ops/pcp.py``) run unchanged on every PCP rank
  thread (``pcpviz.vllm.fake_group``);
* the shapes the call sites hand it: ``PCPManager._build_batch_layout`` (P and the ``[N*P]``
  gathered mapping), ``PCPManager.get_dummy_slot_mappings`` and ``BlockTables.get_dummy_slot_mappings``
  (dummy and capture mappings), vLLM's default capture sizes (``VllmConfig._set_cudagraph_sizes``)
  and the graph managers' ``dispatch`` (``SpeculatorCudaGraphManager``, whose candidates are the
  target's: the same class of ``_init_candidates`` with decode query length K+1).

What cannot run on CPU and is read, not run: the model forwards (DeepSeek-V3.2's attention and
MTP layer need CUDA kernels), so ``k.shape[0]`` equal to the forward's padded token rows is read
from ``models/deepseek_v32/attention.py`` lines 309-311, 347, 493, not observed; the top-k after
the write; and the captured FULL graphs (``draft_prefill_full_replay`` is the capture's shapes).
Whether a PIECEWISE draft prefill padded past P (only with explicit capture sizes) reaches the
indexer is therefore not determined: those calls are ``reached=None``.

The searches: vLLM's default capture sizes (no wrong fold, T' = P everywhere), and six explicit
lists (wrong folds only on draft prefills padded to T' >= N*P, if reached).
"""

from __future__ import annotations

import functools
import itertools
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

from pcpviz.reference.indexer_fold import (  # noqa: E402
    CALL_KINDS,
    indexer_call,
    search,
    target_padded_tokens,
)
from pcpviz.vllm.fake_group import FakePCPGroup, run_ranks  # noqa: E402

with cpu_patches.cpu_environment():
    import torch  # noqa: E402

    import vllm.distributed.parallel_state as parallel_state  # noqa: E402
    import vllm.model_executor.layers.sparse_attn_indexer as sai  # noqa: E402
    from vllm.config import CUDAGraphMode  # noqa: E402
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadata  # noqa: E402
    from vllm.v1.worker.gpu.pcp_manager import PCPManager  # noqa: E402

    from pcpviz.vllm.oracle import _block_tables, vllm_build_batch_layout  # noqa: E402
    from pcpviz.vllm.replay.graph_dispatch import capture_sizes, draft_prefill_manager  # noqa: E402

pytestmark = pytest.mark.slow

HEAD_DIM = 4
PREFIX = "model.layers.0.self_attn.indexer.k_cache"


class _Written(Exception):
    """Raised by the stand-in cache write: carries what vLLM handed the kernel."""

    def __init__(self, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        super().__init__("written")
        self.k, self.slot_mapping = k.clone(), slot_mapping.clone()


def _record_write(k, kv_cache, slot_mapping, quant_block_size, scale_fmt):  # noqa: ARG001
    raise _Written(k, slot_mapping)


_lock = threading.Lock()


def _vllm_write(n: int, slot_rows: int, k_rows: int, num_decode_tokens: int, shard: bool) -> list[tuple[int, int, str]]:
    """Run vLLM's ``sparse_attn_indexer`` on every rank of a PCP group of ``n`` up to its cache
    write; per rank: (k rows written, slot-mapping entries written, 'ok' or the error)."""
    slot_mapping = torch.arange(slot_rows, dtype=torch.int64)
    meta = DeepseekV32IndexerMetadata(
        seq_lens=torch.ones(1, dtype=torch.int32), max_seq_len=1, slot_mapping=slot_mapping,
        num_decodes=1 if num_decode_tokens else 0, num_decode_tokens=num_decode_tokens,
        num_prefills=0, num_prefill_tokens=0)
    ctx = SimpleNamespace(attn_metadata={PREFIX: meta}, cudagraph_runtime_mode=CUDAGraphMode.NONE)
    group = FakePCPGroup(n) if n > 1 else None
    fn = getattr(sai.sparse_attn_indexer, "__wrapped__", sai.sparse_attn_indexer)

    def rank_fn(rank: int) -> tuple[int, int, str]:
        k = torch.full((k_rows, HEAD_DIM), float(rank))
        try:
            fn(torch.zeros(k_rows, 8), PREFIX, torch.zeros(1), torch.zeros(k_rows, 1, HEAD_DIM), None, k,
               torch.zeros(k_rows, 1), 128, "ue8m0", 4, HEAD_DIM, 64, 64, torch.zeros(k_rows, 4, dtype=torch.int32),
               False, n > 1, shard, "")
        except _Written as w:
            return int(w.k.shape[0]), int(w.slot_mapping.shape[0]), "ok"
        except AssertionError as e:  # vLLM's own asserts (e.g. num_decode_tokens > local rows)
            return -1, -1, f"AssertionError: {e}"
        return -1, -1, "no write"

    saved = (sai.get_forward_context, sai.ops.indexer_k_quant_and_cache, sai.get_pcp_group)
    with _lock:
        sai.get_forward_context = lambda: ctx
        sai.ops.indexer_k_quant_and_cache = _record_write
        sai.get_pcp_group = parallel_state.get_pcp_group  # the patched one: the thread's fake group
        try:
            return run_ranks(group, rank_fn) if group is not None else [rank_fn(0)]
        finally:
            sai.get_forward_context, sai.ops.indexer_k_quant_and_cache, sai.get_pcp_group = saved


def _expected_write(call, num_decode_tokens: int, shard: bool) -> tuple[int, int]:
    """Where the reference's fold sends the keys (``v1/attention/ops/pcp.py`` lines 24-65)."""
    kept, n = call.kept_rows, call.pcp_world_size
    if n == 1:
        return call.k_rows, call.slot_mapping_rows  # use_pcp False: written as handed
    if call.slot_mapping_rows <= kept:
        return num_decode_tokens, num_decode_tokens  # unexpanded: local rows only
    if shard:
        return n * kept, n * kept
    if num_decode_tokens == kept:
        return kept, kept
    return num_decode_tokens + n * (kept - num_decode_tokens), num_decode_tokens + n * (kept - num_decode_tokens)


def _cases():
    rng = np.random.default_rng(36)
    for kind, n in itertools.product(CALL_KINDS, (1, 2, 3, 4, 8)):
        for _ in range(8):
            t = int(rng.integers(1, 40))
            call = indexer_call(kind, n, t)
            ndt = int(rng.integers(0, call.kept_rows + 1))
            yield call, ndt, bool(rng.integers(0, 2))


def test_vllm_fold_and_write_agree_with_the_reference_on_every_kind():
    """vLLM's own fold + gather, on every rank, writes what the reference's fold says it writes."""
    seen = 0
    for call, ndt, shard in _cases():
        got = _vllm_write(call.pcp_world_size, call.slot_mapping_rows, call.k_rows, ndt, shard)
        want = (*_expected_write(call, ndt, shard), "ok")
        assert all(g == want for g in got), (call.describe(), ndt, shard, got, want)
        seen += 1
    assert seen == len(CALL_KINDS) * 5 * 8


def test_folding_a_draft_decode_trips_vllms_assert():
    """Why the shape test exists: a replicated draft decode of 3 rows under PCP=2, folded anyway
    (the review's ``if use_pcp:``), would keep 1 row and trip ``ops/pcp.py`` line 26. With the
    shape test (vLLM's code) it writes its 3 rows locally."""
    assert _vllm_write(2, 3, 3, 3, True) == [(3, 3, "ok")] * 2
    # k padded past N*P: the expanded mapping would take the local branch (never reached in 0.33.0).
    assert _vllm_write(2, 6, 6, 0, True) == [(0, 0, "ok")] * 2


def test_call_site_shapes_are_vllms():
    """P and the gathered mapping's length (N*P) from vLLM's ``_build_batch_layout``; the dummy /
    capture mappings from vLLM's ``get_dummy_slot_mappings`` (PCP manager: N*T; block tables: T)."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        n = int(rng.integers(2, 9))
        r = int(rng.integers(1, 6))
        q = rng.integers(1, 40, size=r)
        pre = rng.random(r) < 0.5
        q[~pre] = rng.integers(1, 5, size=int((~pre).sum()))
        shard = bool(rng.integers(0, 2))
        lay = vllm_build_batch_layout(q, pre, n, shard_decode_requests=shard, dcp_world_size=1 if shard else 2)
        p = max(lay["per_rank_num_tokens"])
        graph = None if rng.random() < 0.5 else p + int(rng.integers(0, 9))
        if graph is not None:
            lay = vllm_build_batch_layout(q, pre, n, shard_decode_requests=shard, dcp_world_size=1 if shard else 2,
                                          padded_num_tokens=graph)
        p_ref = target_padded_tokens(q, pre, n, graph_num_tokens=graph, shard_decode_requests=shard,
                                     dcp_world_size=1 if shard else 2)
        assert len(lay["padded_gather_idx"]) == n * p_ref == indexer_call("target", n, p_ref).slot_mapping_rows
    tables = _block_tables([[1, 2]], 4, max_num_tokens=64)
    for n, t in [(2, 1), (2, 16), (4, 8), (8, 7)]:
        mgr = PCPManager(n, 0, torch.device("cpu"), True, max_num_reqs=8, max_num_tokens=64, block_tables=tables)
        assert mgr.get_dummy_slot_mappings(t).shape[1] == indexer_call("target_dummy", n, t).slot_mapping_rows
        unexpanded = indexer_call("draft_decode_capture", n, t)
        assert tables.get_dummy_slot_mappings(t).shape[1] == unexpanded.slot_mapping_rows


MODES = (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)
MAX_NUM_SEQS = (1, 2, 3, 5, 8, 10, 16, 64, 100, 256)
BUDGETS = (256, 8192)  # max_num_batched_tokens: chunked prefill budgets


@functools.lru_cache(maxsize=None)  # kept alive: _dispatch memoises by the manager's id
def _managers(mode, k, max_num_seqs, budget, explicit_sizes=None):
    """vLLM's default capture sizes (or ``explicit_sizes``, taken as given like the V2 runner does)
    and the draft prefill's and draft decodes' graph managers; the target's candidates are the
    draft prefill's (the same ``_init_candidates`` with decode query length K+1)."""
    if mode == CUDAGraphMode.NONE:
        return (), None, None
    sizes = list(explicit_sizes) if explicit_sizes else capture_sizes(
        max_num_seqs=max_num_seqs, k=k, max_num_batched_tokens=budget, mode=mode)
    pre = draft_prefill_manager(mode, sizes=sizes, max_num_seqs=max_num_seqs, k=k)
    dec = draft_prefill_manager(mode, sizes=sizes, max_num_seqs=max_num_seqs, k=k, decode=True)
    return tuple(sizes), pre, dec


_DISPATCHED: dict = {}


def _dispatch(mgr, num_reqs, num_tokens, uniform, max_query_len=None):
    """vLLM's ``CudaGraphManager.dispatch`` (memoised per manager and arguments)."""
    if mgr is None:
        return CUDAGraphMode.NONE, num_tokens
    args = (id(mgr), num_reqs, num_tokens, uniform, max_query_len)
    if args not in _DISPATCHED:
        d = mgr.dispatch(num_reqs, num_tokens, uniform, 0, max_query_len=max_query_len)
        _DISPATCHED[args] = (d.cg_mode, d.num_tokens)
    return _DISPATCHED[args]


def _batches(n, k, max_num_seqs, budget):
    """Global batches of a step: R decodes of K+1 tokens (uniform) or of 1..K+1 (ragged), with or
    without one prefill chunk filling the budget or a short one. Yields (query lens, is_prefilling)."""
    q = k + 1
    for r in sorted({1, 2, 3, n - 1, n, n + 1, 2 * n + 1, max_num_seqs // 2, max_num_seqs}):
        if not 1 <= r <= max_num_seqs:
            continue
        yield np.full(r, q), np.zeros(r, bool)
        if k > 1:
            yield 1 + np.arange(r) % q, np.zeros(r, bool)
        dec = r - 1
        for chunk in sorted({1, 2 * n - 1, 2 * n + 3, 100, budget - dec * q}):
            if 1 <= chunk <= budget - dec * q:
                yield np.append(np.full(dec, q), chunk), np.append(np.zeros(dec, bool), True)


def _reachable_shapes(stats):
    """The distinct ``(kind, N, rows, draft rows)`` of every indexer call vLLM 0.33.0 makes for the
    configurations of ``MODES`` x K 1..4 x ``MAX_NUM_SEQS`` x ``BUDGETS`` x N 1..8 x sharded /
    replicated decodes x ``_batches`` x DP = 1 / DP > 1 (the verdict depends on nothing else)."""
    shapes = set()
    for config in itertools.product(MODES, (1, 2, 3, 4), MAX_NUM_SEQS, BUDGETS):
        mode, k, mns, budget = config
        if budget < mns * (k + 1):
            continue
        sizes, pre, dec = _managers(*config)
        for n in range(1, 9):
            # captures and dummy runs: every capture size T, and eager dummy sizes
            for t in sorted(set(sizes) | {1, k + 1, budget}):
                shapes.add(("target_capture" if t in sizes else "target_dummy", n, t, None))
                shapes.add(("draft_prefill_capture", n, t, None))
                shapes.add(("draft_decode_capture", n, t, None))
            for shard in (True, False):
                for lens, prefilling in _batches(n, k, mns, budget):
                    stats["steps"] += 1
                    shapes.update((kind, n, t, d) for kind, t, d in _step(config, n, lens, prefilling, shard))
    return shapes


def _step(config, n, lens, prefilling, shard):
    """One step's calls on every rank (kind, rows, draft rows), with DP = 1 and with DP > 1."""
    k = config[1]
    _, pre, dec = _managers(*config)
    r = len(lens)
    key, per_rank = _rank_tokens(n, tuple(lens.tolist()), tuple(prefilling.tolist()), shard)
    has_prefill = bool(prefilling.any())
    # model_runner.py lines 1357, 1384-1386 (decode_graph_eligible is `not has_prefill` under PCP)
    uniform = None if has_prefill or len(set(lens.tolist())) != 1 else int(lens[0])
    max_query_len = None if has_prefill else int(lens.max())  # model_runner.py lines 1802-1810
    out = set()
    # DP = 1: the target dispatches on the global uniform count, each rank's draft prefill on its
    # own unpadded local count (target_dependent_ar/speculator.py lines 250-266).
    mode, p = _dispatch(pre, r, key, uniform, max_query_len)
    p = key if mode == CUDAGraphMode.NONE else p  # pcp_manager.py lines 483-484, 545-547
    out.add(("target", p, None))
    for local in per_rank:
        local_uniform = uniform if (uniform and local == r * uniform) else None
        out.add(_draft_prefill(pre, r, p, local_uniform))
    out |= _dp_shapes(config, r, key, uniform)
    if k >= 2:  # K - 1 draft decodes, all of the same shape
        out.add(("draft_decode", _dispatch(dec, r, r, 1)[1], None))
    return out


@functools.lru_cache(maxsize=None)
def _dp_shapes(config, r, key, uniform):
    """DP > 1 with graphs: target and draft prefill dispatch on the agreed count (dp_utils.py lines
    180-200, 283-289), P from the largest DP rank's tokens (any capture size above this rank's);
    eager DP does not pad (lines 159-175), which is the DP = 1 P."""
    sizes, pre, _ = _managers(*config)
    out = set()
    for synced_uniform in {uniform, None}:
        for dp_key in [key] + [s for s in sizes if s > key]:
            mode, p = _dispatch(pre, r, dp_key, synced_uniform)
            if mode != CUDAGraphMode.NONE:
                out.add(("target", p, None))
                out.add(_draft_prefill(pre, r, p, synced_uniform))
    return frozenset(out)


def _draft_prefill(pre, r, p, uniform):
    """The draft prefill's call: a FULL replay of its capture, or the target's mapping on T' rows."""
    dmode, t_prime = _dispatch(pre, r, p, uniform)
    if dmode == CUDAGraphMode.FULL:
        return ("draft_prefill_full_replay", t_prime, None)
    return ("draft_prefill", p, t_prime)


@functools.lru_cache(maxsize=None)
def _rank_tokens(n, lens, prefilling, shard):
    """(the dispatch key, each rank's real tokens) from vLLM's own chunking (``_iter_rank_chunks``,
    which ``get_num_tokens_for_dispatch`` sums; model_runner.py lines 1812-1816)."""
    mgr = PCPManager(n, 0, torch.device("cpu"), shard, dcp_world_size=1 if shard else 2)
    q, pre = np.asarray(lens, dtype=np.int32), np.asarray(prefilling, dtype=bool)
    per_rank = [sum(c for _, _, c in mgr._iter_rank_chunks(rank, q, pre)) for rank in range(n)]
    assert max(per_rank) == mgr.get_num_tokens_for_dispatch(q, pre)
    return max(per_rank), tuple(per_rank)


def test_exhaustive_search_finds_no_wrong_fold():
    """No reachable call of the configurations searched folds wrongly, and every draft prefill that
    is not a FULL replay runs on the target's P rows (T' = P: none is cut short by a shape error)."""
    stats = {"steps": 0}
    shapes = _reachable_shapes(stats)
    result = search(indexer_call(kind, n, t, draft_num_tokens=d) for kind, n, t, d in sorted(
        shapes, key=lambda s: (s[0], s[1], s[2], s[3] or 0)))
    assert result.wrong == ()
    assert result.undetermined == ()
    assert set(result.kinds) == set(CALL_KINDS)
    assert stats["steps"] > 100_000 and result.num_calls > 5_000
    assert result.kinds["draft_prefill_full_replay"] > 0


def test_explicit_capture_sizes_can_pad_a_draft_prefill_past_n_times_p():
    """The conditional counterexample. ``cudagraph_capture_sizes=[1, 8]`` (the V2 runner takes
    explicit sizes as given: ``config/vllm.py`` lines 2560-2571; only V1 rounds them to multiples of
    K+1, ``config/compilation.py`` lines 1503-1508), K = 1, ``FULL_AND_PIECEWISE``, PCP = 2, DCP = 1,
    a step of one decode (2 tokens): the target replays a FULL graph of 2 tokens (P = 2, from size 1
    rounded up to K+1); rank 0 owns the decode and replays the FULL draft prefill, rank 1 holds no
    token, so its draft prefill is not uniform and dispatches PIECEWISE for 8 rows. Its indexer would
    get the expanded 4-row mapping against 8 key rows: no fold, were that forward to reach it (not
    determined: the PIECEWISE replay reads its captured buffers)."""
    mode, k = CUDAGraphMode.FULL_AND_PIECEWISE, 1
    pre = draft_prefill_manager(mode, sizes=[1, 8], max_num_seqs=8, k=k)
    key, per_rank = _rank_tokens(2, (2,), (False,), True)
    assert (key, per_rank) == (2, (2, 0))
    def run(num_tokens, uniform, max_query_len=None):
        d = pre.dispatch(1, num_tokens, uniform, 0, max_query_len=max_query_len)
        return d.cg_mode, d.num_tokens

    assert run(key, 2, 2) == (CUDAGraphMode.FULL, 2)  # the target: P = 2
    assert run(2, 2) == (CUDAGraphMode.FULL, 2)  # rank 0's draft prefill: FULL replay
    assert run(2, None) == (CUDAGraphMode.PIECEWISE, 8)  # rank 1's: T' = 8 >= N*P = 4
    call = indexer_call("draft_prefill", 2, 2, draft_num_tokens=8)
    assert call.reached is None and not call.folds and not call.right
    # vLLM's own fold on those shapes (rank 1 has no decode token): no fold, no gather, nothing written
    assert _vllm_write(2, 4, 8, 0, True) == [(0, 0, "ok")] * 2
    # with vLLM's default sizes for the same configuration the drafter pads to P
    default = draft_prefill_manager(mode, sizes=capture_sizes(max_num_seqs=8, k=k, max_num_batched_tokens=8192,
                                                              mode=mode), max_num_seqs=8, k=k)
    assert default.dispatch(1, 2, None, 0).num_tokens == 2


EXPLICIT_SIZES = ((1, 8), (1, 16, 32), (1, 2, 4, 8, 16, 32, 64), (2, 8), (4, 8), (8, 16))


def test_explicit_capture_sizes_search():
    """The same search with a few explicit capture-size lists instead of the defaults (DP = 1 and
    DP > 1, every mode with graphs, K 1-4, N 1-8): the only calls whose fold disagrees with the
    mapping are draft prefills padded past N*P (``reached=None``), all under ``FULL_AND_PIECEWISE``;
    no call known to reach the fold is wrong."""
    stats, shapes = {"steps": 0}, set()
    modes = (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)
    misses = set()
    for sizes, mode, k, mns in itertools.product(EXPLICIT_SIZES, modes, (1, 2, 3, 4), (1, 2, 4, 8)):
        config = (mode, k, mns, 8192, sizes)
        for n in range(2, 9):
            for shard in (True, False):
                for lens, prefilling in _batches(n, k, mns, 8192):
                    stats["steps"] += 1
                    for kind, t, d in _step(config, n, lens, prefilling, shard):
                        shapes.add((kind, n, t, d))
                        call = indexer_call(kind, n, t, draft_num_tokens=d)
                        if not call.right:
                            misses.add((sizes, mode, k, n, shard, len(lens), t, d))
    result = search(indexer_call(kind, n, t, draft_num_tokens=d) for kind, n, t, d in shapes)
    assert result.wrong == ()
    assert result.wrong_if_reached and all(c.kind == "draft_prefill" for c in result.wrong_if_reached)
    assert {m[1] for m in misses} == {CUDAGraphMode.FULL_AND_PIECEWISE}
    assert all(m[4] and m[5] == 1 and m[7] >= m[3] * m[6] for m in misses)  # sharded, one decode, T' >= N*P
    assert ((1, 8), CUDAGraphMode.FULL_AND_PIECEWISE, 1, 2, True, 1, 2, 8) in misses
    assert not any(m[0] == (1, 2, 4, 8, 16, 32, 64) for m in misses)  # powers of two pad by < 2x
