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
