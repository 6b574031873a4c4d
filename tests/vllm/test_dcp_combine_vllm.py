"""``pcpviz.reference.dcp_combine`` against vLLM 0.33.0's own DCP combine on CPU: the Triton kernel
``CorrectAttnCPOutKernel.kernel`` (run under TRITON_INTERPRET=1; its launcher reads a compiled
kernel's ``constexprs`` and cannot run interpreted, so the test launches the kernel itself with the
grid and strides the launcher passes, ``vllm/v1/attention/ops/dcp.py`` 328-360), the pure-torch
``_lse_weighted_combine`` and ``mask_dcp_empty_shards_``; and against full attention over the
unsharded keys (the reduce-scatter and all-gather are sums and slices, done here in the test)."""

from __future__ import annotations

import numpy as np
import pytest

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

from pcpviz.reference.dcp import dcp_local_seq_lens, dcp_owner  # noqa: E402
from pcpviz.reference.dcp_combine import (  # noqa: E402
    ag_rs_combine,
    correct_rank_output,
    lse_combine,
    mask_empty_shards,
    partial_attention,
)

with cpu_patches.cpu_environment():
    import torch  # noqa: E402

    from vllm.v1.attention.ops.dcp import (  # noqa: E402
        CorrectAttnCPOutKernel,
        _lse_weighted_combine,
        mask_dcp_empty_shards_,
    )

pytestmark = pytest.mark.slow


def _vllm_correct(out: np.ndarray, lses: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    o = torch.from_numpy(out.astype(np.float32)).contiguous()
    ls = torch.from_numpy(lses.astype(np.float32)).contiguous()
    b, h, d = o.shape
    new = torch.empty_like(o)
    vlse = torch.empty((b, h), dtype=torch.float32)
    CorrectAttnCPOutKernel.kernel[(b, h, 1)](o, new, ls, vlse, *o.stride(), *ls.stride(), rank,
                                             HEAD_DIM=d, N_ROUNDED=ls.shape[0], IS_BASE_E=True)
    return new.numpy(), vlse.numpy()


def _sharded_case(seed: int):
    rng = np.random.default_rng(seed)
    d = int(rng.choice([2, 4]))
    h, dk, dv, il = 4, 8, 8, int(rng.choice([1, 2, 4]))
    lens = rng.integers(1, 40, size=3)
    lens[rng.random(3) < 0.3] = 1  # a rank with local_len 0
    q = rng.standard_normal((3, h, dk))
    ks = [rng.standard_normal((n, h, dk)) for n in lens]
    vs = [rng.standard_normal((n, h, dv)) for n in lens]
    return d, il, lens, q, ks, vs


@pytest.mark.parametrize("seed", range(38_700, 38_712))
def test_combine_equals_vllm_kernel_and_full_attention(seed):
    d, il, lens, q, ks, vs = _sharded_case(seed)
    scale = 0.3
    outs, lses = np.zeros((d, 3, 4, 8)), np.zeros((d, 3, 4))
    for b, n in enumerate(lens):
        own = dcp_owner(np.arange(n), block_size=il * 4, dcp_size=d, interleave=il)
        for r in range(d):
            o, lse = partial_attention(q[b:b + 1], ks[b][own == r][None], vs[b][own == r][None], scale=scale)
            outs[r, b], lses[r, b] = o[0], lse[0]
    local = dcp_local_seq_lens(lens, dcp_size=d, interleave=il)
    for r in range(d):
        lses[r] = mask_empty_shards(lses[r], local[r], np.arange(4))
        got = torch.from_numpy(lses[r].astype(np.float32))
        mask_dcp_empty_shards_(got, torch.from_numpy(local[r]), torch.arange(4, dtype=torch.int32))
        np.testing.assert_array_equal(np.isinf(got.numpy()), np.isinf(lses[r]))
    scaled = [_vllm_correct(outs[r], lses, r) for r in range(d)]
    for r in range(d):
        ours, total = correct_rank_output(outs[r], lses, r)
        np.testing.assert_allclose(ours, scaled[r][0], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(total, scaled[r][1], rtol=2e-5, atol=2e-6)
    vllm_sum = np.sum([s[0] for s in scaled], axis=0)  # the reduce of the reduce-scatter
    combined, _ = lse_combine(outs, lses)
    np.testing.assert_allclose(combined, vllm_sum, rtol=2e-5, atol=2e-6)
    ref = _lse_weighted_combine(torch.from_numpy(outs), torch.from_numpy(lses)).numpy()
    np.testing.assert_allclose(combined, ref, rtol=1e-10, atol=1e-12)
    for b, n in enumerate(lens):
        full, _ = partial_attention(q[b:b + 1], ks[b][None], vs[b][None], scale=scale)
        np.testing.assert_allclose(combined[b], full[0], rtol=1e-9, atol=1e-12)
    slices = ag_rs_combine(outs, lses)
    np.testing.assert_allclose(np.concatenate(slices, axis=1), combined)
    assert all(s.shape == (3, 4 // d, 8) for s in slices)


def test_heads_that_do_not_split_over_the_group_are_refused():
    with pytest.raises(ValueError, match="3 heads cannot be reduce-scattered over 2"):
        ag_rs_combine(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3)))
