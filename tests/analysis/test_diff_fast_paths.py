"""``diff``'s fast paths change no report: a step's records are read in one pass per (run, rank)
(a damaged payload still raises the per-phase read's error), and two views of one dtype with
equal bytes are equal without ``first_difference`` only where it would find them equal."""

from __future__ import annotations

import random

import numpy as np
import pytest

import pcpviz.trace as pt
from pcpviz.analysis import diff as D
from pcpviz.analysis.compare import first_difference
from tracegen import clean_run, corrupt


def _arrays(rng: random.Random):
    kinds = [np.int64, np.int32, np.uint8, np.float64, np.float32, bool, "U3",
             np.dtype([("a", "<i8"), ("b", "<i4")]), np.dtype([("a", "<f8"), ("b", "<i4")]),
             np.dtype([("a", "<i8", (2,))])]
    dt = np.dtype(rng.choice(kinds))
    shape = tuple(rng.randrange(0, 4) for _ in range(rng.randrange(0, 3)))
    raw = np.frombuffer(bytes(rng.randrange(256) for _ in range(int(np.prod(shape)) * dt.itemsize)), np.uint8)
    if dt.kind == "U":
        a = np.array([rng.choice(["", "a", "bc", "x\u00e9"]) for _ in range(int(np.prod(shape)))], dtype=dt)
        return a.reshape(shape)
    a = raw.view(dt).reshape(shape) if raw.size else np.zeros(shape, dt)
    if dt.kind == "b":
        a = raw.astype(bool).reshape(shape)
    if dt.kind == "f" and a.size and rng.random() < 0.5:
        a = a.copy()
        a.ravel()[0] = np.nan
    return a


def test_equal_bytes_of_an_exact_dtype_are_what_first_difference_finds_equal():
    rng = random.Random(5)
    told = 0
    for _ in range(3000):
        a = _arrays(rng)
        b = np.frombuffer(a.tobytes(), a.dtype).reshape(a.shape) if a.dtype.kind != "U" else a.copy()
        if D._exact(a.dtype):
            told += 1
            ea, eb = a, b
            if a.dtype.names is not None:
                ea, eb = np.asarray(a.tolist(), dtype=object), np.asarray(b.tolist(), dtype=object)
            assert not first_difference(ea, eb)[0], (a.dtype, a)
    assert told > 1000
    assert not D._exact(np.dtype([("a", "<f8"), ("b", "<i4")])) and not D._exact(np.dtype([("a", "<i8", (2,))]))


@pytest.mark.parametrize("seed", range(6))
def test_diff_of_damaged_copies_is_the_per_phase_diff(tmp_path, monkeypatch, seed):
    """The one-pass reading gives the report the per-phase reading (``Trace.record``) gives."""
    rng = random.Random(seed)
    a = clean_run(2, rng.choice([1, 2, 3])).write(tmp_path / "a")
    run = clean_run(2, 2)
    for _ in range(3):
        step = rng.choice(run.step_ids)
        view = rng.choice(["positions", "input_ids", "seq_lens", "slot_mapping_global", "req_ids"])

        def damage(x):
            if x.dtype.kind in "iu" and x.size:
                x.ravel()[rng.randrange(x.size)] += rng.choice([1, 2**40])
            elif x.dtype.kind == "U" and x.size:
                x = np.array(["zz"] + x.ravel().tolist()[1:]).reshape(x.shape)
            return x
        corrupt(run, step, "target", view, damage, ranks=rng.choice([None, [0], [1]]))
    b = run.write(tmp_path / "b")
    fast = D.diff_traces(a, b)

    def per_phase(self, run, rank):
        t = self.runs[run]
        got = self.got.get((run, rank))
        if got is None:
            got = self.got[(run, rank)] = ({ph: t.record(self.step, rank, ph) for ph in t.phases(self.step, rank)},
                                           False)
        return got

    monkeypatch.setattr(D._StepRecords, "get", per_phase)
    monkeypatch.setattr(D, "_exact", lambda dt: False)
    slow = D.diff_traces(a, b)
    assert fast == slow


def test_a_damaged_payload_raises_the_per_phase_error(tmp_path):
    a = clean_run(2, 1).write(tmp_path / "a")
    b = clean_run(2, 1).write(tmp_path / "b")
    t = pt.open(b)
    step = t.steps[2]
    rank1 = b / "rank1.arrow"
    raw = bytearray(rank1.read_bytes())
    at = raw.index(np.asarray(t.record(step, 1, "target")["positions"]).tobytes())  # this step's or an earlier one's
    raw[at] ^= 0x40
    rank1.write_bytes(bytes(raw))
    with pytest.raises(pt.TraceError) as fast:
        D.diff_traces(a, b)
    tb = pt.open(b)
    with pytest.raises(pt.TraceError) as slow:
        for s in tb.steps:
            for r in tb.ranks:
                for ph in tb.phases(s, r):
                    tb.record(s, r, ph)
    assert str(fast.value) == str(slow.value) and "crc32 mismatch" in str(fast.value)


def _rename_requests(run, prefix: str) -> None:
    for _, per_rank in run.steps:
        for phases in per_rank:
            for views in phases.values():
                for v in ("req_ids", "local_req_ids"):
                    if v in views:
                        views[v] = np.array([prefix + str(x) for x in np.asarray(views[v]).tolist()])


@pytest.mark.parametrize("workers", ["1", "2"])
def test_acceptance_counted_in_the_comparison_is_acceptance_of_each_run(tmp_path, monkeypatch, workers):
    """The acceptance side by side is what ``acceptance`` reads from each run, counted while the
    steps are compared, in one process or in several; run B with other request ids keeps run A's
    names (its requests matched by prompt), and a run that lost drafts counts them lost."""
    monkeypatch.setenv("PCPVIZ_WORKERS", workers)
    a = clean_run(2, 2).write(tmp_path / "a")
    run = clean_run(2, 2)
    _rename_requests(run, "other-")
    step = next(s for s in run.step_ids if run.views(s, 0, "verify")["num_accepted"].any())
    hit = run.views(step, 0, "verify")["num_accepted"] > 0  # one draft fewer accepted there
    for view, d in (("num_accepted", -1), ("num_sampled", -1), ("num_rejected", 1)):
        corrupt(run, step, "verify", view, lambda x, d=d: x + d * hit)
    b = run.write(tmp_path / "b")
    report = D.diff_traces(a, b)
    assert any("matched to a's by their prompts" in n for n in report.notes)
    assert not any("batched the requests differently" in n for n in report.notes)  # read renamed: one schedule
    tb = D.RenamedRequests(pt.open(b), {f"other-{r}": r for r in D.request_keys(pt.open(a))})
    for got, want in ((report.acceptance_a, D.acceptance(pt.open(a))), (report.acceptance_b, D.acceptance(tb))):
        assert got.to_dict() == want.to_dict()
    assert set(report.acceptance_b.per_request) == set(report.acceptance_a.per_request)
    assert report.acceptance_b.num_accepted_tokens < report.acceptance_a.num_accepted_tokens
    assert report.first is not None and report.first.step <= step


def test_equal_rows_of_the_two_runs_are_one_array_and_a_difference_is_still_found(tmp_path):
    a = clean_run(2, 2).write(tmp_path / "a")
    run = clean_run(2, 2)
    step = run.step_ids[3]
    corrupt(run, step, "target", "positions", lambda x: x + 1, ranks=[1])
    b = run.write(tmp_path / "b")
    recs = D._StepRecords(pt.open(a), pt.open(b), step)
    ra, rb = recs.rec("a", 0, "target"), recs.rec("b", 0, "target")
    assert all(ra[v] is rb[v] for v in ra)  # rank 0 recorded the same bytes in both runs
    assert recs.rec("a", 1, "target")["positions"] is not recs.rec("b", 1, "target")["positions"]
    first = D.diff_traces(a, b).first
    assert (first.step, first.phase, first.view, first.rank_a) == (step, "target", "positions", 1)
