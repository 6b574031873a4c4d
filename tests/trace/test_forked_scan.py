"""Opening and validating in forked processes (issue 40) gives what one process gives: the same
index, status and report, and on a damaged trace the same error (``index.fork_map``)."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest

import pcpviz.trace as pt
from pcpviz.analysis.checks import run_checks
from pcpviz.trace import index as index_mod
from tests.helpers.tracegen import clean_run, corrupt, write

validate_mod = importlib.import_module("pcpviz.trace.validate")  # the package exports a function of that name


def _forked(monkeypatch, on: bool) -> None:
    monkeypatch.setenv("PCPVIZ_WORKERS", "2" if on else "1")
    monkeypatch.setattr(index_mod, "PARALLEL_SCAN_BYTES", 0 if on else 1 << 60)


def _summary(path):
    t = pt.open(path)
    ix = {r: (t._index[r].steps.tolist(), t._index[r].starts.tolist(), t._index[r].ends.tolist(),
              [(dict(L.phases), L.views, L.tags, L.dtypes, L.prefixes) for L in t._index[r].layouts],
              t._index[r].where.tolist())
          for r in t.ranks}
    report = run_checks(t, workers=1).to_dict()
    report.pop("seconds")
    return ix, {r: f for r, f in t.files.items()}, pt.validate(t).to_dict(), report


def test_forked_open_and_validate_equal_one_process(tmp_path, monkeypatch):
    path = write(clean_run(pcp=4, k=2), tmp_path)
    _forked(monkeypatch, False)
    alone = _summary(path)
    _forked(monkeypatch, True)
    assert _summary(path) == alone
    t = pt.open(path)
    rec = t.record(t.steps[3], 3, "target")
    assert all(a.dtype is np.dtype(a.dtype.str) for a in rec.values() if a.dtype.names is None
               and a.dtype.kind != "U")  # NumPy's own dtypes, not pickled copies


@pytest.mark.parametrize("on", [False, True])
def test_validate_reads_the_index_and_check_the_damaged_verify_payload(tmp_path, monkeypatch, on):
    """validate judges K by the width its index gives ``sampled_token_ids`` (no payload read); the
    check that reads the payload names the damage in one line, forked or not."""
    run = clean_run(pcp=2, k=2)
    path = write(run, tmp_path)
    rank0 = path / "rank0.arrow"
    t = pt.open(path)
    late = [s for s in t.rank_steps(0) if t.has(s, 0, "verify")][-1]
    raw = bytearray(rank0.read_bytes())
    needle = np.asarray(t.record(late, 0, "verify")["sampled_token_ids"]).tobytes()
    raw[raw.rindex(needle)] ^= 0x40
    rank0.write_bytes(bytes(raw))
    _forked(monkeypatch, on)
    t = pt.open(path)
    monkeypatch.setattr(pt.Trace, "lazy_record", lambda *a, **k: pytest.fail("a payload was read"))
    assert pt.validate(t).ok
    monkeypatch.undo()
    _forked(monkeypatch, on)
    with pytest.raises(pt.TraceError, match=f"step {late}: view 'sampled_token_ids' \\(phase 'verify'\\)"):
        run_checks(pt.open(path), workers=2 if on else 1)


def test_fork_map_yields_in_order_and_raises_the_first_error():
    assert list(index_mod.fork_map(lambda i: i * i, 7, workers=3)) == [i * i for i in range(7)]
    parent = os.getpid()  # a child's None is its answer, not computed again here
    here = list(index_mod.fork_map(lambda i: "here" if i >= 4 and os.getpid() == parent else None, 8, workers=2))
    assert here == [None] * 8

    def fn(i):
        if i in (2, 5):
            raise ValueError(f"item {i}")
        return i

    got = []
    with pytest.raises(ValueError, match="item 2"):
        for v in index_mod.fork_map(fn, 7, workers=3):
            got.append(v)
    assert got == [0, 1]


def test_validate_finds_a_verify_wider_than_k_plus_one_from_the_index(tmp_path):
    run = clean_run(pcp=2, k=2)
    step = run.step_ids[5]
    corrupt(run, step, "verify", "sampled_token_ids", lambda x: np.concatenate([x, x[:, :1]], axis=1))
    t = pt.open(write(run, tmp_path))
    problems = [p.message for p in pt.validate(t).problems]
    width = list(np.asarray(t.record(step, 0, "verify")["sampled_token_ids"]).shape)
    assert any(f"step {step} rank 0 samples 4 tokens per request (verify sampled_token_ids {width}), i.e. K=3" in m
               for m in problems), problems
    assert t.view_shape(step, 0, "verify", view="sampled_token_ids") == tuple(width)
    assert t.view_shape(step, 0, "verify", view="no_such_view") is None
