"""``same_schedule`` of a long trace is read in forked runs of steps and must name the step one
pass names (the first run's answer that is not None), or None."""

from __future__ import annotations

from pathlib import Path

import pytest

import pcpviz.trace as pt
from pcpviz.analysis import timelines
from tracegen import clean_run, corrupt

ROOT = Path(__file__).resolve().parents[2]


def _bump(x):
    x = x.copy()
    x[0] += 1
    return x


@pytest.mark.parametrize("case", ["same", "late", "two", "shipped"])
def test_forked_runs_name_the_step_one_pass_names(case, tmp_path, monkeypatch):
    if case == "shipped":
        a, b = ROOT / "data" / "traces" / "vllm-h200x2-pcp2-mtp2", ROOT / "data" / "traces" / "vllm-h200x1-pcp1-mtp2"
    else:
        a = clean_run(2, 2).write(tmp_path / "a")
        run = clean_run(2, 2)
        late = run.step_ids[-2:] if case == "two" else run.step_ids[-3:-2] if case == "late" else []
        for step in late:
            corrupt(run, step, "target", "num_computed_tokens", _bump)
        b = run.write(tmp_path / "b")
    ta, tb = pt.open(a), pt.open(b)
    monkeypatch.setenv("PCPVIZ_WORKERS", "1")
    one = timelines.same_schedule(ta, tb, rank_a=ta.ranks[0], rank_b=tb.ranks[0])
    assert (one is None) == (case == "same") and (case in ("same", "shipped") or one == late[0])
    monkeypatch.setenv("PCPVIZ_WORKERS", "3")
    monkeypatch.setattr(timelines, "PARALLEL_FROM", 1)
    for runs in (2, 5, 8):
        monkeypatch.setattr(timelines, "SCHEDULE_RUNS", runs)
        assert timelines.same_schedule(ta, tb, rank_a=ta.ranks[0], rank_b=tb.ranks[0]) == one
