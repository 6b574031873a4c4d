"""pcpviz.teaching.review: every vLLM line the review map cites holds the cited text in the installed
vLLM 0.33.0, every piece of evidence exists, and the support matrix is vLLM's own verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pcpviz.teaching import review
from pcpviz.analysis.checks import CHECKS
from pcpviz.faults import FAULTS

ROOT = Path(__file__).resolve().parents[2]
REVIEW_KEYS = {f"impl {i}" for i in range(1, 7)} | {f"comment {i}" for i in range(1, 4)} | {
    f"risk {i}" for i in range(1, 6)}


def _vllm_dir() -> Path:
    import vllm

    assert vllm.__version__ == "0.33.0"
    return Path(vllm.__file__).parent


def test_every_review_point_has_a_row():
    keys = {p.key.rstrip("abcd") for p in review.review_map()}
    assert REVIEW_KEYS <= keys, sorted(REVIEW_KEYS - keys)
    assert all(p.modelled in ("yes", "partly", "no") for p in review.review_map())


@pytest.mark.parametrize("ref", sorted({r for p in review.review_map() for r in p.vllm}, key=str), ids=str)
def test_cited_vllm_line_holds_the_anchor(ref):
    lines = (_vllm_dir() / ref.path).read_text().splitlines()
    assert ref.anchor in lines[ref.line - 1], f"{ref}: {lines[ref.line - 1].strip()!r}"


def test_evidence_exists():
    notebooks = {p.name[:2] for p in (ROOT / "notebooks").glob("*.ipynb")}
    from pcpviz.teaching import buffer_order, claims, coverage, examples, pcp_rules, vllm_runs
    from pcpviz.vllm.replay import SCENARIOS

    teaching = {n for mod in (examples, pcp_rules, vllm_runs, buffer_order, claims, coverage) for n in mod.__all__}

    for p in review.review_map():
        assert p.evidence, p.key
        for ev in p.evidence:
            kind, _, name = ev.partition(":")
            if kind == "check":
                assert name in CHECKS, ev
            elif kind == "fault":
                assert name in FAULTS, ev
            elif kind == "notebook":
                assert name in notebooks, ev
            elif kind == "teach":
                assert name in teaching, ev
            elif kind == "finding":
                assert (ROOT / "docs" / "findings" / f"{name}.md").is_file(), ev
            elif kind == "replay":
                assert name in SCENARIOS, ev
            elif kind == "test":
                path, _, func = name.partition("::")
                text = (ROOT / path).read_text()
                assert not func or f"def {func}(" in text, ev
            else:
                pytest.fail(f"{p.key}: unknown evidence kind {ev!r}")


def test_every_risk_says_what_is_demonstrated_and_what_only_read():
    risks = [p for p in review.review_map() if p.key.startswith("risk")]
    assert {p.key.rstrip("b") for p in risks} == {f"risk {i}" for i in range(1, 6)}
    for p in risks:
        assert p.demonstrated and p.only_read, p.key
    md = review.review_markdown()
    assert "| demonstrated with vLLM's code | only read |" in md.splitlines()[0]


def test_k1_returns_before_the_gather():
    # issue 11 point 6: with K <= 1 propose returns before the gather and the replicated steps
    row = next(p for p in review.review_map() if p.key == "impl 3")
    ret, gather = row.vllm
    assert "num_speculative_tokens <= 1" in ret.anchor and ret.line < gather.line


def test_support_matrix():
    got = dict(review.support_matrix())
    accepted = {name for name, verdict in got.items() if verdict == "accepted"}
    assert accepted == {
        "MTP (single module), PIECEWISE", "MTP, FULL_DECODE_ONLY", "MTP, FULL_AND_PIECEWISE", "DSpark, DCP=1",
        "DSpark, PCP=2, DCP=2, sparse MLA", "DSpark, TP=2 PCP=2 DCP=4 (= TP*PCP), non-MLA drafter",
        "sparse MLA DeepSeek-V3.2, PIECEWISE"}
    assert got["DFlash"] == got["EAGLE3"] == got["multi-module MTP"] == (
        "MRV2 PCP only supports DSpark or single-module MTP speculative decoding.")
    assert "requires DCP=1 or DCP=PCP; got DCP=4, PCP=2" in got["DSpark, TP=2 PCP=2 DCP=4 (= TP*PCP), MLA drafter"]
    assert "full CUDA graphs for decode-only routines" in got["MTP, FULL"]


def test_review_markdown_has_one_row_per_point():
    md = review.review_markdown()
    assert len(md.splitlines()) == 2 + len(review.review_map())
    assert "`v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py:303`" in md


def test_illustrative_faults_say_so():
    # issue 11 point 4: the fold fault is not vLLM's bug as it would happen; it says so
    unfaithful = {n for n, f in FAULTS.items() if not f.faithful}
    assert unfaithful == {"fold_slot_mapping_without_shape_check"}
    for name in unfaithful:
        assert FAULTS[name].summary.startswith("ILLUSTRATION")
    row = next(p for p in review.review_map() if p.key == "impl 5c")
    assert row.modelled == "no" and "illustration" in row.how


def test_the_review_data_lives_in_docs_and_a_damaged_file_is_one_line(tmp_path):
    # issue 40: the review is documentation (docs/review/), read by the library, not Python literals in it
    assert review.REVIEW_FILE == ROOT / "docs" / "review" / "review-map.json"
    assert not hasattr(review, "REVIEW_MAP")
    doc = json.loads(review.REVIEW_FILE.read_text())
    doc["points"][2]["vllm"][0]["line"] = "848"
    bad = tmp_path / "review-map.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as err:
        review.load_review(bad)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{bad}: points[2] (impl 2b): vllm[0]: line: expected int"), msg
    bad.write_text("{")
    with pytest.raises(ValueError, match=f"^{bad}: "):
        review.load_review(bad)
