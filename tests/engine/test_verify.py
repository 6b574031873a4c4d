"""Greedy verification (``pcpviz.engine.verify``) against a row-by-row reference.

The engine verifies every row at once with array operations; the reference below walks the
rows one at a time, as the docstring of the module states the rule. Random batches mix
decodes with 0..K drafts (partly matching targets), prefills that complete their prompt and
partial prefill chunks, at K = 0..4, with and without the rank-divergent fault.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcpviz.reference.batch import GlobalBatch
from pcpviz.engine.verify import greedy_verify
from pcpviz.engine.worker import RequestState


def reference(batch, num_draft, targets, *, states, k, accept_one_less=False):
    r = batch.num_reqs
    sampled_ids = np.full((r, k + 1), -1, dtype=np.int64)
    num_sampled = np.zeros(r, dtype=np.int32)
    num_rejected = np.zeros(r, dtype=np.int32)
    num_accepted = np.zeros(r, dtype=np.int32)
    per_pos = np.zeros(max(k, 0), dtype=np.int64)
    sampled, cursor = [], 0
    qsl = batch.query_start_loc
    for i, req_id in enumerate(batch.req_ids):
        d = int(num_draft[i])
        rows = targets[cursor: cursor + d + 1]
        cursor += d + 1
        st = states[req_id]
        if batch.is_prefilling[i] and st.num_computed + int(batch.num_scheduled_tokens[i]) < st.prompt_len:
            sampled.append([])
            continue
        drafts = batch.input_ids[qsl[i + 1] - d: qsl[i + 1]]
        a = 0
        while a < d and int(drafts[a]) == int(rows[a]):
            a += 1
        if accept_one_less and a > 0:
            a -= 1
        out = [int(x) for x in rows[: a + 1]]
        sampled.append(out)
        sampled_ids[i, : a + 1] = out
        num_sampled[i], num_rejected[i], num_accepted[i] = a + 1, d - a, a
        per_pos[:a] += 1
    return sampled, sampled_ids, num_sampled, num_rejected, num_accepted, per_pos


def random_step(rng, k):
    rows, states, ids, targets, num_draft, q, pref = [], {}, [], [], [], [], []
    for i in range(int(rng.integers(1, 9))):
        rid = f"req{i}"
        kind = rng.choice(["decode", "prefill_done", "prefill_partial"])
        plen = int(rng.integers(4, 40))
        if kind == "decode":
            d = int(rng.integers(0, k + 1))
            drafts = rng.integers(0, 6, d)
            t = rng.integers(0, 6, d + 1)
            match = int(rng.integers(0, d + 1))
            t[:match] = drafts[:match]  # the first `match` drafts agree, maybe more by chance
            ids += [int(rng.integers(0, 6))] + drafts.tolist()
            states[rid] = RequestState(slot=i, prompt=np.zeros(plen, np.int64), num_computed=plen + 3)
            q.append(d + 1), pref.append(False), num_draft.append(d), targets.extend(t.tolist())
        else:
            chunk = int(rng.integers(1, plen))
            done = kind == "prefill_done"
            start = plen - chunk if done else int(rng.integers(0, plen - chunk))
            ids += rng.integers(0, 6, chunk).tolist()
            states[rid] = RequestState(slot=i, prompt=np.zeros(plen, np.int64), num_computed=start)
            q.append(chunk), pref.append(True), num_draft.append(0), targets.append(int(rng.integers(0, 6)))
        rows.append(rid)
    q = np.array(q, np.int64)
    batch = GlobalBatch(tuple(rows), np.arange(len(rows)), q, np.zeros(len(rows), np.int64),
                        np.zeros(int(q.sum()), np.int64), np.array(ids, np.int64),
                        np.array([states[r].prompt_len for r in rows], np.int64), np.array(pref))
    return batch, np.array(num_draft, np.int64), np.array(targets, np.int64), states


@pytest.mark.parametrize("k", [0, 1, 2, 4])
@pytest.mark.parametrize("fault", [False, True])
def test_greedy_verify_equals_the_row_by_row_rule(k, fault):
    rng = np.random.default_rng(100 * k + fault)
    for _ in range(200):
        batch, nd, targets, states = random_step(rng, k)
        got = greedy_verify(batch, nd, targets, states=states, k=k, accept_one_less=fault)
        want = reference(batch, nd, targets, states=states, k=k, accept_one_less=fault)
        assert got.sampled == want[0]
        for a, b in zip((got.sampled_token_ids, got.num_sampled, got.num_rejected, got.num_accepted,
                         got.accepted_per_pos), want[1:]):
            assert a.dtype == b.dtype and a.tolist() == b.tolist()


def test_docstring_example_and_more_drafts_than_k_is_refused():
    states = {"d0": RequestState(slot=0, prompt=np.zeros(4, np.int64), num_computed=10),
              "p1": RequestState(slot=1, prompt=np.zeros(3, np.int64), num_computed=0)}
    q = np.array([3, 3])
    batch = GlobalBatch(("d0", "p1"), np.arange(2), q, np.array([10, 0]), np.zeros(6, np.int64),
                        np.array([1, 5, 9, 0, 0, 0]), np.array([4, 3]), np.array([False, True]))
    v = greedy_verify(batch, np.array([2, 0]), np.array([5, 7, 3, 4]), states=states, k=2)
    assert v.sampled == [[5, 7], [4]] and v.num_rejected.tolist() == [1, 0]
    assert v.accepted_per_pos.tolist() == [1, 0]
    with pytest.raises(ValueError, match="a row carries 2 drafts, more than K = 1"):
        greedy_verify(batch, np.array([2, 0]), np.array([5, 7, 3, 4]), states=states, k=1)
