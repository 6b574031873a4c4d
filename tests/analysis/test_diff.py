"""pcpviz.analysis.diff: identical runs are the same, a one-token change is located, PCP=1 vs PCP=N of
the same requests agree globally, acceptance follows vLLM's definitions; ``pcpviz diff``."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest

import pcpviz.trace as pt
from pcpviz import faults as F
from pcpviz.analysis.diff import acceptance, diff_traces
from tracegen import clean_run, corrupt, first_step


def test_identical_runs_are_the_same(tmp_path):
    a = clean_run(2).write(tmp_path / "a")
    b = clean_run(2).write(tmp_path / "b")
    rep = diff_traces(a, b)
    assert rep.same and rep.first is None and rep.num_divergent_views == 0
    assert rep.local_views_compared and rep.views_compared > 100
    assert rep.steps_compared == len(pt.open(a).steps)
    assert "result: SAME" in rep.format()


def test_one_draft_token_on_one_rank_is_located(tmp_path):
    a = clean_run(2).write(tmp_path / "a")
    run = clean_run(2)
    step = run.step_ids[3]
    ids = run.views(step, 1, "verify")["req_ids"]
    row = len(ids) - 1

    def change(x):
        x[row] += 1
        return x
    corrupt(run, step, "draft_1", "draft_tokens", change, ranks=[1])
    rep = diff_traces(a, run.write(tmp_path / "b"))
    assert not rep.same and rep.num_divergent_views == 1
    d = rep.first
    assert (d.step, d.phase, d.view, d.rank_a, d.rank_b) == (step, "draft_1", "draft_tokens", 1, 1)
    assert d.index == (row,) and d.req_id == str(ids[row])
    assert f"*{int(run.views(step, 0, 'draft_1')['draft_tokens'][row])}" in d.expected
    assert "first divergence: step" in rep.format()


def test_one_input_token_is_located_at_its_request(tmp_path):
    a = clean_run(2).write(tmp_path / "a")
    run = clean_run(2)
    step = first_step(run, lambda ph: ph["target"]["req_ids"].shape[0] >= 2)
    tgt = run.views(step, 0, "target")
    tok = int(tgt["query_start_loc"][1])  # first token of the second request

    def change(x):
        x[tok] += 1
        return x
    corrupt(run, step, "target", "input_ids", change)
    rep = diff_traces(a, run.write(tmp_path / "b"))
    d = rep.first
    assert (d.step, d.phase, d.view, d.rank_a) == (step, "target", "input_ids", 0)
    assert d.index == (tok,) and d.req_id == str(tgt["req_ids"][1])
    assert {x.view for x in rep.divergences} == {"input_ids"}


@pytest.mark.parametrize("pcp_b,kw", [(2, {}), (4, {}), (4, {"reverse_rows": True}),
                                      (2, {"shard_decode_requests": False})])
def test_pcp1_and_pcpN_agree_globally(tmp_path, pcp_b, kw):
    a = clean_run(1).write(tmp_path / "a")
    b = clean_run(pcp_b, **kw).write(tmp_path / "b")
    rep = diff_traces(a, b)
    assert rep.same, rep.format()
    assert not rep.local_views_compared
    assert any("PCP sizes" in n for n in rep.notes)
    assert rep.acceptance_a.to_dict() == rep.acceptance_b.to_dict()


def test_scalar_view_divergence(tmp_path):
    a = clean_run(2).write(tmp_path / "a")
    run = clean_run(2)
    s = run.step_ids[1]
    for rank in range(2):
        run.views(s, rank, "target")["sampled_from"] = np.array("local")
    rep = diff_traces(a, run.write(tmp_path / "b"))
    d = rep.first
    assert (d.step, d.phase, d.view, d.index, d.req_id) == (s, "target", "sampled_from", (), None)
    assert (d.expected, d.actual) == ("'global'", "'local'")


def test_other_row_order_is_aligned_by_request(tmp_path):
    a = clean_run(2).write(tmp_path / "a")
    b = clean_run(2, reverse_rows=True).write(tmp_path / "b")
    rep = diff_traces(a, b)
    assert rep.same, rep.format()
    assert any("request order differs" in n for n in rep.notes)


def test_faulty_run_diverges_where_the_fault_bites(tmp_path):
    good = clean_run(2)
    bad = clean_run(2, faults=[F.GLOBAL_POSITIONS_FROM_CPU_CURSOR])
    s = first_step(good, lambda ph: ph["verify"]["num_rejected"].any())
    nxt = good.step_ids[good.step_ids.index(s) + 1]
    rep = diff_traces(good.write(tmp_path / "a"), bad.write(tmp_path / "b"))
    assert (rep.first.step, rep.first.phase, rep.first.view) == (nxt, "target", "positions")
    prev = good.views(s, 0, "verify")
    rows = np.flatnonzero(prev["num_rejected"] > 0)
    assert rep.first.req_id in {str(prev["req_ids"][i]) for i in rows}


def test_missing_step_and_phase_are_divergences(tmp_path):
    a = clean_run(2).write(tmp_path / "a")
    run = clean_run(2)
    s = run.step_ids[2]
    for rank in range(2):
        del run.phases(s, rank)["draft_2"]
    rep = diff_traces(a, run.write(tmp_path / "b"))
    assert (rep.first.step, rep.first.phase, rep.first.view) == (s, "draft_2", None)
    assert "only in run a" in rep.first.message
    short = clean_run(2)
    short.steps.pop()
    rep = diff_traces(a, short.write(tmp_path / "c"))
    assert rep.first.step == run.step_ids[-1] and rep.first.phase is None


# --------------------------------------------------------------------------- acceptance

def _write_verify_trace(path, steps, k=3, with_num_draft=True):
    pt.write_run_meta(path, {"producer": "test", "pcp": 1, "num_speculative_tokens": k})
    with pt.TraceWriter(path, 0) as w:
        for step, (ids, nd, nacc) in enumerate(steps):
            nd, nacc = np.array(nd), np.array(nacc)
            views = {"req_ids": np.array(ids), "num_accepted": nacc, "num_rejected": nd - nacc,
                     "num_sampled": np.where(nd > 0, nacc + 1, 1),
                     "sampled_token_ids": np.full((len(ids), k + 1), -1)}
            if with_num_draft:
                views["num_draft_tokens"] = nd
            w.write_step(step, {"verify": views})
    return path


@pytest.mark.parametrize("with_num_draft", [True, False])
def test_acceptance_definitions(tmp_path, with_num_draft):
    path = _write_verify_trace(tmp_path / "t", [
        (["a", "b", "c"], [3, 3, 0], [3, 1, 0]),  # c: a prefill, no drafts -> not a draft event
        (["a", "b"], [3, 2], [0, 2]),
    ], with_num_draft=with_num_draft)
    acc = acceptance(path)
    assert acc.num_speculative_tokens == 3
    assert acc.num_drafts == 4
    assert acc.num_draft_tokens == 11
    assert acc.num_accepted_tokens == 6
    assert acc.accepted_per_position == (3, 2, 1)  # a@0: 3 positions; b@0: 1; b@1: 2
    assert acc.rate_per_position == (0.75, 0.5, 0.25)
    assert acc.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert acc.acceptance_rate == pytest.approx(6 / 11)
    assert set(acc.per_request) == {"a", "b"}
    a = acc.per_request["a"]
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens, a.accepted_per_position) == (2, 6, 3, (1, 1, 1))
    assert a.mean_acceptance_length == pytest.approx(2.5)
    assert [(s.step, s.num_drafts, s.num_accepted_tokens) for s in acc.per_step] == [(0, 2, 4), (1, 2, 2)]
    doc = json.loads(json.dumps(acc.to_dict()))
    assert doc["num_accepted_tokens_per_pos"] == [3, 2, 1]


def test_acceptance_without_drafts_is_nan_not_an_error(tmp_path):
    path = _write_verify_trace(tmp_path / "t", [(["a"], [0], [0])])
    acc = acceptance(path)
    assert acc.num_drafts == 0 and math.isnan(acc.mean_acceptance_length)
    assert acc.to_dict()["mean_acceptance_length"] is None


def test_acceptance_matches_the_simulation(tmp_path):
    run = clean_run(2)
    acc = acceptance(run.write(tmp_path / "t"))
    drafts = accepted = 0
    counts = np.zeros(3, dtype=int)
    for _, per_rank in run.steps:
        v = per_rank[0]["verify"]
        for nd, na in zip(v["num_draft_tokens"], v["num_accepted"]):
            if nd > 0:
                drafts += 1
                accepted += na
                counts[:na] += 1
    assert acc.num_drafts == drafts > 0
    assert acc.accepted_per_position == tuple(counts.tolist())
    assert acc.mean_acceptance_length == pytest.approx(1 + accepted / drafts)


def test_acceptance_side_by_side_in_the_report(tmp_path):
    a = clean_run(2, accept_prob=0.9).write(tmp_path / "a")
    b = clean_run(2, accept_prob=0.3).write(tmp_path / "b")
    rep = diff_traces(a, b)
    assert not rep.same
    assert rep.acceptance_a.mean_acceptance_length > rep.acceptance_b.mean_acceptance_length
    text = rep.format()
    line = [ln for ln in text.splitlines() if "mean acceptance length" in ln][0]
    assert f"{rep.acceptance_a.mean_acceptance_length:.3f}" in line
    assert f"{rep.acceptance_b.mean_acceptance_length:.3f}" in line
    assert "position 2: rate (accepted)" in text
    # the first scheduled drafts already differ
    assert rep.first.phase in ("target", "draft_0", "draft_1", "draft_2", "verify")


# --------------------------------------------------------------------------- CLI

def pcpviz(*args):
    return subprocess.run([sys.executable, "-m", "pcpviz.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_diff_exit_codes(tmp_path):
    a = clean_run(1).write(tmp_path / "a")
    b = clean_run(2).write(tmp_path / "b")
    c = clean_run(2, faults=[F.GLOBAL_POSITIONS_FROM_CPU_CURSOR]).write(tmp_path / "c")
    r = pcpviz("diff", str(a), str(b))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "result: SAME" in r.stdout
    r = pcpviz("diff", str(b), str(c))
    assert r.returncode == 1 and "first divergence: step" in r.stdout
    r = pcpviz("diff", str(b), str(c), "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["same"] is False and doc["first"]["view"] == "positions"
    assert doc["acceptance"]["a"]["num_drafts"] > 0
    r = pcpviz("diff", str(a), str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("pcpviz diff: ")


@pytest.mark.parametrize("view, fn, text", [
    ("req_ids", lambda a: a[:0], "req_ids [0] are not one entry per request"),
    ("req_ids", lambda a: a[None], "are not one entry per request"),
    ("num_accepted", lambda a: np.full_like(a, 2 ** 62), "accepts 4611686018427387904 of"),
    ("num_accepted", lambda a: a.astype(float) * np.nan, "num_accepted holds nan, not an integer"),
    ("num_accepted", lambda a: a.astype(float) + 0.5, "num_accepted holds 0.5, not an integer"),
])
def test_malformed_verify_counts_are_one_line_naming_file_and_step(tmp_path, view, fn, text):
    """A verify record whose counts are not one entry per request (or accept more drafts than
    were proposed) is a producer's bug: acceptance names the rank file and step, and the CLI
    says so in one line (exit 2) instead of an IndexError (or an allocation as wide as 2**62)."""
    import contextlib
    import io

    from pcpviz.cli import main

    good = clean_run(2)
    bad = clean_run(2)
    step = first_step(bad, lambda ph: "verify" in ph and np.asarray(ph["verify"]["num_draft_tokens"]).sum() > 0)
    corrupt(bad, step, "verify", view, fn)
    a, b = good.write(tmp_path / "a"), bad.write(tmp_path / "b")
    with pytest.raises(ValueError, match=f"rank0.arrow: step {step}: verify: .*{re.escape(text)}"):
        acceptance(pt.open(b))
    for argv in (["diff", str(a), str(b)], ["export", str(b), "--html", str(tmp_path / "r.html")]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(argv)
        lines = err.getvalue().strip().splitlines()
        if "not an integer" in text:  # a float where an integer view is declared: damaged data, exit 3
            assert rc == 3 and len(lines) == 1 and f"rank0.arrow step {step} verify.{view} holds" in lines[0], lines
            continue
        assert rc == 2 and len(lines) == 1 and f"rank0.arrow: step {step}: verify:" in lines[0], lines
