"""The completion record (``pcpviz.trace.completion``): how a trace says it ended, and what a
reader makes of every way it can be missing, stale or wrong."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

import pcpviz.trace as pt
from pcpviz.trace.completion import mark_legacy, read_completion

ROOT = Path(__file__).resolve().parents[2]
LEGACY = ROOT / "data" / "traces" / "vllm-h200x2-pcp2-mtp2"


def _write(d: Path, steps: int = 3, ranks: int = 2, close: bool = True) -> list[pt.TraceWriter]:
    pt.write_run_meta(d, {"producer": "test", "pcp": ranks, "block_size": 16})
    ws = [pt.TraceWriter(d, r) for r in range(ranks)]
    for s in range(steps):
        for w in ws:
            w.write_step(s, {"target": {"positions": np.arange(4) + s}})
    if close:
        for w in ws:
            w.close()
    return ws


def _status(d: Path) -> pt.TraceStatus:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pt.validate(pt.open(d))


def test_a_closed_trace_is_complete_and_says_so(tmp_path):
    _write(tmp_path)
    st = _status(tmp_path)
    assert st.ok and st.ending == "complete"
    rec = read_completion(tmp_path)
    assert sorted(rec.ranks) == [0, 1] and rec.ranks[1].steps == 3 and rec.ranks[1].last_step == 2
    assert rec.ranks[0].nbytes == (tmp_path / "rank0.arrow").stat().st_size


def test_a_live_writer_is_reported_until_it_closes(tmp_path):
    ws = _write(tmp_path, close=False)
    st = _status(tmp_path)
    assert st.ending == "being written" and not st.complete
    assert all("still being written" in ln for ln in st.lines("incomplete")) and len(st.lines()) == 2
    ws[0].close()
    ws[1].close(status="partial", reason="stopped by SIGTERM")
    st = _status(tmp_path)
    assert st.ending == "partial: stopped by SIGTERM (rank 1)"
    assert st.lines("incomplete") == [f"incomplete: {tmp_path / 'rank1.arrow'}: partial: stopped by SIGTERM; "
                                      "3 step(s), the last 2"]


def test_an_exception_in_the_with_block_closes_partial(tmp_path):
    pt.write_run_meta(tmp_path, {"producer": "test", "pcp": 1, "block_size": 16})
    with pytest.raises(RuntimeError):
        with pt.TraceWriter(tmp_path, 0) as w:
            w.write_step(0, {"target": {"positions": np.arange(2)}})
            raise RuntimeError("cuda error: device-side assert")
    assert read_completion(tmp_path).ranks[0].reason == "RuntimeError: cuda error: device-side assert"
    assert not _status(tmp_path).complete


def test_a_file_cut_at_a_step_boundary_no_longer_matches_its_record(tmp_path):
    """Before the record, a copy cut exactly between two steps looked whole."""
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a)
    _write(b, steps=2)  # the same bytes up to the end of step 1, then the end-of-stream marker
    boundary = (b / "rank1.arrow").stat().st_size - 8
    data = (a / "rank1.arrow").read_bytes()
    assert data[:boundary] == (b / "rank1.arrow").read_bytes()[:boundary]
    (a / "rank1.arrow").write_bytes(data[:boundary])
    st = _status(a)
    assert pt.open(a).rank_steps(1) == [0, 1] and not pt.open(a).warnings  # no damage the reader can see
    assert any("rank1.arrow: " in ln and "changed or cut after its writer finished" in ln for ln in st.lines())


def test_one_rank_without_an_entry_did_not_finish(tmp_path):
    ws = _write(tmp_path, close=False)
    ws[0].close()
    ws[1]._fd, fd = None, ws[1]._fd  # noqa: SLF001 - the process "dies": fd dropped, no close()
    import os

    os.close(fd)
    st = _status(tmp_path)
    assert st.ending == "unfinished"
    assert any("rank1.arrow: rank 1 did not finish" in ln for ln in st.lines())


def test_a_damaged_record_is_incomplete_not_a_traceback(tmp_path):
    _write(tmp_path)
    (tmp_path / "complete.json").write_text('{"ranks": {"0": {"status": "done"}}}')
    st = _status(tmp_path)
    assert not st.complete and "status 'done' is not one of complete, partial" in st.lines()[0]
    (tmp_path / "complete.json").unlink()
    (tmp_path / "complete.json").symlink_to(tmp_path / "run.json")
    assert "cannot read (a symbolic link)" in _status(tmp_path).lines()[0]


def test_overwriting_a_rank_forgets_its_old_ending(tmp_path):
    _write(tmp_path)
    w = pt.TraceWriter(tmp_path, 1, overwrite=True)
    assert 1 not in read_completion(tmp_path).ranks and 0 in read_completion(tmp_path).ranks
    w.write_step(0, {"target": {"positions": np.arange(4)}})
    w.close()
    assert read_completion(tmp_path).ranks[1].steps == 1


def test_claim_with_overwrite_removes_the_record(tmp_path):
    _write(tmp_path)
    with pytest.raises(ValueError, match="already holds a trace"):
        pt.claim(tmp_path)
    pt.claim(tmp_path, overwrite=True).release()
    assert not (tmp_path / "complete.json").exists()


def test_a_legacy_trace_is_not_recorded_unless_marked(tmp_path):
    """Written before completion records (no pcpviz_completion in the header): not held against it;
    a mark added afterwards says it finished and is checked like any record."""
    d = tmp_path / "legacy"
    shutil.copytree(LEGACY, d)
    assert (d / "complete.json").exists() and _status(d).ending.startswith("complete (marked after the fact: ")
    (d / "complete.json").unlink()
    st = _status(d)
    assert st.ok and st.ending.startswith("not recorded")
    mark_legacy(d, "test: its job exited 0")
    assert _status(d).ending == "complete (marked after the fact: test: its job exited 0)"
    with open(d / "rank0.arrow", "ab") as f:  # appended to after it was marked
        f.write(b"\0" * 8)
    assert not _status(d).complete


def test_mark_legacy_refuses_a_trace_that_records_its_end(tmp_path):
    _write(tmp_path)
    with pytest.raises(ValueError, match="records its end; nothing to mark"):
        mark_legacy(tmp_path, "no")


def test_every_shipped_trace_is_marked_finished():
    for d in sorted((ROOT / "data" / "traces").iterdir()):
        st = _status(d)
        assert st.ok, (d.name, st.lines())
        finalizes = all(f.finalizes for f in pt.open(d).files.values())
        assert st.ending == "complete" if finalizes else st.ending.startswith("complete (marked after the fact"), \
            (d.name, st.ending)
        json.loads((d / "complete.json").read_text())


def test_explain_and_the_workbench_say_a_trace_stopped_early(tmp_path):
    from pcpviz.analysis.explain import explain
    from pcpviz.views.widgets import Workbench

    good = ROOT / "data" / "traces" / "cpu-pcp2-mtp2"
    d = tmp_path / "stopped"
    shutil.copytree(good, d)
    doc = json.loads((d / "complete.json").read_text())
    doc["ranks"]["1"].update(status="partial", reason="stopped by SIGINT")
    (d / "complete.json").write_text(json.dumps(doc))
    rep = explain(d, good)
    assert "INCOMPLETE (the run stopped early: stopped by SIGINT (rank 1))" in rep.headline, rep.headline
    acc = Workbench(pt.open(d)).checks_box
    assert acc.get_title(0).startswith("✗ INCOMPLETE trace: ") and "partial: stopped by SIGINT" in acc.get_title(0)
    notes = acc.children[0].children[0].value
    assert "run ended: partial: stopped by SIGINT (rank 1)" in notes
