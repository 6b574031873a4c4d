"""Questions answered in the checks' pass (``run_checks(folds=...)``): each fold gives what its
own pass over the trace gives, in one process or cut into runs of steps checked in forked
processes, errors included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pcpviz.trace as pt
from pcpviz.analysis.acceptance import AcceptanceFold, acceptance
from pcpviz.analysis.checks import run_checks
from pcpviz.views.figures import ReqIdsFold, trace_req_ids
from tests.helpers.hostile import rewrite

ROOT = Path(__file__).resolve().parents[2]
TRACES = [ROOT / "data" / "traces" / n for n in ("cpu-pcp2-mtp2", "vllm-h200x2-pcp2-mtp3",
                                                    "vllm-h200x1-pcp1-mtp2-full")]


def _folded(trace, workers: int):
    folds = {"acceptance": AcceptanceFold.of(trace), "req_ids": ReqIdsFold(trace)}
    return run_checks(trace, workers=workers, folds=folds)


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
@pytest.mark.parametrize("workers", [1, 2])
def test_folds_answer_what_their_own_pass_answers(path, workers):
    t = pt.open(path)
    report = _folded(t, workers)
    for r in t.ranks:
        assert acceptance(t, rank=r, folded=report.folds["acceptance"]) == acceptance(t, rank=r)
    assert trace_req_ids(t, report) == trace_req_ids(t)
    assert report.folds["req_ids"]  # a real run names its requests
    plain = run_checks(t, workers=workers)  # asking for folds changes no verdict
    assert {n: r.to_dict() for n, r in report.results.items()} == {n: r.to_dict() for n, r in plain.results.items()}


@pytest.mark.parametrize("workers", [1, 2])
def test_a_malformed_verify_record_raises_the_same_error_from_the_fold(tmp_path, workers):
    def edit(step, rank, phases):
        if rank == 1 and step >= 5 and "verify" in phases:  # accepts more drafts than it was given
            phases["verify"]["num_accepted"] = np.asarray(phases["verify"]["num_draft_tokens"]) + 1

    t = pt.open(rewrite(TRACES[0], tmp_path / "bad", edit))
    report = _folded(t, workers)
    assert acceptance(t, rank=0, folded=report.folds["acceptance"]) == acceptance(t, rank=0)
    with pytest.raises(ValueError) as direct:
        acceptance(t, rank=1)
    with pytest.raises(ValueError) as folded:
        acceptance(t, rank=1, folded=report.folds["acceptance"])
    assert str(folded.value) == str(direct.value)
    assert "rank1" in str(direct.value) and "step 5: verify: malformed acceptance counts" in str(direct.value)


def test_no_fold_without_k_in_run_json(tmp_path):
    t = pt.open(rewrite(TRACES[0], tmp_path / "nok", lambda *a: None,
                        meta_edit=lambda m: m.pop("num_speculative_tokens", None)))
    assert t.run_meta.num_speculative_tokens is None
    assert AcceptanceFold.of(t) is None  # K then comes from the first record, which later runs do not see
