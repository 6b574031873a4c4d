"""A step's batch read where the open walk found its buffers (``RankIndex.where``,
``batches.load_at``) is what parsing its Arrow message again reads (``batches.load``), on every
shipped trace; a batch whose offsets changed after the trace was opened is a one-line
``TraceError``, not a wrong read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import pcpviz.trace as pt
from pcpviz.trace.batches import load
from pcpviz.trace.errors import TraceError
from tests.helpers.tracegen import clean_run, write

TRACES = sorted(p for p in (Path(__file__).resolve().parents[2] / "data" / "traces").iterdir() if p.is_dir())


def _parsed(ix, i: int):
    start, end = int(ix.starts[i]), int(ix.ends[i])
    batch = pa.ipc.read_record_batch(ix.buffer.slice(start, end - start), ix.schema)
    return load(batch, int(ix.steps[i]))


def _same(a, b) -> None:
    assert a.shapes == b.shapes and a.crcs == b.crcs and a.offsets == b.offsets
    assert a.values.equals(b.values) and a.step_crc == b.step_crc
    assert np.array_equal(a.offsets_array, b.offsets_array) and bytes(a.mv) == bytes(b.mv)
    assert not a.u8.flags.writeable


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.name)
def test_a_batch_read_where_the_walk_found_it_is_the_parsed_batch(trace):
    t = pt.open(trace)
    for rank in t.ranks:
        ix = t._index[rank]
        assert ix.where is not None and ix.where.shape == (len(ix.steps), 4)
        assert (ix.where[:, 0] >= 0).all()  # every buffer lay in its message: none parsed again
        for i in range(len(ix.steps)):
            ix._last = None
            _same(ix.batch(i), _parsed(ix, i))


def test_a_batch_the_walk_could_not_place_is_parsed_again(tmp_path):
    t = pt.open(write(clean_run(pcp=2, k=1), tmp_path))
    ix = t._index[0]
    ix._last = None
    placed = ix.batch(1)
    ix.where[1] = -1  # as the walk records a batch whose buffers Arrow copied
    ix._last = None
    _same(ix.batch(1), placed)


def test_offsets_changed_after_open_are_a_one_line_error(tmp_path):
    path = write(clean_run(pcp=2, k=1), tmp_path)
    t = pt.open(path)
    ix = t._index[1]
    step, (offs_at, _, size, _) = int(ix.steps[2]), ix.where[2].tolist()
    n = len(ix.shapes[2])
    rank_file = Path(ix.path)
    data = bytearray(rank_file.read_bytes())
    data[offs_at + 8 * n: offs_at + 8 * (n + 1)] = (size + 64).to_bytes(8, "little")  # last offset: past the payloads
    with open(rank_file, "r+b") as fh:  # in place: the open trace's map sees it
        fh.write(data)
    ix._last = None
    with pytest.raises(TraceError) as err:
        t.step_records(step, 1)
    msg = str(err.value)
    assert "\n" not in msg and f"step {step}" in msg and "changed since the trace was opened" in msg
    assert str(rank_file) in msg
