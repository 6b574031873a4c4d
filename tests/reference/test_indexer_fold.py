"""Unit tests of pcpviz.reference.indexer_fold, and the inequality behind the fold, searched over
every shape (vLLM's own code is run against it in tests/vllm/test_indexer_fold_vllm.py)."""

import itertools

import pytest

from pcpviz.reference.indexer_fold import (
    CALL_KINDS,
    EXPANDED_KINDS,
    IndexerCall,
    fold_num_tokens,
    folds,
    indexer_call,
    search,
    step_calls,
    target_padded_tokens,
)


def test_module_docstring_example():
    calls = step_calls(2, [13, 1, 4], [True, False, False], k=3, shard_decode_requests=True)
    assert [(c.kind, c.slot_mapping_rows, c.k_rows, c.folds, c.right) for c in calls] == [
        ("target", 24, 12, True, True), ("draft_prefill", 24, 12, True, True),
        ("draft_decode", 3, 3, False, True), ("draft_decode", 3, 3, False, True)]


def test_the_fold_is_vllms_test():
    assert folds(24, 12, 2) and not folds(12, 12, 2) and not folds(24, 12, 1)
    assert fold_num_tokens(24, 12, 2) == 12
    assert fold_num_tokens(25, 12, 2) == 12  # integer division, then min with k's rows
    assert fold_num_tokens(3, 3, 4) == 3


def test_graph_padding_sets_p_and_the_mapping():
    # a PIECEWISE graph of 16 tokens: P = 16 on every rank, the gathered mapping N*16
    assert target_padded_tokens([13, 1, 4], [True, False, False], 2, graph_num_tokens=16,
                                shard_decode_requests=True) == 16
    calls = step_calls(4, [13, 1, 4], [True, False, False], k=2, graph_num_tokens=16, shard_decode_requests=True,
                       draft_decode_num_tokens=4)
    assert [(c.slot_mapping_rows, c.k_rows, c.kept_rows) for c in calls] == [(64, 16, 16), (64, 16, 16), (4, 4, 4)]
    assert all(c.right for c in calls)


def test_full_draft_prefill_replay_is_its_captures_unexpanded_shape():
    calls = step_calls(2, [3, 3], [False, False], k=2, graph_num_tokens=6, draft_prefill_full=True,
                       draft_prefill_num_tokens=6, shard_decode_requests=False, dcp_world_size=2)
    assert calls[1].kind == "draft_prefill_full_replay"
    assert (calls[1].slot_mapping_rows, calls[1].k_rows, calls[1].folds, calls[1].right) == (6, 6, False, True)


def test_k1_and_skipped_drafts_have_no_draft_decode():
    assert [c.kind for c in step_calls(2, [2, 2], [False, False], k=1)] == ["target", "draft_prefill"]
    assert len(step_calls(2, [3, 3], [False, False], k=3, num_speculative_tokens=1)) == 2


def test_a_draft_prefill_on_more_rows_than_p_is_undetermined():
    """T' > P: whether the forward reaches the indexer is not determined; it is judged as if it did:
    right while N*P > T' (the fold still keeps P rows), wrong from T' >= N*P on."""
    short = indexer_call("draft_prefill", 2, 3, draft_num_tokens=4)
    assert short.reached is None and short.right and short.kept_rows == 3
    long = indexer_call("draft_prefill", 2, 2, draft_num_tokens=8)
    assert long.reached is None and not long.folds and not long.right
    result = search([short, long, indexer_call("target", 2, 2)])
    assert result.wrong == () and result.undetermined == (short, long) and result.wrong_if_reached == (long,)
    with pytest.raises(ValueError, match="never pads below"):
        indexer_call("draft_prefill", 2, 4, draft_num_tokens=3)
    with pytest.raises(ValueError, match="unknown indexer call kind"):
        indexer_call("mixed", 2, 4)


def test_the_inequality_over_every_shape():
    """Expanded calls hand (N*P, P), unexpanded ones (T, T): for every N 1..8 and every size up to
    a 8192-token budget, the fold is right, so no graph size, DP padding or batch can break it."""
    result = search(indexer_call(kind, n, t) for kind, n, t in
                    itertools.product(CALL_KINDS, range(1, 9), range(1, 8193)))
    assert result.num_calls == len(CALL_KINDS) * 8 * 8192
    assert result.wrong == () and result.undetermined == ()


def test_the_search_would_catch_a_broken_identity():
    """Were k padded to N*P rows on an expanded call, or a mapping longer than k handed to an
    unexpanded one, the heuristic would be wrong; the search reports such calls."""
    padded_k = IndexerCall("target", 2, 12, 12)  # expanded [2*6] mapping, k padded to 12 rows
    long_map = IndexerCall("draft_decode", 2, 8, 4)  # unexpanded mapping longer than k
    result = search([padded_k, long_map, indexer_call("target", 2, 6)])
    assert result.wrong == (padded_k, long_map)
    assert not padded_k.folds and long_map.folds
    assert "target" in EXPANDED_KINDS and "draft_decode" not in EXPANDED_KINDS
