"""``pcpviz.analysis.acceptance``: vLLM's acceptance definitions in one place, with one edge policy (a
ratio over nothing drafted is NaN, written null in JSON); diff, the figures and the engine
summary give the same numbers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import pcpviz.trace as pt
from pcpviz.analysis import acceptance as A
from pcpviz.analysis.diff import Acceptance, acceptance
from pcpviz.views import figures as fg

from tracegen import clean_run


def test_count_follows_vllms_definitions():
    # K=3: request a accepts 3 of 3, b 1 of 3, c drafts nothing (a prefill), d accepts 0 of 2
    c = A.count([3, 1, 0, 0], [3, 3, 0, 2], k=3)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (3, 8, 4)
    assert c.accepted_per_position == (2, 1, 1)
    assert c.rate_per_position == pytest.approx((2 / 3, 1 / 3, 1 / 3))
    assert c.acceptance_rate == pytest.approx(4 / 8)  # over draft tokens, not drafts * K
    assert c.mean_acceptance_length == pytest.approx(1 + 4 / 3)


def test_nothing_drafted_is_nan_everywhere_and_null_in_json():
    for c in (A.Counts(), A.count([0, 0], [0, 0], k=2), A.Counts().widened(2)):
        assert c.num_drafts == 0
        assert math.isnan(c.acceptance_rate) and math.isnan(c.mean_acceptance_length)
        assert all(math.isnan(x) for x in c.rate_per_position)
        assert json.dumps([A.json_ratio(c.acceptance_rate), A.json_ratio(c.mean_acceptance_length)]) == "[null, null]"
    assert A.ratio(1, 0) != A.ratio(1, 0)  # NaN
    assert A.json_ratio(0.5) == 0.5


def test_counts_add_and_widen():
    total = A.count([2], [2], k=2) + A.count([0, 3], [2, 3], k=3)
    assert total.accepted_per_position == (2, 2, 1) and total.num_drafts == 3
    assert A.Counts().widened(2).accepted_per_position == (0, 0)


def test_count_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="num_accepted has 2 rows, num_draft_tokens 1"):
        A.count([1, 2], [3])


def test_verify_counts_falls_back_to_accepted_plus_rejected():
    nacc, nd = A.verify_counts({"num_accepted": np.array([1, 0]), "num_rejected": np.array([1, 2])})
    assert nd.tolist() == [2, 2] and nacc.tolist() == [1, 0]
    assert A.verify_counts({"num_sampled": np.array([1])}) is None


def test_one_implementation_behind_diff_and_the_figures(tmp_path):
    trace = pt.open(clean_run().write(tmp_path / "t"))
    acc = acceptance(trace)
    assert acceptance is A.acceptance and Acceptance is A.Acceptance
    stats = fg.trace_acceptance(trace)
    assert stats.num_drafts == acc.num_drafts > 0
    assert stats.accepted_per_pos.tolist() == list(acc.accepted_per_position)
    assert stats.rate_per_pos.tolist() == pytest.approx(list(acc.rate_per_position))
    assert stats.acceptance_rate == pytest.approx(acc.acceptance_rate)
    assert stats.mean_acceptance_length == pytest.approx(acc.mean_acceptance_length)
    recs = [(s, trace.record(s, 0, "verify")) for s in trace.steps]
    assert fg.acceptance_stats(recs, 3).accepted_per_pos.tolist() == list(acc.accepted_per_position)
    per_req = sum((A.Counts(r.num_drafts, r.num_draft_tokens, r.num_accepted_tokens, r.accepted_per_position)
                   for r in acc.per_request.values()), A.Counts())
    assert per_req.accepted_per_position == acc.accepted_per_position


def test_a_run_without_drafts_draws_gaps_not_nan(tmp_path):
    with pt.TraceWriter(tmp_path, 0, meta={"producer": "test", "pcp": 1, "num_speculative_tokens": 2}) as w:
        w.write_step(0, {"verify": {"req_ids": np.array(["a"]), "num_accepted": np.zeros(1, np.int64),
                                    "num_draft_tokens": np.zeros(1, np.int64)}})
    stats = fg.trace_acceptance(pt.open(tmp_path))
    assert stats.num_drafts == 0 and math.isnan(stats.mean_acceptance_length)
    fig = fg.acceptance_figure(stats)
    assert list(fig.data[0].y) == [None, None]
    assert "mean length -" in fig.layout.title.text
    json.dumps(fig.to_plotly_json()["data"][0]["y"], allow_nan=False)


@pytest.mark.parametrize("bad", [False, True])
def test_acceptance_in_forked_runs_of_steps_is_one_pass(tmp_path, monkeypatch, bad):
    """A long trace's acceptance is summed in forked runs of steps (``_sums_in_runs``): the same
    numbers, requests in the same order, and a malformed record's error the one pass raises."""
    from tracegen import corrupt

    run = clean_run(pcp=2, k=2)
    steps = [s for s, _ in run.steps if run.phases(s, 0).get("verify")]
    if bad:
        for s in (steps[len(steps) // 2], steps[-2]):
            corrupt(run, s, "verify", "num_accepted", lambda a: a + 9)
    t = pt.open(run.write(tmp_path / "t"))

    def result():
        try:
            a = A.acceptance(t)
        except ValueError as exc:
            return str(exc)
        return a.to_dict(), a.per_step, list(a.per_request)

    monkeypatch.setenv("PCPVIZ_WORKERS", "1")
    one = result()
    monkeypatch.setenv("PCPVIZ_WORKERS", "2")
    monkeypatch.setattr(A, "PARALLEL_FROM", 0)
    assert result() == one
    assert isinstance(one, str) == bad and (not bad or f"step {steps[len(steps) // 2]}:" in one)


@pytest.mark.parametrize("seed", range(12))
def test_the_running_sums_are_the_sum_of_each_steps_counts(seed):
    """``acceptance_from_records`` (``_Sums``, integers kept as lists) equals adding up ``count``
    of every step and of every request row, by ``Counts.__add__``: totals, the per-position counts
    and their widths, the requests in order of first appearance, whether split into runs or not."""
    from pcpviz.trace.acceptance import count

    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 5))
    records, total, per_req = [], A.Counts(), {}
    for step in range(int(rng.integers(1, 40))):
        n = int(rng.integers(0, 5))
        nd = rng.integers(0, k + 1, n)
        nacc = np.array([int(rng.integers(0, d + 1)) for d in nd], dtype=np.int64)
        ids = np.array([f"r{int(x)}" for x in rng.integers(0, 6, n)])
        _, first = np.unique(ids, return_index=True)
        keep = np.sort(first)  # one row per request a step
        nd, nacc, ids = nd[keep], nacc[keep], ids[keep]
        records.append((step, {"num_accepted": nacc, "num_draft_tokens": nd, "req_ids": ids}))
        total = total + count(nacc, nd)
        for rid, a, d in zip(ids.tolist(), nacc.tolist(), nd.tolist()):
            if d > 0:
                per_req[rid] = per_req.get(rid, A.Counts()) + count([a], [d])
    got = A.acceptance_from_records(records, k=k)
    want = total.widened(k)
    assert (got.num_drafts, got.num_draft_tokens, got.num_accepted_tokens) == \
        (want.num_drafts, want.num_draft_tokens, want.num_accepted_tokens)
    assert got.accepted_per_position == want.accepted_per_position
    assert list(got.per_request) == list(per_req)
    width = len(want.accepted_per_position)
    for rid, c in per_req.items():
        r = got.per_request[rid]
        assert (r.num_drafts, r.num_draft_tokens, r.num_accepted_tokens) == \
            (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens)
        assert r.accepted_per_position == c.widened(width).accepted_per_position
    cut = len(records) // 2  # two runs of steps added in order: the same sums
    a, b = A._Sums(k), A._Sums(k)
    for step, rec in records[:cut]:
        a.add(step, rec)
    for step, rec in records[cut:]:
        b.add(step, rec)
    a.extend(b)
    whole = A._Sums(k)
    for step, rec in records:
        whole.add(step, rec)
    assert (a.total, a.per_req, a.steps) == (whole.total, whole.per_req, whole.steps)
