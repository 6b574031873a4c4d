"""Triton kernels (pcpviz_kernels) against their torch references and pcpviz.reference.blocks.

On CPU every kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``,
set here before the kernels are first imported). Triton's own library
functions (``tl.max``, ...) are interpreted only if the variable was set before
``triton`` itself was imported; when an earlier module imported triton without
it, the CPU tests run once more in a fresh ``pytest`` subprocess instead. With
a usable GPU and no interpreter requested, the ``test_gpu_*`` variants run the
compiled kernels on sm_90: ``python -m pytest -m gpu tests/engine/test_kernels.py`` (the suite's
conftest leaves the GPUs visible: the CPU vLLM patches are scoped and skipped for ``-m gpu``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

# Decide the mode before anything imports triton's jit on our kernels.
GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT_DIR, "kernels"))


import pcpviz_kernels as K  # noqa: E402

assert K.INTERPRET == (not GPU), "pcpviz_kernels was imported earlier in this process in the other mode"


def _interpreter_works() -> bool:
    """A tiny attention call (it uses tl.max / tl.sum reductions) under the interpreter."""
    if GPU or os.environ.get("PCPVIZ_KERNELS_TEST_CHILD") == "1":  # the child never spawns another
        return True
    from triton.runtime.errors import InterpreterError

    try:
        K.paged_mla_attention(torch.zeros(1, 1, 64), torch.zeros(1, 1, 16), torch.zeros(4, 80),
                              torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1]), torch.tensor([0]),
                              torch.tensor([1]), 4, 1.0)
        return True
    except InterpreterError as e:  # "Cannot call @triton.jit'd outside of the scope of a kernel"
        return "outside of the scope of a kernel" not in str(e)


SUBPROCESS = not _interpreter_works()

from pcpviz.reference import blocks as npb  # noqa: E402
from pcpviz.engine import kv_cache as engine_kv  # noqa: E402
from pcpviz.reference.layout import plan_layout  # noqa: E402

cpu_only = pytest.mark.skipif(GPU or SUBPROCESS, reason="kernels compiled for the GPU in this process"
                              if GPU else "triton imported without the interpreter: run in a subprocess")
# The GPU tier runs on the GPU machine (`pytest -m gpu tests/engine/test_kernels.py`);
# tests/conftest.py deselects it on CPU machines (CI has no GPU), so nothing is silently skipped.
gpu_only = pytest.mark.gpu
DEV = "cuda" if GPU else "cpu"


def test_interpreter_mode_matches_device():
    assert K.INTERPRET is (not GPU)
    if not GPU:
        from triton import knobs

        assert knobs.runtime.interpret


def test_cpu_kernels_in_a_fresh_interpreter_process():
    """When triton was imported without the interpreter, the CPU tests re-run in a child with it;
    otherwise this process is that interpreter and a kernel call must equal its reference."""
    if not SUBPROCESS:
        if GPU:
            return
        slots = torch.tensor([2, -1, 0])
        lat = torch.arange(3 * 8, dtype=torch.float32).view(3, 8)
        got, want = torch.zeros(4, 8), torch.zeros(4, 8)
        K.write_kv_cache(got, slots, lat)
        K.write_kv_cache_ref(want, slots, lat)
        assert torch.equal(got, want) and torch.equal(got[2], lat[0]) and not got[1].any()
        return
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PCPVIZ_KERNELS_TEST_CHILD="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


# ------------------------------------------------------------------------------- helpers
def _table(rng, num_reqs, width, num_blocks):
    """A random dense block table (distinct blocks, block 0 = null never used)."""
    perm = rng.permutation(np.arange(1, num_blocks))
    assert perm.size >= num_reqs * width
    return perm[: num_reqs * width].reshape(num_reqs, width).astype(np.int32)


def _t(a, dtype=torch.int64, dev=DEV):
    return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=dev)


def _attn_case(rng, *, rows, num_heads, r, dr, block_size, cache_dtype=torch.float32, dev=DEV):
    """rows: list of (positions list, seq_len). Returns kernel args (+ padding query rows)."""
    width = max(1, max(-(-max(n, 1) // block_size) for _, n in rows))
    num_blocks = len(rows) * width + 2
    bt = _table(rng, len(rows), width, num_blocks)
    qsl = np.concatenate([[0], np.cumsum([len(p) for p, _ in rows])]).astype(np.int64)
    pos = np.concatenate([np.asarray(p, np.int64) for p, _ in rows] + [np.zeros(2, np.int64)])  # 2 pads
    seq = np.array([n for _, n in rows], np.int64)
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q = pos.shape[0]
    cache = torch.randn(num_blocks * block_size, r + dr, generator=g).to(cache_dtype).to(dev)
    q_lat = torch.randn(q, num_heads, r, generator=g).to(dev)
    q_pe = torch.randn(q, num_heads, dr, generator=g).to(dev)
    return dict(q_lat=q_lat, q_pe=q_pe, cache=cache, block_rows=_t(bt, torch.int32, dev),
                query_start_loc=_t(qsl, dev=dev), positions=_t(pos, dev=dev), seq_lens=_t(seq, dev=dev),
                block_size=block_size, scale=1.0 / (r + dr) ** 0.5)


def _dual_chunk_rows(prompt_len, pcp, rank, cached=0):
    """The segments of a fresh prefill on ``rank`` (positions, causal seq_len), via plan_layout."""
    lay = plan_layout([prompt_len], [True], pcp)
    out = []
    for seg in lay.segments_by_rank[rank]:
        if seg.num_tokens:
            p = list(range(cached + seg.global_start, cached + seg.global_stop))
            out.append((p, p[-1] + 1))
    return out


def _check_attention(case, atol=2e-5, **kw):
    got = K.paged_mla_attention(**case, **kw)
    want = K.paged_mla_attention_ref(**case)
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    # Padding query rows (past query_start_loc[B]) and empty rows are zero.
    assert torch.all(got[-2:] == 0)
    return got


# ------------------------------------------------------------------------------- attention
ATTN_CASES = {
    # decode / draft decode: one query per row, context 0..pos; a zero-length row; seq_len 0 row
    "decode": dict(rows=[([9], 10), ([0], 1), ([], 5), ([30], 31), ([3], 0)], num_heads=4),
    # DualChunkSwap prefill segments of a 23-token prompt, PCP=2 rank 0 and rank 1, plus a decode
    "prefill_pcp2_r0": dict(rows=_dual_chunk_rows(23, 2, 0) + [([17], 18)], num_heads=4),
    "prefill_pcp2_r1": dict(rows=_dual_chunk_rows(23, 2, 1, cached=5), num_heads=3),
    # arbitrary positions inside a longer context (chunked prefill / draft rows), many heads
    "chunk_many_heads": dict(rows=[([40, 41, 42, 43, 44], 45), ([2, 7], 8)], num_heads=20),
    # seq_len shorter than pos + 1: the context is capped by seq_len
    "capped": dict(rows=[([5, 6, 7, 8], 7)], num_heads=2),
}


@cpu_only
@pytest.mark.parametrize("name", sorted(ATTN_CASES))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_mla_attention_matches_reference(name, block_size):
    rng = np.random.default_rng(hash((name, block_size)) % (1 << 31))
    case = _attn_case(rng, r=64, dr=16, block_size=block_size, **ATTN_CASES[name])
    _check_attention(case)


@cpu_only
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_paged_mla_attention_split_k(num_splits):
    rng = np.random.default_rng(num_splits)
    case = _attn_case(rng, rows=[([60], 61), ([33], 34), ([70, 71, 72], 73)], num_heads=4, r=64, dr=16,
                      block_size=8)
    _check_attention(case, num_splits=num_splits)


@pytest.mark.slow
@cpu_only
@pytest.mark.parametrize("reload", [True, False])
@pytest.mark.parametrize("name", ["decode", "prefill_pcp2_r1", "chunk_many_heads"])
def test_paged_mla_attention_reload_variants(reload, name):
    """Key chunks re-read for the second product (fp32 default) or kept (a bf16 option)."""
    rng = np.random.default_rng(len(name))
    case = _attn_case(rng, r=64, dr=16, block_size=4, **ATTN_CASES[name])
    cfg = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "RELOAD": reload}
    _check_attention(case, config=cfg)
    _check_attention(case, config=cfg, num_splits=3)


@cpu_only
def test_paged_mla_attention_split_ends_inside_a_tile():
    """A split of 48 keys with 32-key tiles: the tile straddling the split's end must not
    count the next split's keys (found on the H200 at 32k context, split length 1008)."""
    rng = np.random.default_rng(5)
    case = _attn_case(rng, rows=[([95], 96), ([70], 71)], num_heads=4, r=64, dr=16, block_size=8)
    cfg = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    assert K.paged_mla.plan(4, 2, 1, 96, torch.device("cpu"), 2)[5] == 48
    _check_attention(case, config=cfg, num_splits=2)


@cpu_only
def test_paged_mla_attention_engine_sizes_and_engine_wrapper():
    """R=512, DR=64 as the shipped model; kernel + W_UV equals the engine's torch path."""
    rng = np.random.default_rng(7)
    case = _attn_case(rng, rows=_dual_chunk_rows(11, 2, 0) + [([20], 21)], num_heads=4, r=512, dr=64,
                      block_size=16)
    got = _check_attention(case, atol=5e-5)
    g = torch.Generator().manual_seed(3)
    w_uk = torch.randn(4, 8, 512, generator=g)
    w_uv = torch.randn(4, 8, 512, generator=g)
    q_nope = torch.randn(case["q_lat"].shape[0], 4, 8, generator=g)
    case2 = dict(case, q_lat=torch.einsum("qhd,hdr->qhr", q_nope, w_uk))
    ctx = K.paged_mla_attention(**case2)
    mine = torch.einsum("qhr,hvr->qhv", ctx, w_uv)
    ref = engine_kv.paged_mla_attention(q_nope, case["q_pe"], case["cache"], block_rows=case["block_rows"],
                                        query_start_loc=case["query_start_loc"], positions=case["positions"],
                                        seq_lens=case["seq_lens"], w_uk=w_uk, w_uv=w_uv,
                                        block_size=case["block_size"], scale=case["scale"])
    torch.testing.assert_close(mine, ref, atol=1e-3, rtol=1e-4)
    assert got.shape == (case["q_lat"].shape[0], 4, 512)


@cpu_only
def test_paged_mla_attention_bf16_cache():
    rng = np.random.default_rng(11)
    case = _attn_case(rng, rows=[([12], 13), ([4, 5, 6], 7)], num_heads=4, r=64, dr=16, block_size=4,
                      cache_dtype=torch.bfloat16)
    got = K.paged_mla_attention(**case)
    torch.testing.assert_close(got, K.paged_mla_attention_ref(**case), atol=3e-2, rtol=3e-2)


@cpu_only
def test_paged_mla_attention_empty_inputs():
    rng = np.random.default_rng(0)
    case = _attn_case(rng, rows=[([], 0)], num_heads=2, r=64, dr=16, block_size=4)
    assert torch.all(K.paged_mla_attention(**case) == 0)
    with pytest.raises(ValueError, match="power of two"):
        K.paged_mla_attention(**dict(case, q_lat=case["q_lat"][..., :48], cache=case["cache"][:, :64]))


# ------------------------------------------------------------------------------- prefill (flash)
def _prefill_case(rng, rows, *, num_heads, dn=32, dr=16, dv=32, dtype=torch.float32, dev=DEV):
    """rows: (positions, kv_len) per batch row; flat K/V, row i's keys from kv_start_loc[i]; 2 pad queries."""
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    qsl = np.concatenate([[0], np.cumsum([len(p) for p, _ in rows])])
    pos = np.concatenate([np.asarray(p, np.int64) for p, _ in rows] + [np.zeros(2, np.int64)])
    lens = np.array([n for _, n in rows], np.int64)
    nq, nk = pos.size, int(lens.sum())
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(dev)  # noqa: E731
    return dict(q_nope=rnd(nq, num_heads, dn), q_pe=rnd(nq, num_heads, dr), k_nope=rnd(nk, num_heads, dn),
                k_pe=rnd(nk, dr), v=rnd(nk, num_heads, dv), query_start_loc=_t(qsl, dev=dev),
                positions=_t(pos, dev=dev), kv_start_loc=_t(np.concatenate([[0], np.cumsum(lens)[:-1]]), dev=dev),
                kv_lens=_t(lens, dev=dev), scale=1.0 / (dn + dr) ** 0.5)


PREFILL_CASES = {
    # fresh prompts: one longer than a query tile (16 under the interpreter), one short
    "varlen": [(list(range(37)), 37), (list(range(5)), 5)],
    # chunked prefill: chunks whose earlier positions are already cached
    "chunked": [(list(range(20, 45)), 45), (list(range(3, 6)), 6)],
    # DualChunkSwap, PCP=2: rank 0's head + tail chunks (after 7 cached tokens), rank 1's middle pair
    "pcp2_r0": _dual_chunk_rows(50, 2, 0, cached=7),
    "pcp2_r1": _dual_chunk_rows(50, 2, 1),
    # decode and MTP-verify rows mixed in, a row without queries, a context capped below position + 1
    "mixed": [([30], 31), ([10, 11, 12], 13), ([], 9), ([5, 6, 7, 8, 9, 10], 8), ([0], 1)],
}


@cpu_only
@pytest.mark.parametrize("name", sorted(PREFILL_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_prefill_attention_matches_reference(name, dtype):
    case = _prefill_case(np.random.default_rng(len(name)), PREFILL_CASES[name], num_heads=3, dtype=dtype)
    got = K.mla_prefill_attention(**case)
    torch.testing.assert_close(got, K.mla_prefill_attention_ref(**case), atol=2e-5, rtol=2e-5)
    assert torch.all(got[-2:] == 0)  # padding queries


@cpu_only
def test_mla_prefill_attention_rows_subset_in_place():
    """Only the listed rows are written (in the order given, longest first in the engine)."""
    rows = PREFILL_CASES["mixed"] + PREFILL_CASES["varlen"]
    case = _prefill_case(np.random.default_rng(1), rows, num_heads=2)
    sel = torch.tensor([5, 3, 1])
    sub = dict(case, kv_start_loc=case["kv_start_loc"][sel], kv_lens=case["kv_lens"][sel])
    got = torch.full((case["q_nope"].shape[0], 2, 32), 7.0)
    K.mla_prefill_attention(**sub, rows=sel, out=got)
    want = K.mla_prefill_attention_ref(**sub, rows=sel, out=torch.full_like(got, 7.0))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    qsl = case["query_start_loc"].tolist()
    written = np.zeros(got.shape[0], bool)
    for b in sel.tolist():
        written[qsl[b]:qsl[b + 1]] = True
    assert torch.all(got[torch.from_numpy(~written)] == 7.0) and not torch.any(got[torch.from_numpy(written)] == 7.0)
    with pytest.raises(ValueError, match="power of two"):
        K.mla_prefill_attention(**dict(case, q_nope=case["q_nope"][..., :24], k_nope=case["k_nope"][..., :24]))


def test_prefill_flops_counts_visible_pairs():
    from pcpviz_kernels.mla_prefill import prefill_flops

    rows = [(range(0, 5), 5), (range(12, 16), 16), (range(5, 11), 8), (range(3, 3), 4)]
    pairs = sum(min(p + 1, n) for pos, n in rows for p in pos)
    assert prefill_flops([p for p, _ in rows], [n for _, n in rows], 4, 128, 64, 128) == pairs * 4 * 2 * 320


def _engine_case(rng, rows, dtype, dev=DEV):
    case = _attn_case(rng, rows=rows, num_heads=4, r=64, dr=16, block_size=4, cache_dtype=dtype, dev=dev)
    g = torch.Generator().manual_seed(5)
    nq = case["q_lat"].shape[0]
    w = lambda *shape: (torch.randn(*shape, generator=g) / 4).to(dtype).to(dev)  # noqa: E731
    return dict(q_nope=w(nq, 4, 16), q_pe=case["q_pe"].to(dtype), cache=case["cache"], block_rows=case["block_rows"],
                query_start_loc=case["query_start_loc"], positions=case["positions"], seq_lens=case["seq_lens"],
                w_uk=w(4, 16, 64), w_uv=w(4, 32, 64), block_size=case["block_size"], scale=case["scale"])


ENGINE_ROWS = (_dual_chunk_rows(41, 2, 0, cached=3) + [([17], 18), ([20, 21, 22], 23), ([], 6)]
               + [(list(range(9, 30)), 30)])


@pytest.mark.slow
@cpu_only
@pytest.mark.parametrize("decode_max", [0, 3, 1000])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_engine_kernel_path_matches_torch_path(decode_max, dtype, atol):
    """The CUDA dispatch (absorbed kernel for short rows, gather + up-projection + flash kernel
    for long ones, any split of one mixed batch) equals the engine's CPU path."""
    args = _engine_case(np.random.default_rng(9), ENGINE_ROWS, dtype)
    want = engine_kv.paged_mla_attention(**args)  # CPU: the torch reference
    got = engine_kv.paged_mla_attention_kernels(**args, kernels=K, decode_max=decode_max)
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    host = engine_kv.lens_on_host(args["query_start_loc"], args["seq_lens"])
    again = engine_kv.paged_mla_attention_kernels(**args, kernels=K, decode_max=decode_max, host_lens=host,
                                                  max_query_len=int(np.diff(host[0]).max()), max_seq_len=30)
    assert torch.equal(again, got)


# ------------------------------------------------------------------------------- KV write
@cpu_only
@pytest.mark.parametrize("width,dtype", [(576, torch.float32), (48, torch.float32), (96, torch.bfloat16)])
def test_write_kv_cache_matches_reference(width, dtype):
    rng = np.random.default_rng(width)
    num_slots, m = 64, 23
    slots = rng.choice(num_slots, size=m, replace=False).astype(np.int64)
    slots[rng.random(m) < 0.3] = -1  # PAD rows
    slots[5] = num_slots + 3  # out of range: skipped
    latent = torch.randn(m, width)
    a = torch.full((num_slots, width), 7.0, dtype=dtype)
    b = a.clone()
    K.write_kv_cache(a, _t(slots, dev="cpu"), latent)
    K.write_kv_cache_ref(b, _t(slots, dev="cpu"), latent)
    if dtype == torch.float32:
        assert torch.equal(a, b)
    else:  # the interpreter rounds fp32 -> bf16 by truncation: allow one bf16 ulp
        torch.testing.assert_close(a.float(), b.float(), atol=0, rtol=2 ** -7)
    untouched = np.setdiff1d(np.arange(num_slots), slots[slots >= 0])
    assert torch.all(a[untouched] == 7.0)
    K.write_kv_cache(a, _t(np.zeros(0, np.int64), dev="cpu"), latent[:0])  # M = 0


# ------------------------------------------------------------------------------- block table
@cpu_only
@pytest.mark.parametrize("width", [1, 5, 70])
def test_gather_block_table_rows_matches_numpy(width):
    rng = np.random.default_rng(width)
    table = rng.integers(0, 1000, size=(9, width)).astype(np.int32)
    idx = np.array([4, 0, 8, 4, 2], np.int64)
    nb = rng.integers(0, width + 1, size=9).astype(np.int32)
    for padded, num_blocks in [(None, None), (8, None), (7, nb), (5, nb)]:
        want = npb.gather_block_table_rows(table, idx, padded, num_blocks=num_blocks)
        tt, it = _t(table, torch.int32, "cpu"), _t(idx, dev="cpu")
        nbt = None if num_blocks is None else _t(num_blocks, torch.int32, "cpu")
        got = K.gather_block_table_rows(tt, it, padded, nbt)
        assert got.dtype == torch.int32 and np.array_equal(got.numpy(), want)
        assert torch.equal(got, K.gather_block_table_rows_ref(tt, it, padded, nbt))


@cpu_only
def test_gather_block_table_rows_pad_index_out_buffer_and_empty():
    table = _t(np.arange(12).reshape(3, 4) + 1, torch.int32, "cpu")
    out = torch.full((5, 4), 99, dtype=torch.int32)
    got = K.gather_block_table_rows(table, _t([2, -1, 0], dev="cpu"), 4, out=out)
    assert got.tolist() == [[9, 10, 11, 12], [0, 0, 0, 0], [1, 2, 3, 4], [0, 0, 0, 0]]
    assert out[4].tolist() == [99] * 4  # rows past num_reqs_padded untouched
    assert K.gather_block_table_rows(table, _t([], dev="cpu"), 2).tolist() == [[0] * 4] * 2
    with pytest.raises(ValueError, match="num_reqs_padded 1 < 2"):
        K.gather_block_table_rows(table, _t([0, 1], dev="cpu"), 1)


# ------------------------------------------------------------------------------- slot mapping
def _slot_case(rng, num_reqs, block_size, width, max_q=9, dummy=True):
    table = _table(rng, 16, width, 16 * width + 1)
    idx = rng.choice(16, size=num_reqs, replace=False).astype(np.int64)
    if dummy and num_reqs > 2:
        idx[rng.integers(num_reqs)] = -1
    lens = rng.integers(0, max_q + 1, size=num_reqs)
    if num_reqs > 1:
        lens[rng.integers(num_reqs)] = 0  # a zero-length row
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    cap = width * block_size
    pos = np.concatenate([np.arange(s, s + n) for s, n in zip(rng.integers(0, cap - max_q, num_reqs), lens)]
                         + [np.zeros(0)]).astype(np.int64)
    return table, idx, qsl, pos


@cpu_only
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_reqs", [1, 3, 7, 13])
def test_compute_slot_mapping_matches_numpy(block_size, num_reqs):
    rng = np.random.default_rng(block_size * 100 + num_reqs)
    table, idx, qsl, pos = _slot_case(rng, num_reqs, block_size, width=24 // block_size + 2)
    n = int(qsl[-1])
    for padded in (n, n + 5):
        want = npb.compute_slot_mappings(table, block_size, idx, query_start_loc=qsl,
                                         positions=pos, num_tokens_padded=padded)[0]
        args = (_t(table, torch.int32, "cpu"), block_size, _t(idx, dev="cpu"), _t(qsl, dev="cpu"),
                _t(pos, dev="cpu"), padded)
        got = K.compute_slot_mapping(*args)
        assert np.array_equal(got.numpy(), want), (got, want)
        assert torch.equal(K.compute_slot_mapping_ref(*args), got)


@cpu_only
@pytest.mark.parametrize("cp_size,cp_rank,interleave", [(2, 0, 1), (2, 1, 1), (2, 1, 2), (4, 3, 2)])
def test_compute_slot_mapping_dcp_interleave(cp_size, cp_rank, interleave):
    rng = np.random.default_rng(cp_size * 10 + cp_rank + interleave)
    bs = 4
    table, idx, qsl, pos = _slot_case(rng, 5, bs, width=4 * cp_size)
    kw = dict(cp_size=cp_size, cp_rank=cp_rank, cp_interleave=interleave)
    want = npb.compute_slot_mappings(table, bs, idx, query_start_loc=qsl,
                                     positions=pos, num_tokens_padded=int(qsl[-1]) + 2, **kw)[0]
    args = (_t(table, torch.int32, "cpu"), bs, _t(idx, dev="cpu"), _t(qsl, dev="cpu"), _t(pos, dev="cpu"),
            int(qsl[-1]) + 2)
    got = K.compute_slot_mapping(*args, **kw)
    assert np.array_equal(got.numpy(), want)
    assert torch.equal(K.compute_slot_mapping_ref(*args, **kw), got)


@cpu_only
def test_slot_mapping_docstring_example_and_edges():
    t = npb.BlockTable(4, 4)
    t.append(0, [5])
    t.append(1, [7, 3])
    table = _t(t.as_array(), torch.int32, "cpu")
    got = K.compute_slot_mapping(table, 4, _t([1, 0], dev="cpu"), _t([0, 6, 7], dev="cpu"),
                                 _t([0, 1, 2, 3, 4, 5, 2, 0], dev="cpu"), 8)
    assert got.tolist() == [28, 29, 30, 31, 12, 13, 22, -1]
    # no requests at all: every padded token is PAD; nothing padded: empty
    assert K.compute_slot_mapping(table, 4, _t([], dev="cpu"), _t([0], dev="cpu"), _t([], dev="cpu"),
                                  3).tolist() == [-1] * 3
    assert K.compute_slot_mapping(table, 4, _t([1], dev="cpu"), _t([0, 0], dev="cpu"),
                                  _t([], dev="cpu")).numel() == 0


@cpu_only
@pytest.mark.parametrize("pcp", [2, 4])
def test_gathered_slot_mapping_matches_numpy(pcp):
    lay = plan_layout([13, 1, 1, 6], [True, False, False, True], pcp)
    rng = np.random.default_rng(pcp)
    glob = rng.integers(0, 500, size=lay.num_tokens).astype(np.int64)
    want = npb.gathered_slot_mapping(glob, lay)[0]
    args = (_t(glob, dev="cpu"), _t(lay.padded_gather_idx, dev="cpu"), _t(lay.kv_write_mask, torch.bool, "cpu"))
    got = K.gathered_slot_mapping(*args)
    assert np.array_equal(got.numpy(), want)
    assert torch.equal(K.gathered_slot_mapping_ref(*args), got)


# ------------------------------------------------------------------------------- restore
@cpu_only
@pytest.mark.parametrize("pcp,hidden,dtype", [(2, 256, torch.float32), (4, 72, torch.bfloat16)])
def test_restore_hidden_inverts_the_gather(pcp, hidden, dtype):
    lay = plan_layout([13, 1, 1, 6], [True, False, False, True], pcp)
    g = torch.Generator().manual_seed(pcp)
    global_h = torch.randn(lay.num_tokens, hidden, generator=g).to(dtype)  # [T, H]
    gathered = global_h[_t(lay.padded_gather_idx, dev="cpu")]  # [N*P, H]: what the all-gather stacks
    gathered[~_t(lay.is_real_row(), torch.bool, "cpu")] = 0
    idx = _t(lay.hidden_restore_idx, dev="cpu")
    got = K.restore_hidden(gathered, idx)
    assert torch.equal(got, global_h)
    assert torch.equal(got, K.restore_hidden_ref(gathered, idx))
    assert K.restore_hidden(gathered, idx[:0]).shape == (0, hidden)


# ------------------------------------------------------------------------------- GPU (sm_90)
@gpu_only
@pytest.mark.parametrize("precision,heads,block_size,atol", [
    ("tf32x3", 16, 64, 5e-5), ("tf32x3", 4, 16, 5e-5), ("tf32x3", 20, 1, 5e-5), ("ieee", 20, 1, 2e-5),
    ("tf32", 16, 64, 5e-3)])
def test_gpu_paged_mla_attention(precision, heads, block_size, atol):
    rng = np.random.default_rng(heads * block_size)
    rows = [([p], p + 1) for p in (0, 5, 900, 3000, 4095)] + [([], 7)]
    rows += _dual_chunk_rows(1000, 2, 0) + _dual_chunk_rows(600, 2, 1, cached=333)
    case = _attn_case(rng, rows=rows, num_heads=heads, r=512, dr=64, block_size=block_size)
    for splits in (None, 1, 5):
        _check_attention(case, atol=atol, num_splits=splits, input_precision=precision)


@gpu_only
@pytest.mark.parametrize("reload", [True, False])
@pytest.mark.parametrize("precision,dtype,atol", [("tf32x3", torch.float32, 5e-5), ("tf32", torch.float32, 5e-3),
                                                  ("tf32", torch.bfloat16, 2e-2)])
def test_gpu_paged_mla_attention_variants_and_split_ends(reload, precision, dtype, atol):
    """Both RELOAD variants, with splits that end inside a 32-key tile (split length 1008)."""
    rng = np.random.default_rng(4)
    rows = [([p], p + 1) for p in (31, 1500, 32767)] + _dual_chunk_rows(200, 2, 1, cached=40)
    case = _attn_case(rng, rows=rows, num_heads=16, r=512, dr=64, block_size=64, cache_dtype=dtype)
    cfg = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2 if reload else 3, "RELOAD": reload}
    assert K.paged_mla.plan(16, len(rows), 1, 32768, torch.device(DEV), 33)[5] == 1008
    for splits in (None, 33):
        got = K.paged_mla_attention(**case, config=cfg, num_splits=splits, input_precision=precision)
        want = K.paged_mla_attention_ref(**case)
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)


@gpu_only
def test_gpu_paged_mla_attention_bf16():
    rng = np.random.default_rng(2)
    rows = [([p], p + 1) for p in (3, 777, 2048)] + _dual_chunk_rows(300, 2, 1)
    case = _attn_case(rng, rows=rows, num_heads=16, r=512, dr=64, block_size=64, cache_dtype=torch.bfloat16)
    got = K.paged_mla_attention(**case)
    torch.testing.assert_close(got, K.paged_mla_attention_ref(**case), atol=2e-2, rtol=2e-2)


@gpu_only
@pytest.mark.parametrize("dtype,precision,atol", [(torch.bfloat16, "tf32x3", 2e-2), (torch.float32, "tf32x3", 5e-5),
                                                  (torch.float32, "tf32", 5e-3)])
def test_gpu_mla_prefill_attention(dtype, precision, atol):
    """Engine head sizes; DualChunkSwap pairs, chunked prefill with prior context, decode rows."""
    rows = (_dual_chunk_rows(3000, 2, 0) + _dual_chunk_rows(700, 2, 1, cached=900) + [([4000], 4001)]
            + [(list(range(100, 333)), 333)])
    case = _prefill_case(np.random.default_rng(6), rows, num_heads=4, dn=128, dr=64, dv=128, dtype=dtype)
    got = K.mla_prefill_attention(**case, input_precision=precision)
    torch.testing.assert_close(got, K.mla_prefill_attention_ref(**case), atol=atol, rtol=atol)
    assert torch.all(got[-2:] == 0)


@gpu_only
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 5e-5), (torch.bfloat16, 3e-2)])
def test_gpu_engine_kernel_path_matches_torch_path(dtype, atol, monkeypatch):
    args = _engine_case(np.random.default_rng(9), ENGINE_ROWS + [(list(range(2000)), 2000)], dtype)
    got = engine_kv.paged_mla_attention(**args)
    monkeypatch.setenv("PCPVIZ_KERNELS", "0")
    torch.testing.assert_close(got, engine_kv.paged_mla_attention(**args), atol=atol, rtol=atol)


@gpu_only
def test_gpu_small_kernels():
    rng = np.random.default_rng(3)
    for bs in (1, 16, 64):
        table, idx, qsl, pos = _slot_case(rng, 13, bs, width=1400 // bs + 2, max_q=700)
        want = npb.compute_slot_mappings(table, bs, idx, query_start_loc=qsl,
                                         positions=pos, num_tokens_padded=int(qsl[-1]) + 9)[0]
        got = K.compute_slot_mapping(_t(table, torch.int32), bs, _t(idx), _t(qsl), _t(pos), int(qsl[-1]) + 9)
        assert np.array_equal(got.cpu().numpy(), want)
        nb = rng.integers(0, table.shape[1] + 1, size=16).astype(np.int32)
        want = npb.gather_block_table_rows(table, idx[idx >= 0], 16, num_blocks=nb)
        got = K.gather_block_table_rows(_t(table, torch.int32), _t(idx[idx >= 0]), 16, _t(nb, torch.int32))
        assert np.array_equal(got.cpu().numpy(), want)
    lay = plan_layout([1000, 1, 1, 77], [True, False, False, True], 4)
    glob = _t(rng.integers(0, 10**6, size=lay.num_tokens))
    got = K.gathered_slot_mapping(glob, _t(lay.padded_gather_idx), _t(lay.kv_write_mask, torch.bool))
    assert np.array_equal(got.cpu().numpy(), npb.gathered_slot_mapping(glob.cpu().numpy(), lay)[0])
    gathered = torch.randn(lay.padded_gather_idx.size, 7168, device=DEV, dtype=torch.bfloat16)
    idx = _t(lay.hidden_restore_idx)
    assert torch.equal(K.restore_hidden(gathered, idx), gathered.index_select(0, idx))
    cache = torch.zeros(5000, 576, device=DEV)
    slots = _t(np.where(rng.random(3000) < 0.2, -1, rng.permutation(5000)[:3000]))
    lat = torch.randn(3000, 576, device=DEV)
    ref = cache.clone()
    K.write_kv_cache(cache, slots, lat)
    K.write_kv_cache_ref(ref, slots, lat)
    assert torch.equal(cache, ref)


_ENGINE_PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main(argv):\n    parser = "]


def _engine_run(monkeypatch, **env):
    import pcpviz

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    res = pcpviz.run(_ENGINE_PROMPTS, pcp=1, num_speculative_tokens=2, device="cuda", max_new_tokens=24,
                     progress=False)
    return res.output_token_ids, res.num_accepted_tokens_per_pos


@pytest.fixture(scope="module")
def torch_engine_run():
    mp = pytest.MonkeyPatch()
    try:
        yield _engine_run(mp, PCPVIZ_KERNELS="0")
    finally:
        mp.undo()


@gpu_only
def test_gpu_engine_same_tokens_with_and_without_kernels(torch_engine_run, monkeypatch):
    """The engine on one GPU: Triton kernels (default precision) vs PCPVIZ_KERNELS=0, same tokens."""
    monkeypatch.delenv("PCPVIZ_KERNELS_PRECISION", raising=False)
    got = _engine_run(monkeypatch, PCPVIZ_KERNELS="1")
    assert got == torch_engine_run
