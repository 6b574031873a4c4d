"""The vLLM oracle really runs vLLM 0.33.0 on CPU, and reproduces the worked
example of docs/vllm-0.33-pcp-mtp.md#worked-example-scenario-a (PCP=2, K=3,
block_size=4, sharded decodes) from vLLM's own PCPManager / BlockTables.

Nothing here is skipped: a missing or wrong vLLM fails loudly.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pcpviz.vllm import cpu_patches
from pcpviz.vllm.fake_group import FakePCPGroup, run_ranks

cpu_patches.apply_cpu_patches()

import torch  # noqa: E402

from pcpviz.vllm import oracle  # noqa: E402

# --- Scenario A: the global batch of docs/vllm-0.33-pcp-mtp.md#worked-example-scenario-a -----------
#
#   row  kind                       query  positions (GPU cursor)      global tokens  req-state slot
#   d0   decode + 3 drafts          4      20..23 (CPU cursor 21)      0:4            7
#   d1   decode                     4      11..14                      4:8            6
#   p1   continued chunked prefill  10     12..21                      8:18           5
#   p0   fresh prefill              13     0..12                       18:31          4

SCENARIO_A = dict(
    req_ids=["d0", "d1", "p1", "p0"],
    idx_mapping=[7, 6, 5, 4],
    num_scheduled_tokens=[4, 4, 10, 13],
    num_computed_tokens=[21, 11, 12, 0],  # d0's CPU cursor runs one ahead after a rejection
    positions=[*range(20, 24), *range(11, 15), *range(12, 22), *range(0, 13)],
    input_ids=[*range(41, 45), *range(50, 54), *range(60, 70), *range(80, 93)],
    prefill_len=[8, 6, 40, 13],
    is_prefilling=[False, False, True, True],
    pcp_world_size=2,
    shard_decode_requests=True,
)

# Block-id rows per request-state slot (block_size=4) that give the worked example's slots:
# d0 pos 20..23 -> 24..27 and 24 -> 28; d1 11..14 -> 47..50; p1 12..21 -> 72..81; p0 0..12 -> 92..104.
BLOCK_ROWS = [[], [], [], [], [23, 24, 25, 26], [15, 16, 17, 18, 19, 20], [9, 10, 11, 12], [1, 2, 3, 4, 5, 6, 7]]

NOTE_HIDDEN_RESTORE_IDX = [0, 1, 2, 3, 18, 19, 20, 21, 4, 5, 6, *range(22, 28), 7, 8, 9, 10, 11, *range(28, 36), 12]
NOTE_PADDED_GATHER_IDX = [0, 1, 2, 3, 8, 9, 10, 17, 18, 19, 20, 21, 30, 0, 0, 0, 0, 0,
                          4, 5, 6, 7, *range(11, 17), *range(22, 30)]
NOTE_GATHERED_SLOTS = [*range(24, 28), 72, 73, 74, 81, *range(92, 96), 104, *[-1] * 5,
                       *range(47, 51), *range(75, 81), *range(96, 104)]


def _layout(**kw):
    a = SCENARIO_A
    return oracle.vllm_build_batch_layout(a["num_scheduled_tokens"], a["is_prefilling"], a["pcp_world_size"],
                                          shard_decode_requests=kw.pop("shard", True), **kw)


# --- the patches ----------------------------------------------------------------------------------


def test_patches_applied_to_the_real_vllm_0_33_0():
    import vllm
    import vllm.utils.torch_utils as torch_utils
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    import vllm.v1.worker.gpu.pcp_manager as pcp_manager
    from triton.runtime.interpreter import InterpretedFunction
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.worker.cpu.buffer_utils import UvaBuffer as CpuUvaBuffer
    from vllm.v1.worker.gpu.block_table import _compute_slot_mappings_kernel

    assert vllm.__version__ == "0.33.0"
    assert pcp_manager.PCPManager.__module__ == "vllm.v1.worker.gpu.pcp_manager"
    assert HAS_TRITON and isinstance(_compute_slot_mappings_kernel, InterpretedFunction)
    assert torch_utils.PIN_MEMORY is False
    import vllm.v1.attention.backends.utils as backend_utils  # copied PIN_MEMORY by value

    assert backend_utils.PIN_MEMORY is False
    assert buffer_utils.UvaBuffer is CpuUvaBuffer
    cpu_patches.apply_cpu_patches()  # idempotent
    assert cpu_patches.patches_applied()


def test_version_guard_names_the_installed_version(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.1")
    with pytest.raises(RuntimeError, match=r"drives vLLM 0\.33\.0 only; the installed vllm is 0\.34\.1"):
        cpu_patches._check_version()


# --- Scenario A, layout ------------------------------------------------------------------------------


def test_scenario_a_layout_matches_the_note():
    lay = _layout()
    assert lay["per_rank_num_tokens"] == [13, 18]
    assert lay["padded_gather_idx"].tolist() == NOTE_PADDED_GATHER_IDX
    assert lay["hidden_restore_idx"].tolist() == NOTE_HIDDEN_RESTORE_IDX
    # Sharded decodes have one owner: every real row writes its KV, padding does not.
    assert lay["kv_write_mask"].tolist() == [True] * 13 + [False] * 5 + [True] * 18
    assert lay["segments_by_rank"][0] == [(0, 0, 4, 0, 4), (2, 8, 11, 4, 7), (2, 17, 18, 7, 8),
                                          (3, 18, 22, 8, 12), (3, 30, 31, 12, 13)]


def test_scenario_b_replicated_decodes_rank0_is_the_kv_writer():
    lay = _layout(shard=False)
    assert lay["per_rank_num_tokens"] == [17, 22]
    mask = lay["kv_write_mask"].reshape(2, 22)
    assert mask[0, :17].all() and not mask[0, 17:].any()
    assert not mask[1, :8].any() and mask[1, 8:].all()  # rank 1's copies of d0, d1 are not written
    assert mask.sum() == 31


# --- Scenario A, rank-local batch ----------------------------------------------------------------------


def test_scenario_a_rank_local_batches_match_the_note():
    r0, r1 = oracle.vllm_partition_batch(**SCENARIO_A)
    assert r0["req_ids"] == ["d0", "p1", "p1", "p0", "p0"]
    assert r0["idx_mapping"].tolist() == [7, 5, 5, 4, 4]
    assert r0["num_scheduled_tokens"].tolist() == [4, 3, 1, 4, 1]
    assert (r0["num_tokens"], r0["num_tokens_after_padding"]) == (13, 18)
    assert r0["local_gather_idx"].tolist() == NOTE_PADDED_GATHER_IDX[:18]
    assert r0["positions"].tolist() == [20, 21, 22, 23, 12, 13, 14, 21, 0, 1, 2, 3, 12, 0, 0, 0, 0, 0]
    assert r0["seq_lens"].tolist() == [24, 15, 22, 4, 13]
    assert r0["seq_lens_cpu_upper_bound"].tolist() == [25, 15, 22, 4, 13]
    assert r0["logits_indices"].tolist() == [3, 6, 7, 11, 12]
    assert r0["is_prefilling"].tolist() == [False, True, True, True, True]
    assert r0["is_padding"].tolist() == [False] * 13 + [True] * 5
    assert r0["input_ids"].tolist() == [41, 42, 43, 44, 60, 61, 62, 69, 80, 81, 82, 83, 92, 0, 0, 0, 0, 0]
    assert r0["query_start_loc"].tolist() == [0, 4, 7, 8, 12, 13]

    assert r1["req_ids"] == ["d1", "p1", "p1", "p0", "p0"]
    assert r1["positions"].tolist() == [*range(11, 15), *range(15, 21), *range(4, 12)]
    assert r1["seq_lens"].tolist() == [15, 18, 21, 8, 12]
    assert (r1["num_tokens"], r1["num_tokens_after_padding"]) == (18, 18)


def test_piecewise_graph_pads_each_rank_to_the_graph_size():
    r0, r1 = oracle.vllm_partition_batch(**SCENARIO_A, padded_num_tokens=24)
    assert r0["num_tokens_after_padding"] == r1["num_tokens_after_padding"] == 24
    assert r1["is_padding"].tolist() == [False] * 18 + [True] * 6
    assert r1["local_gather_idx"][18:].tolist() == [0] * 6


def test_moe_gathers_tokens_makes_is_padding_the_gathered_mask():
    r0, _ = oracle.vllm_partition_batch(**SCENARIO_A, moe_gathers_tokens=True)
    assert r0["is_padding"].tolist() == [False] * 13 + [True] * 5 + [False] * 18  # bool[N*P], rank-major


def test_rank_without_tokens_gets_a_zero_token_placeholder_row():
    # A 1-token prefill with PCP=2: rank 1 owns nothing, vLLM gives it request 0 with 0 tokens.
    _, r1 = oracle.vllm_partition_batch(
        req_ids=["p"], idx_mapping=[3], num_scheduled_tokens=[1], num_computed_tokens=[0], positions=[0],
        input_ids=[9], prefill_len=[1], is_prefilling=[True], pcp_world_size=2, shard_decode_requests=True)
    assert r1["req_ids"] == ["p"] and r1["num_scheduled_tokens"].tolist() == [0]
    assert r1["num_tokens"] == 0 and r1["num_tokens_after_padding"] == 1 and r1["num_reqs_after_padding"] == 1
    assert r1["logits_indices"].tolist() == [-1] and r1["seq_lens"].tolist() == [0]
    assert r1["is_prefilling"].tolist() == [True] and r1["is_padding"].tolist() == [True]
    # No tokens at all, under a graph of size 2: both ranks are placeholder + padding.
    for r in oracle.vllm_partition_batch(
            req_ids=["a", "b"], idx_mapping=[0, 1], num_scheduled_tokens=[0, 0], num_computed_tokens=[5, 7],
            positions=[], input_ids=[], prefill_len=[9, 3], is_prefilling=[True, False], pcp_world_size=2,
            shard_decode_requests=True, padded_num_tokens=2):
        assert r["req_ids"] == ["a"] and r["num_tokens"] == 0 and r["is_padding"].tolist() == [True, True]
        assert r["num_computed_tokens"].tolist() == [5] and r["positions"].tolist() == [0, 0]


# --- vLLM's own errors propagate -------------------------------------------------------------------------


def test_vllm_errors_propagate_unchanged():
    with pytest.raises(ValueError,
                       match=r"PCP padded token count is smaller than the largest rank-local batch: 17 < 18\."):
        _layout(padded_num_tokens=17)
    with pytest.raises(RuntimeError, match=r"PCP FULL graphs require a decode-only batch\."):
        oracle.vllm_partition_batch(**SCENARIO_A, padded_num_tokens=18, padded_num_reqs=8)
    with pytest.raises(IndexError):  # vLLM's placeholder row assumes at least one request
        oracle.vllm_partition_batch(req_ids=[], idx_mapping=[], num_scheduled_tokens=[], num_computed_tokens=[],
                                    positions=[], input_ids=[], prefill_len=[], is_prefilling=[],
                                    pcp_world_size=2, shard_decode_requests=True)


def test_validate_config_messages():
    assert oracle.vllm_validate_config(pcp_size=2, speculative_method="mtp") is None
    assert oracle.vllm_validate_config(pcp_size=2, cudagraph_mode="FULL_DECODE_ONLY") is None
    assert oracle.vllm_validate_config(pcp_size=2, use_mla=False) == "MRV2 PCP currently supports MLA models only."
    assert oracle.vllm_validate_config(pcp_size=2, speculative_method="mtp", multi_module_mtp=True) == (
        "MRV2 PCP only supports DSpark or single-module MTP speculative decoding.")
    assert oracle.vllm_validate_config(pcp_size=2, cudagraph_mode="FULL") == (
        "MRV2 PCP supports full CUDA graphs for decode-only routines. "
        "Use FULL_DECODE_ONLY, FULL_AND_PIECEWISE, PIECEWISE, or NONE.")
    assert oracle.vllm_validate_config(pcp_size=2, dcp_size=3, sparse_mla=True, speculative_method="dspark") == (
        "MRV2 PCP DSpark requires DCP=1 or DCP=PCP; got DCP=3, PCP=2.")


# --- Scenario A, block tables and slot mappings ------------------------------------------------------------


def test_scenario_a_gathered_slot_mapping_matches_the_note():
    for rank in (0, 1):
        slots = oracle.vllm_prepare_slot_mappings(BLOCK_ROWS, 4, rank=rank, **SCENARIO_A)
        assert slots.shape == (1, 36) and slots.dtype == np.int64
        assert slots[0].tolist() == NOTE_GATHERED_SLOTS
    attn = oracle.vllm_prepare_attn(BLOCK_ROWS, 4, rank=0, **SCENARIO_A)
    assert attn["global_slot_mappings"][0].tolist() == [*range(24, 28), *range(47, 51), *range(72, 82), *range(92, 105)]
    # Local block tables: each local segment gets its request's full row.
    assert attn["block_tables"][:, :4].tolist() == [[1, 2, 3, 4], [15, 16, 17, 18], [15, 16, 17, 18],
                                                    [23, 24, 25, 26], [23, 24, 25, 26]]


def test_scenario_a_replicated_draft_steps_use_global_rows_and_unexpanded_slots():
    idx = [7, 6, 5, 4]  # global order d0, d1, p1, p0
    rows = oracle.vllm_gather_block_tables(BLOCK_ROWS, 4, idx, num_reqs_padded=6)
    assert rows.dtype == np.int32 and rows.shape == (6, 7)
    assert [r[r > 0].tolist() for r in rows] == [BLOCK_ROWS[i] for i in idx] + [[], []]
    qsl = [0, 1, 2, 3, 4]
    step1 = oracle.vllm_compute_slot_mappings(BLOCK_ROWS, 4, idx, query_start_loc=qsl, positions=[24, 13, 22, 13],
                                              num_tokens=4)
    step2 = oracle.vllm_compute_slot_mappings(BLOCK_ROWS, 4, idx, query_start_loc=qsl, positions=[25, 14, 23, 14],
                                              num_tokens=6)
    assert step1.tolist() == [[28, 49, 82, 105]]
    assert step2.tolist() == [[29, 50, 83, 106, -1, -1]]  # padded tail is PAD


def test_context_parallel_slot_mapping_runs_under_the_interpreter():
    # CP_SIZE > 1 takes the kernel branch the int1-mask patch exists for.
    out = oracle.vllm_compute_slot_mappings([[1, 2], [3], []], 4, [0, 1], query_start_loc=[0, 3, 4],
                                            positions=[5, 6, 7, 2], num_tokens=6, cp_size=2, cp_rank=1)
    assert out.tolist() == [[6, -1, 7, -1, -1, -1]]


# --- ranks as threads: the fake PCP group -------------------------------------------------------------------


def test_restore_for_sampling_across_rank_threads():
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    batch = oracle._input_batch(*(SCENARIO_A[k] for k in ("req_ids", "idx_mapping", "num_scheduled_tokens",
                                                          "num_computed_tokens", "positions", "input_ids",
                                                          "prefill_len", "is_prefilling")))
    desc = oracle._batch_desc(None, None)
    hidden = torch.arange(31 * 3, dtype=torch.float32).view(31, 3)  # global hidden states, one row per token
    group = FakePCPGroup(2)

    def rank_fn(rank):
        manager = PCPManager(2, rank, oracle.CPU, True, max_num_reqs=4, max_num_tokens=31)
        manager.partition_batch(batch, desc)
        local = hidden[manager._local_gather_idx].clone()  # what this rank's model would output
        local[13 if rank == 0 else 18:] = -1.0  # padding rows are garbage
        restored, aux, global_batch = manager.restore_for_sampling(local, [local * 2])
        return restored, aux[0], global_batch

    outs = run_ranks(group, rank_fn)
    for restored, aux, global_batch in outs:
        assert torch.equal(restored, hidden) and torch.equal(aux, hidden * 2)
        assert global_batch is batch
    assert group.all_gather_calls == [2, 2]


def test_pcp_attention_gather_uses_the_thread_group():
    from vllm.v1.attention.ops.pcp import maybe_gather_mla_latent_cache_inputs

    group = FakePCPGroup(2)
    slots = torch.arange(8)  # gathered [N*P] slot mapping, P = 4

    def rank_fn(rank):
        kv = torch.full((4, 2), float(rank))
        k_pe = torch.full((4, 1, 1), float(rank))
        return maybe_gather_mla_latent_cache_inputs(kv, k_pe, slots, 1, True, pcp_shard_decode_requests=True)

    for kv, k_pe, slot_mapping in run_ranks(group, rank_fn):
        assert kv[:, 0].tolist() == [0.0] * 4 + [1.0] * 4 and k_pe.shape == (8, 1, 1)
        assert torch.equal(slot_mapping, slots)


def test_fake_group_rejects_unequal_shapes_without_hanging():
    group = FakePCPGroup(2, timeout=10)
    with pytest.raises(AssertionError, match="unequal shapes"):
        run_ranks(group, lambda rank: group.all_gather(torch.zeros(rank + 1, 2)))


def test_a_failing_rank_releases_the_others():
    group = FakePCPGroup(2, timeout=10)

    def rank_fn(rank):
        if rank == 1:
            raise KeyError("rank 1 failed")
        return group.all_gather(torch.zeros(1))

    with pytest.raises(KeyError, match="rank 1 failed"):
        run_ranks(group, rank_fn)


def test_get_pcp_group_hook_is_inert_on_unbound_threads():
    import vllm.v1.worker.gpu.pcp_manager as pcp_manager

    seen = {}

    def probe():
        try:
            pcp_manager.get_pcp_group()
        except AssertionError as exc:  # vLLM's own "not initialized" assertion
            seen["error"] = exc

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert "error" in seen
    group = FakePCPGroup(1)
    with group.bind(0):
        assert pcp_manager.get_pcp_group() is group and group.rank_in_group == 0


@pytest.mark.slow
def test_importing_vllm_before_the_patches_is_a_clear_error():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    code = ("import vllm.v1.worker.gpu.block_table\n"
            "from pcpviz.vllm import cpu_patches\n"
            "cpu_patches.apply_cpu_patches()\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode != 0
    assert "RuntimeError: vllm.triton_utils was imported before" in proc.stderr
    assert "HAS_TRITON=False" in proc.stderr


def test_fake_group_doctests():
    import doctest

    from pcpviz.vllm import fake_group

    res = doctest.testmod(fake_group)
    assert res.attempted > 0 and res.failed == 0, res
