"""Issue 25's and issue 36's corrections held: every claim of ``pcpviz.teaching.claims`` is stated where it says and
its wrong version nowhere, every vLLM line it cites holds the cited text in the installed 0.33.0,
and the computation behind each (where there is one) runs vLLM's own code: the padded draft-decode
mapping, the gather's row zeroing, the attention CP check, the drafter's PCP sizes, the draft
prefill's graph modes, the order of reads and writes, the coverage table against data/traces, the
decode-only return of the KV write at DCP > 1."""

from __future__ import annotations

import doctest
from pathlib import Path

import numpy as np
import pytest
import torch

from pcpviz.reference.layout import plan_layout
from pcpviz.teaching import buffer_order, claims, coverage, pcp_rules, vllm_runs
from pcpviz.teaching import examples as teach

ROOT = Path(__file__).resolve().parents[2]


def _vllm_dir() -> Path:
    import vllm

    assert vllm.__version__ == "0.33.0"
    return Path(vllm.__file__).parent


def test_doctests():
    for mod in (claims, buffer_order, coverage, pcp_rules):
        res = doctest.testmod(mod)
        assert res.attempted > 0 and res.failed == 0, f"{mod.__name__}: {res}"


def test_the_rows_are_there():
    # rows 1-10: issue 25's corrections; rows 11-27: issue 36's (MoE, sparse MLA, CUDA graphs)
    assert sorted(claims.load_claims(), key=lambda k: int(k.split()[1])) == [f"row {i}" for i in range(1, 28)]


@pytest.mark.parametrize("key", sorted(claims.load_claims()))
def test_claim_is_stated_and_its_wrong_version_gone(key):
    c = claims.load_claims()[key]
    for rel, phrase in c.says:
        assert claims.normalized(phrase) in claims.normalized(claims.file_text(ROOT, rel)), f"{key}: {rel}: {phrase!r}"
    for rel, phrase in c.not_says:
        assert claims.normalized(phrase) not in claims.normalized(claims.file_text(ROOT, rel)), f"{key}: {rel}"


REFS = sorted({r for c in claims.load_claims().values() for r in c.vllm} |
              {a.ref for seq in buffer_order.ORDERS.values() for a in seq if a.ref} |
              {a.ref for _, f in buffer_order.CANDIDATE_FIXES.values() for a in f.accesses if a.ref}, key=str)


@pytest.mark.parametrize("ref", REFS, ids=str)
def test_cited_vllm_line_holds_the_anchor(ref):
    lines = (_vllm_dir() / ref.path).read_text().splitlines()
    assert ref.anchor in lines[ref.line - 1], f"{ref}: {lines[ref.line - 1].strip()!r}"


# --------------------------------------------------------------------------- row 4 and the findings' fixes


def test_order_of_reads_and_writes():
    assert len(buffer_order.check_order("piecewise_draft_prefill")) == 2  # the PIECEWISE replay reads
    bad = buffer_order.check_order("piecewise_draft_prefill", "write_in_prepare_draft_prefill")
    assert "reads and writes speculator.input_ids" in bad[0] and bad[1].startswith("_prefill: speculator.positions")
    for fix in ("copy_in_run_model", "clear_after_replay", "eager_prefill_under_pcp", "zero_input_block_tables"):
        assert buffer_order.check_order(buffer_order.CANDIDATE_FIXES[fix][0], fix) == [], fix
    assert buffer_order.check_order("dspark_dummy_run", "gather_in_dummy_runs")  # refuted
    with pytest.raises(ValueError, match="unknown fix"):
        buffer_order.check_order("dspark_dummy_run", "copy_in_run_model")


# --------------------------------------------------------------------------- row 5 and gap 8


def test_coverage_matches_the_shipped_traces():
    metas = coverage.vllm_trace_metas(ROOT / "data" / "traces")
    for c in coverage.COVERAGE:
        if c.status == "GPU":
            assert c.traces, c.key
            for name in c.traces:
                assert name in metas and coverage.meta_matches(metas[name], c.meta), (c.key, name)
        elif c.status == "not run" and c.meta:
            hits = [n for n, m in metas.items() if coverage.meta_matches(m, c.meta)]
            assert not hits, f"{c.key} is marked not run, but {hits} match it"
    md = coverage.coverage_markdown()
    assert len(md.splitlines()) == 2 + len(coverage.COVERAGE) and "DSpark on GPUs | not run" in md


# --------------------------------------------------------------------------- row 9, gap 3


def test_padded_draft_decode_mapping_equals_vllms_and_writes_locally():
    from vllm.v1.attention.ops import pcp as vpcp

    from pcpviz.vllm import oracle

    ex = teach.block_example()
    table = ex.table.as_array()
    for padded in (2, 4, 8):
        ours = pcp_rules.draft_decode_mapping(table, 4, ex.idx_mapping, positions=ex.draft_positions,
                                              num_tokens_padded=padded)
        theirs = oracle.vllm_compute_slot_mappings([list(r) for r in table], 4, idx_mapping=ex.idx_mapping,
                                                   query_start_loc=[0, 1, 2], positions=ex.draft_positions,
                                                   num_tokens=padded)
        assert np.asarray(theirs).tolist() == ours.slots.tolist()
        assert (ours.slots[0, 2:] == -1).all() and ours.writes_locally
        # vLLM's own test takes the local branch: no gather, rows kept as they are
        k = torch.arange(padded, dtype=torch.float32)[:, None]
        (kv,), slots = vpcp._gather_prefill_cache_inputs((k,), torch.as_tensor(ours.slots[0]), padded)
        assert kv.shape[0] == padded and slots.tolist() == ours.slots[0].tolist()
    with pytest.raises(ValueError, match="num_tokens_padded"):
        pcp_rules.draft_decode_mapping(table, 4, ex.idx_mapping, positions=ex.draft_positions, num_tokens_padded=1)


def test_decode_only_batch_at_dcp_returns_before_gathering(monkeypatch):
    """Row 17: with replicated decodes (DCP > 1) a batch of decodes only, a dummy one included,
    keeps its rows and never all-gathers, even with the expanded [N*tokens] mapping; sharded
    decodes (DCP = 1) all-gather. vLLM's own function, on a stand-in PCP group that counts."""
    from types import SimpleNamespace

    from vllm.v1.attention.ops import pcp as vpcp

    calls = []
    group = SimpleNamespace(world_size=2, all_gather=lambda t, dim=0: calls.append(t.shape[0]) or torch.cat([t, t]))
    monkeypatch.setattr(vpcp, "get_pcp_group", lambda: group)
    k = torch.arange(3, dtype=torch.float32)[:, None]
    pad = torch.full((6,), -1, dtype=torch.int64)  # the dummy run's expanded all-PAD mapping
    (kv,), slots = vpcp._gather_prefill_cache_inputs((k,), pad, 3, shard_decode_requests=False)
    assert calls == [] and kv.shape[0] == 3 and slots.shape[0] == 3
    (kv,), slots = vpcp._gather_prefill_cache_inputs((k,), pad, 3, shard_decode_requests=True)
    assert calls == [3] and kv.shape[0] == 6 and slots.shape[0] == 6


def test_gather_rows_equal_vllms_kernel():
    from vllm.v1.worker.gpu.block_table import BlockTables

    bt = BlockTables([4], 8, 64, [4], torch.device("cpu"))
    for slot in range(8):
        bt.append_block_ids(slot, ([slot + 1, slot + 11],), overwrite=True)
    bt.apply_staged_writes()
    dirty = 0
    for r, padded in ((5, 5), (2, 2), (1, 4), (3, 3), (0, 0)):
        before = bt.input_block_tables[0].clone()
        bt.input_block_tables[0][r:] = 7  # mark: which rows does the gather leave alone?
        want = pcp_rules.input_block_table_gather(r, padded, dirty_rows=dirty)
        marked = bt.input_block_tables[0].clone()
        bt.gather_block_tables(torch.arange(r, dtype=torch.int64), padded)
        out = bt.input_block_tables[0]
        assert (out[: want.written, 0] == torch.arange(r) + 1).all()
        assert (out[want.written: want.zeroed_until] == 0).all()
        assert torch.equal(out[want.zeroed_until:], marked[want.zeroed_until:])
        bt.input_block_tables[0][want.zeroed_until:] = before[want.zeroed_until:]
        dirty = want.dirty_after


def test_dcp_slots_of_other_ranks_are_pad():
    from pcpviz.vllm import oracle

    # row 8: DCP = 2, block size 4 (virtual block 8): rank 0 stores offsets 0-3... of each virtual block
    rows = [[3, 5]]
    for rank in (0, 1):
        got = np.asarray(oracle.vllm_compute_slot_mappings(rows, 4, idx_mapping=[0], query_start_loc=[0, 4],
                                                           positions=[0, 1, 2, 3], num_tokens=4, cp_size=2,
                                                           cp_rank=rank))[0]
        assert ((got == -1) == (np.arange(4) % 2 != rank)).all(), (rank, got)


def test_indexer_compressed_slice():
    assert pcp_rules.indexer_compressed_slice(8, num_tokens=4, pcp=2, rank=1) == pcp_rules.IndexerSlice(4, 8, 4)
    assert not pcp_rules.indexer_compressed_slice(3, num_tokens=3, pcp=2, rank=0).covers_the_tokens
    assert pcp_rules.indexer_compressed_slice(3, num_tokens=3, pcp=2, rank=0, use_pcp=False).covers_the_tokens
    with pytest.raises(ValueError):
        pcp_rules.indexer_compressed_slice(3, num_tokens=3, pcp=2, rank=2)


# --------------------------------------------------------------------------- rows 2, 3, 10; risk 5


def test_attention_cp_check_exempts_every_draft_layer():
    for spec in ("mtp", "dspark"):
        for dcp in (1, 2):
            assert vllm_runs.attention_cp_check(draft_supports_pcp=False, speculator=spec, draft_dcp=dcp) is None
    assert "does not support PCP" in vllm_runs.attention_cp_check(draft_supports_pcp=False, check_draft=True)
    assert "does not support PCP" in vllm_runs.attention_cp_check(draft_supports_pcp=True, target_supports_pcp=False)


def test_drafter_pcp_sizes_and_the_tp_dcp_rule():
    impl = vllm_runs.drafter_impl_pcp(2)
    assert (impl.config_pcp, impl.impl_pcp_world_size, impl.impl_dcp_world_size) == (1, 2, 1)
    refused = teach.dspark_drafter_config(2, 2, tp=3, draft_use_mla=True)  # DCP < TP, still refused
    assert refused.draft_pcp is None and "tp_size=3 must be divisible by dcp_size=2" in refused.error
    assert teach.dspark_drafter_config(2, 2, tp=2, draft_use_mla=True).error is None


def test_draft_prefill_graph_modes_are_vllms_dispatch():
    one = plan_layout([4], [False], 2)
    assert vllm_runs.draft_prefill_graph_modes(one, "FULL_DECODE_ONLY", k=3) == ["FULL", "NONE"]
    assert vllm_runs.draft_prefill_graph_modes(one, "FULL_AND_PIECEWISE", k=3) == ["FULL", "PIECEWISE"]
    mixed = plan_layout([4, 13], [False, True], 2)
    assert vllm_runs.draft_prefill_graph_modes(mixed, "FULL_AND_PIECEWISE", k=3) == ["PIECEWISE", "PIECEWISE"]
    assert vllm_runs.draft_prefill_graph_modes(mixed, "NONE", k=3) == ["NONE", "NONE"]
    replicated = plan_layout([4], [False], 2, shard_decode_requests=False, dcp_world_size=2)
    assert vllm_runs.draft_prefill_graph_modes(replicated, "FULL_DECODE_ONLY", k=3) == ["FULL", "FULL"]


def test_the_claims_live_in_docs_and_a_damaged_file_is_one_line(tmp_path):
    assert claims.CLAIMS_FILE == ROOT / "docs" / "review" / "claims.json"
    bad = tmp_path / "claims.json"
    bad.write_text('{"claims": {"row 1": {"claim": "x", "says": [["a"]], "not_says": [], "vllm": []}}}')
    with pytest.raises(ValueError, match=r"^\S+claims.json: claims.row 1.says: expected a list of \[file, phrase"):
        claims.load_claims(bad)


# --------------------------------------------------------------------------- row 27: the indexer fold
def test_row_27_the_fold_folds_exactly_the_expanded_calls():
    """Every call kind, N 1-8, sizes 1-256: expanded calls (N*P vs P) fold, unexpanded ones (T vs T)
    do not; a FULL draft prefill's captured shape is unexpanded (vLLM's own shapes and fold:
    tests/vllm/test_indexer_fold_vllm.py)."""
    from pcpviz.reference.indexer_fold import CALL_KINDS, indexer_call, search

    result = search(indexer_call(kind, n, t) for kind in CALL_KINDS for n in range(1, 9) for t in range(1, 257))
    assert result.wrong == () and result.num_calls == len(CALL_KINDS) * 8 * 256
    assert indexer_call("draft_prefill", 2, 6).folds and not indexer_call("draft_prefill_full_replay", 2, 6).folds
