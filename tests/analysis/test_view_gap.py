"""``diff`` across producers of different ages: a view one run never records is not compared (one
note says so), while a view a run records at some steps and drops at another still diverges."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from tracegen import clean_run  # noqa: E402

from pcpviz.analysis.diff import diff_traces  # noqa: E402


def _drop(run, view: str, steps=None) -> None:
    for step, per_rank in run.steps:
        if steps is None or step in steps:
            for phases in per_rank:
                phases["verify"].pop(view, None)


def test_a_view_the_older_run_never_records_is_noted_not_diverged(tmp_path):
    a, b = clean_run(2), clean_run(2)
    _drop(a, "num_computed_after")  # recorded before the view existed
    r = diff_traces(a.write(tmp_path / "a"), b.write(tmp_path / "b"))
    assert r.same, r.first
    assert any(n.startswith("num_computed_after: recorded only in run b; run a never records it") for n in r.notes)


def test_a_view_dropped_at_one_step_still_diverges(tmp_path):
    a, b = clean_run(2), clean_run(2)
    last = a.step_ids[-1]
    _drop(a, "num_computed_after", steps={last})
    r = diff_traces(a.write(tmp_path / "a"), b.write(tmp_path / "b"))
    assert not r.same
    assert (r.first.step, r.first.phase, r.first.view) == (last, "verify", "num_computed_after")
    assert "view recorded only in run b" in r.first.message
    assert not any(n.startswith("num_computed_after:") for n in r.notes)
