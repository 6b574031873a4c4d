"""Conformance of ``pcpviz.reference.dcp`` with the installed vLLM 0.33.0: DCP slot mappings on
every DCP rank (``BlockTables.compute_slot_mappings``, its Triton kernel run under
TRITON_INTERPRET=1), local seq lens (``get_dcp_local_seq_lens`` and the
``_dcp_local_seq_lens_kernel`` behind ``prepare_dcp_local_seq_lens``) and the kernel-block
expansion of the block table (``AttentionGroup.map_to_kernel_block_table``), over 220 held-out
random batches (seeds 38_000.., used nowhere else) with manager block size != kernel block size,
interleave sizes 1..M, DCP sizes 2, 4, 8 and PCP sizes 1, 2, 4 (DCP in {PCP, TP*PCP})."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

from pcpviz.vllm import oracle  # noqa: E402  (after the patches, by design)

from pcpviz.reference.blocks import BlockTable  # noqa: E402
from pcpviz.reference.dcp import (  # noqa: E402
    dcp_local_seq_lens,
    dcp_shard,
    draft_local_lens,
    kernel_block_table,
    local_read_slots,
)

with cpu_patches.cpu_environment():
    import torch  # noqa: E402

    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens  # noqa: E402
    from vllm.v1.worker.gpu.cp_utils import prepare_dcp_local_seq_lens  # noqa: E402
    from vllm.v1.worker.utils import AttentionGroup  # noqa: E402

pytestmark = pytest.mark.slow

NUM_BATCHES = 220
SEED0 = 38_000


def _case(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    pcp = int(rng.choice([1, 2, 4]))
    dcp = int(rng.choice([2, 4, 8] if pcp == 1 else [pcp, 2 * pcp]))
    block = int(rng.choice([8, 16, 32, 64, 128]))
    kernel = int(rng.choice([k for k in (4, 8, 16, 32, 64) if block % k == 0]))
    il = int(rng.choice([i for i in (1, 2, 4, 8, 16, 32, 64, 128) if block % i == 0]))
    r = int(rng.integers(1, 6))
    start = rng.integers(0, 3 * block * dcp, size=r)
    q = rng.integers(0, 3 * block, size=r)
    q[rng.random(r) < 0.3] = 1  # decodes
    width = int(-(-(start + q).max() // (block * dcp))) + 1
    ids = rng.permutation(np.arange(1, r * width + 1))
    rows = [list(map(int, ids[i * width:(i + 1) * width])) for i in range(r)]
    idx = rng.permutation(r)
    if r > 1 and rng.random() < 0.2:
        idx[-1] = -1  # a dummy row
    pos = np.concatenate([np.arange(start[s], start[s] + q[s]) for s in idx.clip(0)] or [np.zeros(0)])
    qsl = np.concatenate([[0], np.cumsum(q[idx.clip(0)])]).astype(np.int64)
    return dict(pcp=pcp, dcp=dcp, block=block, kernel=kernel, il=il, rows=rows, idx=idx, pos=pos.astype(np.int64),
                qsl=qsl, seq_lens=(start + q)[idx.clip(0)], pad=int(rng.integers(0, 5)), width=width)


def _table(rows, width):
    t = BlockTable(len(rows), width)
    for slot, row in enumerate(rows):
        t.append(slot, row)
    return t.as_array()


def _vllm_kernel_table(table: np.ndarray, block: int, kernel: int) -> np.ndarray:
    """vLLM's own map_to_kernel_block_table, called on a stand-in AttentionGroup carrying only
    the fields it reads (building a real group needs a model's attention layers)."""
    per = block // kernel
    rows, cols = table.shape
    stand_in = SimpleNamespace(kernel_block_size=kernel, kv_cache_spec=SimpleNamespace(block_size=block),
                               kernel_block_table=torch.zeros((1, rows, cols * per), dtype=torch.int32),
                               kernel_block_offsets=torch.arange(per, dtype=torch.int32), kernel_block_stride=None)
    out = AttentionGroup.map_to_kernel_block_table(stand_in, torch.from_numpy(table.astype(np.int32)))
    return out.numpy().astype(np.int64)


@pytest.mark.parametrize("chunk", range(4))
def test_dcp_reference_equals_vllm_on_held_out_batches(chunk):
    for seed in range(SEED0 + chunk * NUM_BATCHES // 4, SEED0 + (chunk + 1) * NUM_BATCHES // 4):
        c = _case(seed)
        table = _table(c["rows"], c["width"])
        n = int(c["qsl"][-1]) + c["pad"]
        ours = dcp_shard(table, c["block"], c["idx"], query_start_loc=c["qsl"], positions=c["pos"],
                         dcp_size=c["dcp"], interleave=c["il"], num_tokens_padded=n)
        assert (ours.writes_per_token()[: int(c["qsl"][-1])] <= 1).all(), seed
        lens = dcp_local_seq_lens(c["seq_lens"], dcp_size=c["dcp"], interleave=c["il"])
        for rank in range(c["dcp"]):
            ref = oracle.vllm_compute_slot_mappings(c["rows"], c["block"], c["idx"], query_start_loc=c["qsl"],
                                                    positions=c["pos"], num_tokens=n, cp_size=c["dcp"],
                                                    cp_rank=rank, cp_interleave=c["il"])
            np.testing.assert_array_equal(ours.slots[rank], np.asarray(ref)[0], err_msg=f"seed {seed} rank {rank}")
            sl = torch.from_numpy(c["seq_lens"].astype(np.int32))
            np.testing.assert_array_equal(lens[rank], get_dcp_local_seq_lens(sl, c["dcp"], rank, c["il"]).numpy())
            buf = torch.full((len(sl) + 3,), 7, dtype=torch.int32)
            got = prepare_dcp_local_seq_lens(buf, sl, len(sl), c["dcp"], rank, c["il"], num_reqs_padded=len(sl))
            np.testing.assert_array_equal(lens[rank], got.numpy(), err_msg=f"seed {seed} rank {rank} kernel")
        np.testing.assert_array_equal(kernel_block_table(table, block_size=c["block"], kernel_block_size=c["kernel"]),
                                      _vllm_kernel_table(table, c["block"], c["kernel"]), err_msg=f"seed {seed}")


@pytest.mark.parametrize("seed", range(SEED0 + 500, SEED0 + 520))
def test_what_a_rank_reads_through_kernel_blocks_is_what_it_wrote(seed):
    """A request written from position 0: rank r's slots (vLLM's kernel, manager block size) are
    exactly the slots its attention reads for local tokens 0..local_len-1 through vLLM's
    kernel-block table. Draft decodes' local_len is the seq-len formula at position + 1."""
    c = _case(seed)
    block, kernel, dcp, il = c["block"], c["kernel"], c["dcp"], c["il"]
    length = int(c["seq_lens"].max()) or 1
    row = c["rows"][0]
    kt = _vllm_kernel_table(np.asarray([row]), block, kernel)[0]
    for rank in range(dcp):
        wrote = np.asarray(oracle.vllm_compute_slot_mappings([row], block, [0], query_start_loc=[0, length],
                                                             positions=np.arange(length), num_tokens=length,
                                                             cp_size=dcp, cp_rank=rank, cp_interleave=il))[0]
        local_len = int(get_dcp_local_seq_lens(torch.tensor([length], dtype=torch.int32), dcp, rank, il)[0])
        t = np.arange(local_len)
        reads = kt[t // kernel] * kernel + t % kernel
        np.testing.assert_array_equal(np.sort(wrote[wrote >= 0]), np.sort(reads))
        np.testing.assert_array_equal(local_read_slots(row, local_len, block_size=block, kernel_block_size=kernel),
                                      reads)
    positions = np.asarray([length - 1, length + 2])
    want = np.stack([get_dcp_local_seq_lens(torch.from_numpy(positions + 1).int(), dcp, r, il).numpy()
                     for r in range(dcp)])
    np.testing.assert_array_equal(draft_local_lens(positions, dcp_size=dcp, interleave=il), want)
