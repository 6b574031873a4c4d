"""``run_checks(workers=N)``: several forked processes give the very report one process gives
(verdicts, counts, first violations, every failing (step, rank), skip reasons), whatever the
chunk boundaries cut through; a bad ``PCPVIZ_WORKERS`` is one ValueError naming it."""

from __future__ import annotations

import numpy as np
import pytest

from pcpviz.analysis.checks import run_checks
from pcpviz.analysis.parallel import WORKERS_ENV, default_workers, forked_map
from tracegen import clean_run, corrupt


def _facts(report):
    return {n: (r.verdict, r.evaluated, r.failed, r.skipped, r.skip_reason, r.first_violation, r.failures)
            for n, r in report.results.items()}


@pytest.fixture(scope="module")
def broken_trace(tmp_path_factory):
    run = clean_run(pcp=2, k=2)
    steps = [s for s, _ in run.steps]
    assert len(steps) >= 8
    # bugs at the first step, in the middle and at the last: every chunk boundary of 2..5 workers
    # has a violation before or after it, and positions_consistent reads the step before
    for s in (steps[0], steps[len(steps) // 2], steps[-1]):
        corrupt(run, s, "target", "positions", lambda a: a + 1, ranks=[1])
    corrupt(run, steps[3], "draft_0", "draft_input_ids", lambda a: np.roll(a, 1))
    return run.write(tmp_path_factory.mktemp("workers") / "broken")


@pytest.mark.parametrize("workers", [2, 3, 5])
def test_workers_give_the_sequential_report(broken_trace, workers):
    one = run_checks(broken_trace, workers=1)
    many = run_checks(broken_trace, workers=workers)
    assert not one.ok
    assert sum(r.failed for r in one.results.values()) >= 4
    assert _facts(many) == _facts(one)


def test_probe_gives_its_first_answer_in_step_order_with_workers(broken_trace):
    steps = run_checks(broken_trace, workers=1).steps
    asked = []

    def probe(sv):
        asked.append(sv.step)
        return (sv.step, sorted(sv.recs)) if sv.step >= 5 and sv.step % 2 else None

    one = run_checks(broken_trace, workers=1, probe=probe)
    assert one.probe == (5, [0, 1]) and asked == list(range(6))  # asked until it answered
    for workers in (2, 3):
        assert run_checks(broken_trace, workers=workers, probe=probe).probe == one.probe
    assert run_checks(broken_trace, workers=2, probe=lambda sv: None).probe is None
    assert steps >= 8


def test_default_workers(monkeypatch):
    monkeypatch.setenv(WORKERS_ENV, "auto")
    assert default_workers(10) == 1
    assert default_workers(100_000) >= 1
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert default_workers(10) == 3
    for bad in ("0", "lots", "-2", "100000"):
        monkeypatch.setenv(WORKERS_ENV, bad)
        with pytest.raises(ValueError, match=WORKERS_ENV):
            default_workers(10)


def test_forked_map_keeps_order_and_raises_the_childs_error():
    pid = __import__("os").getpid()
    assert forked_map(lambda i: (i * i, __import__("os").getpid() != pid), 5, workers=2) == \
        [(i * i, True) for i in range(5)]
    assert forked_map(lambda i: i + 1, 3, workers=1) == [1, 2, 3]

    def boom(i):
        if i == 2:
            raise KeyError("chunk 2")
        return i
    with pytest.raises(KeyError, match="chunk 2"):
        forked_map(boom, 4, workers=2)
    assert forked_map(lambda i: -i, 2, workers=2) == [0, -1]  # usable again after an error


def test_diff_in_processes_gives_the_sequential_report(tmp_path, monkeypatch):
    from pcpviz.analysis.diff import diff_traces
    good = clean_run(pcp=2, k=2)
    bad = clean_run(pcp=2, k=2)
    steps = [s for s, _ in bad.steps]
    for s in (steps[1], steps[len(steps) // 2], steps[-1]):
        corrupt(bad, s, "target", "positions", lambda a: a + 1, ranks=[0])
    corrupt(bad, steps[2], "draft_0", "draft_input_ids", lambda a: np.roll(a, 1))
    a, b = good.write(tmp_path / "a"), bad.write(tmp_path / "b")
    reports = {}
    for workers in ("1", "2", "3"):
        monkeypatch.setenv(WORKERS_ENV, workers)
        for cap in (2, 200):
            r = diff_traces(a, b, max_divergences=cap)
            reports[(workers, cap)] = (r.same, r.first, r.divergences, r.num_divergent_views,
                                       r.steps_compared, r.views_compared, r.local_views_compared, r.notes)
    for cap in (2, 200):
        assert reports[("1", cap)][0] is False and len(reports[("1", cap)][2]) >= min(cap, 4)
        assert reports[("2", cap)] == reports[("1", cap)] == reports[("3", cap)]
