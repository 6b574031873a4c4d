"""pcpviz.trace: round trips, names, the writer's validation, lazy open, and damaged traces."""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pcpviz.trace as pt
from pcpviz.trace import reader as reader_mod
from pcpviz.trace import row_views as row_views_mod
from pcpviz.trace import schema as S
from pcpviz.trace import writer as W

NUMERIC_DTYPES = ["|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8",
                  "<f2", "<f4", "<f8", "<c8", "<c16"]


def _same(a: np.ndarray, b) -> bool:
    b = np.asarray(b)
    if a.shape != b.shape:
        return False
    if a.dtype.kind in "fc" and b.dtype.kind in "fc":
        return np.array_equal(a, b, equal_nan=True)
    return np.array_equal(a, b)


def _write(run: Path, steps: dict[int, dict], rank: int = 0, meta: dict | None = None,
           close: bool = True) -> list[int]:
    """Write steps; returns the file size after the header and after each step."""
    w = pt.TraceWriter(run, rank, meta={"producer": "test"} if meta is None else meta)
    sizes = [w.path.stat().st_size]
    for step, phases in steps.items():
        w.write_step(step, phases)
        sizes.append(w.path.stat().st_size)
    if close:
        w.close()
    return sizes


def _small_step(step: int) -> dict:
    return {
        "target": {"positions": np.arange(4, dtype=np.int64) + step, "req_ids": ["a", f"r{step}"]},
        "draft_0": {"view": "rank_local", "draft_tokens": np.array([step, 1], np.int32)},
        "verify": {"num_accepted": np.array([step % 2], np.int64)},
    }


# --------------------------------------------------------------------------- round trips


def test_round_trip_every_dtype_ndim_and_layout(tmp_path):
    views = {}
    for i, dt in enumerate(NUMERIC_DTYPES):
        for ndim, shape in enumerate([(), (5,), (2, 3), (2, 0, 3), (1, 2, 3, 2)]):
            arr = (np.arange(int(np.prod(shape))) % 3 - 1).astype(dt).reshape(shape)
            views[f"v{i}_{ndim}"] = arr
    views["big_endian"] = np.arange(6, dtype=">i8").reshape(2, 3)
    views["non_contig"] = np.arange(20, dtype=np.int32).reshape(4, 5)[:, ::2].T
    views["nan"] = np.array([np.nan, 1.0, -np.inf])
    views["py_int"] = 7
    views["py_float"] = 2.5
    views["py_bool"] = True
    views["py_list"] = [[1, 2], [3, 4]]
    views["str_list"] = ["req-0", "réq-中", ""]
    views["str_2d"] = np.array([["a", "bb"], ["ccc", "d"]])
    views["str_obj"] = np.array(["x", "yy"], dtype=object)
    views["str_empty"] = np.array([], dtype=str)
    views["view"] = "rank_local"
    views["segments"] = pt.segments_table([[(0, 0, 4, 0, 4)], [(0, 4, 8, 0, 4), (1, 8, 9, 4, 5)]])
    views["nested"] = np.zeros(3, dtype=np.dtype([("a", ">i2"), ("b", "<f4", (2,)),
                                                   ("c", [("x", "u1"), ("y", "?")])], align=True))
    views["nested"]["a"] = [1, -2, 3]
    views["nested"]["b"][1] = [0.5, 1.5]
    views["nested"]["c"]["y"][2] = True
    _write(tmp_path, {3: {"target": views}})

    t = pt.open(tmp_path)
    rec = t.record(3, 0, "target")
    assert list(rec) == list(views)  # view order is kept
    for name, value in views.items():
        got, want = rec[name], np.asarray(value)
        assert _same(got, want), name
        if want.dtype.kind in "biufcV":
            assert got.dtype == want.dtype.newbyteorder("<"), name
        else:
            assert got.dtype.kind == "U", name
        assert not got.flags.writeable, name
    assert rec["view"].shape == () and str(rec["view"]) == "rank_local"
    assert rec["segments"].dtype == pt.SEGMENT_DTYPE
    assert rec["segments"]["rank"].tolist() == [0, 1, 1]
    assert rec["nested"]["c"]["y"].tolist() == [False, False, True]
    # numeric payloads are aligned zero-copy views of the mapped file
    assert rec["v4_2"].flags.aligned and not rec["v4_2"].flags.owndata


_dtypes = st.sampled_from(NUMERIC_DTYPES + [">i4", ">f8", "=u2"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_dtypes, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0,
                                                   max_side=4)), min_size=1, max_size=6),
       st.data())
def test_round_trip_property(specs, data):
    views = {f"v{i}": data.draw(hnp.arrays(np.dtype(dt), shape)) for i, (dt, shape) in enumerate(specs)}
    views["names"] = data.draw(st.lists(st.text(max_size=5), min_size=1, max_size=4))
    with tempfile.TemporaryDirectory() as tmp:
        _write(Path(tmp), {0: {"verify": views}})
        rec = pt.open(tmp).record(0, 0, "verify")
        for name, value in views.items():
            assert _same(rec[name], np.asarray(value) if name != "names" else np.array(value, dtype=str)), name
        assert rec == views


def test_many_steps_ranks_and_phase_order(tmp_path):
    k = 12  # draft_10 must sort after draft_9, not after draft_1
    def step_for(step, rank):
        phases = {"verify": {"num_accepted": np.array([step, rank])}}
        for j in reversed(range(k)):
            phases[f"draft_{j}"] = {"draft_tokens": np.array([step * 100 + j + rank])}
        phases["target"] = {"positions": np.arange(3) + step}
        return phases

    _write(tmp_path, {s: step_for(s, 0) for s in range(0, 40, 2)}, rank=0, meta={"pcp": 3})
    _write(tmp_path, {s: step_for(s, 1) for s in range(0, 42, 3)}, rank=1, meta={"pcp": 3})
    _write(tmp_path, {}, rank=2, meta={"pcp": 3})  # the same meta again: allowed
    t = pt.open(tmp_path)
    assert t.meta == {"pcpviz_trace_schema": pt.SCHEMA_VERSION, "pcp": 3}
    assert t.ranks == [0, 1, 2]
    assert t.steps == sorted(set(range(0, 40, 2)) | set(range(0, 42, 3)))
    assert t.rank_steps(2) == [] and t.files[2].closed
    assert t.phases(6, 1) == ["target"] + [f"draft_{j}" for j in range(k)] + ["verify"]
    for rank, steps in [(0, range(0, 40, 2)), (1, range(0, 42, 3))]:
        for step in steps:
            assert t.record(step, rank, "verify")["num_accepted"].tolist() == [step, rank]
            assert t.record(step, rank, "draft_10")["draft_tokens"].tolist() == [step * 100 + 10 + rank]
    assert t.has(6, 0, "draft_11") and not t.has(3, 0, "target") and not t.has(6, 7, "target")
    assert not t.has(6, 0, "draft_12")


def test_dummy_phase_and_sort_key():
    assert sorted(["verify", "draft_10", "draft_2", "target", "dummy"], key=pt.phase_sort_key) == \
        ["dummy", "target", "draft_2", "draft_10", "verify"]
    assert pt.draft_phase(3) == "draft_3" and pt.draft_index("draft_3") == 3
    assert pt.draft_index("target") is None and pt.draft_index("draft_03") is None
    for bad in ["draft_01", "draft_", "draft_-1", "Target", "prefill", "", None]:
        assert not pt.is_valid_phase(bad)
    for good in ["target", "verify", "dummy", "draft_0", "draft_12"]:
        assert pt.is_valid_phase(good)


def test_known_names_are_valid_and_documented():
    for name, doc in pt.VIEWS.items():
        assert pt.is_valid_view_name(name) and doc.strip() and "\n" not in doc
    for name in ["req_ids", "segments", "slot_mapping_gathered", "draft_tokens", "num_accepted",
                 "local_is_padding", "block_table_draft", "hidden_hash", "view"]:
        assert name in pt.KNOWN_VIEWS
    assert pt.SCHEMA_VERSION == 2 and pt.PAD_SLOT == -1
    assert list(pt.SEGMENT_DTYPE.names) == ["global_req_idx", "global_start", "global_stop",
                                           "local_start", "local_stop", "rank"]


def test_segments_table_from_layout_like_objects():
    class Seg:
        def __init__(self, *v):
            (self.global_req_idx, self.global_start, self.global_stop,
             self.local_start, self.local_stop) = v
    table = pt.segments_table([[Seg(0, 0, 2, 0, 2)], [], [Seg(1, 5, 6, 0, 1)]])
    assert table["rank"].tolist() == [0, 2] and table["global_stop"].tolist() == [2, 6]
    assert pt.segments_table([]).shape == (0,)
    with pytest.raises(ValueError, match="5 ints"):
        pt.segments_table([[(1, 2, 3)]])


def test_record_mapping_protocol_and_key_errors(tmp_path):
    _write(tmp_path, {s: _small_step(s) for s in (0, 1, 2, 5)})
    t = pt.open(tmp_path)
    rec = t.record(1, 0, "target")
    assert (rec.step, rec.rank, rec.phase) == (1, 0, "target")
    assert "positions" in rec and "nope" not in rec and len(rec) == 2
    assert set(rec.keys()) == {"positions", "req_ids"} and rec.get("nope") is None
    assert rec["req_ids"].tolist() == ["a", "r1"]
    assert rec == {"req_ids": ["a", "r1"], "positions": [1, 2, 3, 4]}
    assert rec != {"req_ids": ["a", "r1"], "positions": [1, 2, 3, 5]}
    assert rec != t.record(2, 0, "target")
    assert "positions: <i8[4]" in repr(rec)
    with pytest.raises(KeyError, match="view 'nope'.*step 1.*positions, req_ids"):
        rec["nope"]
    with pytest.raises(KeyError, match="step 3 not recorded on rank 0.*0-2, 5"):
        t.record(3, 0, "target")
    with pytest.raises(KeyError, match=r"no rank 4 .*\[0\]"):
        t.record(1, 4, "target")
    with pytest.raises(KeyError, match="phase 'draft_1' not recorded at step 1 on rank 0 "
                                       r"\(phases: target, draft_0, verify\)"):
        t.record(1, 0, "draft_1")
    with pytest.raises(KeyError):
        t.phases(3, 0)
    assert t.record(1, 0, "target") is rec  # cached
    with pytest.raises(ValueError):
        rec["positions"][0] = 1  # read-only
    assert t.verify() == 12
    assert "steps=0-2, 5" in repr(t)


def test_open_accepts_run_json_path_and_live_trace(tmp_path):
    w = pt.TraceWriter(tmp_path, 0, meta={"producer": "live"})
    w.write_step(0, _small_step(0))
    w.write_step(1, _small_step(1))
    t = pt.open(tmp_path / "run.json")  # writer still open: no end-of-stream marker yet
    assert t.steps == [0, 1] and not t.warnings and not t.files[0].closed
    w.write_step(2, _small_step(2))
    w.close()
    t = pt.open(str(tmp_path), strict=True)
    assert t.steps == [0, 1, 2] and t.files[0].closed
    assert t.files[0].good_bytes == t.files[0].size


# --------------------------------------------------------------------------- laziness


def test_open_is_lazy_and_cache_is_bounded(tmp_path, monkeypatch):
    steps = {s: {"target": {"positions": np.arange(64) + s, "input_ids": np.arange(64) * s,
                            "req_ids": ["a", "b"], "segments": pt.segments_table([[(0, 0, 1, 0, 1)]])},
                 "draft_0": {"draft_tokens": np.arange(4)},
                 "verify": {"num_accepted": np.array([s])}} for s in range(200)}
    _write(tmp_path, steps)
    calls = []
    real = reader_mod.zlib.crc32  # every payload decoded is crc-checked: two crc32 calls (head, bytes)
    monkeypatch.setattr(reader_mod, "zlib", SimpleNamespace(crc32=lambda *a: calls.append(1) or real(*a)))
    t = pt.open(tmp_path, cache_size=2)
    assert len(t.steps) == 200 and calls == []  # open decodes no payload
    t.record(150, 0, "target")
    assert len(calls) == 2 * 4  # exactly the record's views
    t.record(150, 0, "target")
    assert len(calls) == 2 * 4  # cached
    t.record(1, 0, "verify")
    t.record(2, 0, "verify")  # evicts step 150 (cache_size=2)
    t.record(150, 0, "target")
    assert len(calls) == 2 * 10


# --------------------------------------------------------------------------- writer validation


def test_run_meta(tmp_path):
    path = pt.write_run_meta(tmp_path / "a", {"producer": "x", "pcp": np.int64(2),
                                              "sizes": np.arange(3), "model": tmp_path})
    doc = json.loads(path.read_text())
    assert doc == {"pcpviz_trace_schema": pt.SCHEMA_VERSION, "producer": "x", "pcp": 2, "sizes": [0, 1, 2],
                   "model": str(tmp_path)}
    assert [p.name for p in path.parent.iterdir()] == ["run.json"]  # no temp file left
    with pytest.raises(ValueError, match="pcpviz_trace_schema=3"):
        pt.write_run_meta(tmp_path / "a", {"pcpviz_trace_schema": 3})  # a version this pcpviz does not know
    # an older trace's meta (its records read in today's meaning) is written as today's version
    assert json.loads(pt.write_run_meta(tmp_path / "b", {"pcpviz_trace_schema": 1, "x": 1}).read_text()) == \
        {"pcpviz_trace_schema": pt.SCHEMA_VERSION, "x": 1}
    with pytest.raises(ValueError, match="not JSON"):
        pt.write_run_meta(tmp_path / "a", {"x": object()})
    with pytest.raises(ValueError):
        pt.write_run_meta(tmp_path / "a", ["not", "a", "dict"])
    assert json.loads(path.read_text())["producer"] == "x"  # failed writes left it intact


def test_writers_without_meta_never_clobber_meta(tmp_path):
    pt.TraceWriter(tmp_path / "a", 1).close()  # a placeholder run.json
    assert pt.open(tmp_path / "a").meta == {"pcpviz_trace_schema": pt.SCHEMA_VERSION}
    pt.TraceWriter(tmp_path / "a", 0, meta={"producer": "p"}).close()
    pt.TraceWriter(tmp_path / "b", 0, meta={"producer": "p"}).close()
    pt.TraceWriter(tmp_path / "b", 1).close()
    for run in ("a", "b"):
        assert pt.open(tmp_path / run).meta["producer"] == "p"


@pytest.mark.parametrize("phases, match", [
    ({}, "step 5: phases must be a non-empty dict"),
    ([("target", {})], "step 5: phases must be"),
    ({"prefill": {"x": 1}}, "step 5: phase 'prefill' is not valid"),
    ({"draft_01": {"x": 1}}, "phase 'draft_01' is not valid"),
    ({"target": {}}, "step 5: phase 'target': views must be a non-empty dict"),
    ({"target": {"Positions": 1}}, "step 5: phase 'target': view name 'Positions'"),
    ({"target": {"1x": 1}}, "view name '1x'"),
    ({"verify": {"ok": 1}, "target": {"when": np.array(["2020-01-01"], "datetime64[D]")}},
     "step 5: phase 'target': view 'when': dtype '<M8\\[D\\]' is not supported"),
    ({"target": {"mixed": [1, "a"]}}, "view 'mixed': holds int 1"),
    ({"target": {"obj": np.array([None], dtype=object)}}, "view 'obj': holds NoneType"),
    ({"target": {"raw": np.array([b"ab"])}}, "view 'raw': dtype '|S2' is not supported"),
    ({"target": {"ragged": [[1], [2, 3]]}}, "view 'ragged': cannot convert list to a NumPy array"),
    ({"target": {"d": {"a": 1}}}, "view 'd'"),
])
def test_write_step_rejects_bad_input_without_writing(tmp_path, phases, match):
    w = pt.TraceWriter(tmp_path, 0)
    w.write_step(4, _small_step(4))
    size = w.path.stat().st_size
    with pytest.raises(ValueError, match=match):
        w.write_step(5, phases)
    assert w.path.stat().st_size == size and w.last_step == 4
    w.write_step(5, _small_step(5))  # the writer is still usable
    w.close()
    assert pt.open(tmp_path, strict=True).steps == [4, 5]


def test_write_step_order_and_lifecycle(tmp_path):
    with pt.TraceWriter(tmp_path, 0) as w:
        w.write_step(3, _small_step(3))
        for bad in (3, 2):
            with pytest.raises(ValueError, match=f"step {bad}: steps must strictly increase.*3"):
                w.write_step(bad, _small_step(0))
        for bad in (True, 1.5, "4"):
            with pytest.raises(ValueError, match="step must be an int"):
                w.write_step(bad, _small_step(0))
        w.write_step(np.int64(9), _small_step(9))
    assert w.closed
    with pytest.raises(ValueError, match="closed"):
        w.write_step(10, _small_step(10))
    w.close()  # idempotent
    with pytest.raises(FileExistsError, match="rank0.arrow: already exists"):
        pt.TraceWriter(tmp_path, 0)
    with pytest.raises(ValueError, match="rank must be"):
        pt.TraceWriter(tmp_path, -1)
    pt.TraceWriter(tmp_path, 0, overwrite=True, fsync=True).close()
    assert pt.open(tmp_path).steps == []


# --------------------------------------------------------------------------- damaged traces


def _trace_error(path, match: str, strict: bool = False) -> str:
    with pytest.raises(pt.TraceError) as info:
        pt.open(path, strict=strict)
    msg = str(info.value)
    assert match in msg, msg
    assert "\n" not in msg and isinstance(info.value, ValueError)
    return msg


def test_run_json_problems(tmp_path):
    _write(tmp_path, {0: _small_step(0)})
    meta = tmp_path / "run.json"
    meta.write_text("{not json")
    _trace_error(tmp_path, f"{meta}: not valid JSON")
    meta.write_text("[1, 2]")
    _trace_error(tmp_path, f"{meta}: not a pcpviz trace (top level is a list")
    meta.write_text('{"producer": "x"}')
    _trace_error(tmp_path, f"{meta}: not a pcpviz trace (missing 'pcpviz_trace_schema')")
    meta.write_text('{"pcpviz_trace_schema": 3}')
    _trace_error(tmp_path, f"{meta}: schema version 3 is newer than this pcpviz (2); upgrade pcpviz")
    meta.write_text('{"pcpviz_trace_schema": ' + "9" * 5000 + '}')
    _trace_error(tmp_path, f"{meta}: not valid JSON")
    meta.write_text('{"pcpviz_trace_schema": "' + "9" * 5000 + '"}')
    _trace_error(tmp_path, f"{meta}: pcpviz_trace_schema must be an int, got '99999")
    meta.write_text('{"pcpviz_trace_schema": 1}')  # a version-1 run.json over version-2 rank files
    _trace_error(tmp_path, "rank0.arrow: schema version 2 but run.json says 1 (a file of another run?)")
    meta.write_text('{"pcpviz_trace_schema": "x"}')
    _trace_error(tmp_path, f"{meta}: pcpviz_trace_schema must be an int")
    meta.write_bytes(b"\xff\xfe")
    _trace_error(tmp_path, f"{meta}: not valid JSON")
    meta.write_text('{"pcpviz_trace_schema": 1, "pcp": 2, "pcp": 7}')
    _trace_error(tmp_path, f"{meta}: not valid JSON (duplicate key 'pcp')")
    meta.unlink()
    _trace_error(tmp_path, f"{tmp_path}: no run.json")
    _trace_error(tmp_path / "nowhere", f"{tmp_path / 'nowhere'}: no such run directory")
    _trace_error(tmp_path / "rank0.arrow", "rank0.arrow: not a run directory")


def _raw_rank_file(path: Path, schema: pa.Schema, batches: list[pa.RecordBatch]) -> None:
    with pa.ipc.new_stream(str(path), schema) as out:
        for b in batches:
            out.write_batch(b)


def test_rank_file_identity_problems(tmp_path):
    _write(tmp_path, {0: _small_step(0)})
    rank0 = tmp_path / "rank0.arrow"
    good = rank0.read_bytes()

    schema = S.ARROW_SCHEMA.with_metadata({"pcpviz_trace_schema": "3", "rank": "0"})
    _raw_rank_file(rank0, schema, [])
    _trace_error(tmp_path, f"{rank0}: schema version 3 is newer than this pcpviz (2); upgrade pcpviz")

    _raw_rank_file(rank0, S.ARROW_SCHEMA, [])
    _trace_error(tmp_path, f"{rank0}: not a pcpviz rank file (Arrow schema metadata lacks "
                           "'pcpviz_trace_schema')")

    other = pa.schema([("x", pa.int64())], metadata={"pcpviz_trace_schema": str(S.SCHEMA_VERSION), "rank": "0"})
    _raw_rank_file(rank0, other, [pa.record_batch([pa.array([1])], schema=other)])
    _trace_error(tmp_path, f"{rank0}: unexpected columns (x:int64)")

    rank0.unlink()
    (tmp_path / "rank1.arrow").write_bytes(good)
    _trace_error(tmp_path, f"{tmp_path / 'rank1.arrow'}: schema metadata says rank '0' but the "
                           "file name says rank 1")


@pytest.mark.parametrize("content", [
    b"\x89PNG\r\n\x1a\n" + bytes(200),
    json.dumps({"pcpviz_trace_schema": 1}).encode(),
    b"\xff\xff\xff\xff\xff\xff\xff\xff" + bytes(64),
    b"\xff\xff\xff\xff\x10\x00\x00\x00" + bytes(64),
    b"x",
])
def test_foreign_file(tmp_path, content):
    _write(tmp_path, {0: _small_step(0)})
    (tmp_path / "rank0.arrow").write_bytes(content)
    for strict in (False, True):
        _trace_error(tmp_path, f"{tmp_path / 'rank0.arrow'}: not an Arrow IPC stream (foreign file)",
                     strict)


def test_arrow_ipc_file_format_is_foreign(tmp_path):
    _write(tmp_path, {0: _small_step(0)})
    table = pa.table({"a": [1, 2]})
    with pa.ipc.new_file(str(tmp_path / "rank0.arrow"), table.schema) as out:
        out.write_table(table)
    _trace_error(tmp_path, "rank0.arrow: an Arrow IPC file, not an Arrow IPC stream (foreign file)")


@pytest.mark.slow
def test_every_truncation_keeps_the_complete_prefix(tmp_path):
    src = tmp_path / "src"
    steps = {s: _small_step(s) for s in range(4)}
    sizes = _write(src, steps)  # header end, then the end of each step
    full = (src / "rank0.arrow").read_bytes()
    assert len(full) == sizes[-1] + 8  # + end-of-stream marker
    run = tmp_path / "cut"
    run.mkdir()
    (run / "run.json").write_bytes((src / "run.json").read_bytes())
    rank0 = run / "rank0.arrow"
    # every byte of the schema header, every step boundary +-2, and a stride in between
    cuts = set(range(sizes[0] + 1)) | set(range(0, len(full) + 1, 5))
    cuts |= {b + d for b in sizes + [len(full)] for d in (-2, -1, 0, 1, 2) if 0 <= b + d <= len(full)}
    for cut in sorted(cuts):
        rank0.write_bytes(full[:cut])
        complete = [s for s, end in zip(steps, sizes[1:]) if end <= cut]
        clean = cut in sizes or cut == len(full)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = pt.open(run)
        assert t.ranks == [0], cut
        assert t.rank_steps(0) == complete, cut
        assert bool(t.warnings) == (not clean), cut
        assert [str(w.message) for w in caught] == t.warnings
        if t.warnings:
            note = t.warnings[0]
            last = f"step {complete[-1]}" if complete else "no complete step"
            assert note.startswith(f"{rank0}: ") and f"last complete step: {last}" in note, note
            assert all(issubclass(w.category, pt.TraceWarning) for w in caught)
            _trace_error(run, f"{rank0}: ", strict=True)
        else:
            assert pt.open(run, strict=True).rank_steps(0) == complete
        for s in complete:
            for phase, views in steps[s].items():
                assert t.record(s, 0, phase) == views, (cut, s, phase)
        if cut < sizes[0]:
            assert complete == [] and ("schema header" in t.warnings[0] or cut == 0 or "empty" in t.warnings[0])


def test_trailing_garbage_after_end_of_stream(tmp_path):
    _write(tmp_path, {0: _small_step(0), 1: _small_step(1)})
    rank0 = tmp_path / "rank0.arrow"
    rank0.write_bytes(rank0.read_bytes() + b"junk")
    with pytest.warns(pt.TraceWarning, match="4 bytes after the end-of-stream marker"):
        t = pt.open(tmp_path)
    assert t.steps == [0, 1]
    _trace_error(tmp_path, f"{rank0}: 4 bytes after the end-of-stream marker", strict=True)


def test_corrupt_payload_is_caught_on_decode(tmp_path):
    steps = {s: {"target": {"positions": np.full(64, 1000 + s, dtype=np.int64)}} for s in range(5)}
    _write(tmp_path, steps)
    rank0 = tmp_path / "rank0.arrow"
    raw = bytearray(rank0.read_bytes())
    needle = np.full(64, 1002, dtype=np.int64).tobytes()
    at = raw.index(needle) + 100
    raw[at] ^= 0x40
    rank0.write_bytes(bytes(raw))
    t = pt.open(tmp_path, strict=True)  # the structure is intact
    assert t.steps == list(range(5))
    with pytest.raises(pt.TraceError, match=f"{rank0}: step 2: view 'positions' \\(phase 'target'\\)"
                                            ": corrupt data \\(crc32 mismatch\\)"):
        t.record(2, 0, "target")
    assert t.record(3, 0, "target") == steps[3]["target"]
    with pytest.raises(pt.TraceError, match="step 2"):
        t.verify()


def test_lazy_record_checks_every_row_and_decodes_what_is_read(tmp_path, monkeypatch):
    steps = {s: {"target": {"positions": np.full(64, 1000 + s, dtype=np.int64), "req_ids": ["a", "b"],
                            "seq_lens": np.array([3 + s, 4], dtype=np.int32)}} for s in range(5)}
    _write(tmp_path, steps)
    rank0 = tmp_path / "rank0.arrow"
    t = pt.open(tmp_path)
    calls = []
    real = row_views_mod.decode_row
    monkeypatch.setattr(row_views_mod, "decode_row", lambda ix, layout, j, **kw: calls.append(layout.views[j])
                        or real(ix, layout, j, **kw))
    rec = t.lazy_record(3, 0, "target")
    assert calls == [] and set(rec) == {"positions", "req_ids", "seq_lens"} and "seq_lens" in rec
    assert rec["seq_lens"].tolist() == [6, 4] and calls == []  # a numeric row that fits: a view of the map
    assert rec["req_ids"].tolist() == ["a", "b"] and calls == ["req_ids"]  # a string row: parsed when read
    assert rec["req_ids"].tolist() == ["a", "b"] and calls == ["req_ids"]  # once
    assert rec == t.record(3, 0, "target") == steps[3]["target"]
    assert not rec["positions"].flags.writeable
    with pytest.raises(KeyError, match="not recorded at step 3"):
        rec["input_ids"]
    raw = bytearray(rank0.read_bytes())  # a damaged payload the caller never reads still raises
    raw[raw.index(np.full(64, 1002, dtype=np.int64).tobytes()) + 100] ^= 0x40
    rank0.write_bytes(bytes(raw))
    t = pt.open(tmp_path, strict=True)
    with pytest.raises(pt.TraceError, match="step 2: view 'positions' \\(phase 'target'\\): corrupt data"):
        t.lazy_record(2, 0, "target")
    with pytest.raises(KeyError, match="phase 'verify' not recorded at step 2"):
        t.lazy_record(2, 0, "verify")
    peek = t.lazy_record(2, 0, "target", check_unread=False)  # a row checked when it is read, only then
    assert peek["seq_lens"].tolist() == [5, 4] and peek["req_ids"].tolist() == ["a", "b"]
    with pytest.raises(pt.TraceError, match="step 2: view 'positions' \\(phase 'target'\\): corrupt data"):
        peek["positions"]


def test_view_names_come_from_the_index_without_reading_a_payload(tmp_path, monkeypatch):
    steps = {s: {"target": {"positions": np.arange(4 + s), "req_ids": ["a"]},
                 **({"draft_0": {"fwd_input_ids": np.arange(2)}} if s == 2 else {})} for s in range(4)}
    _write(tmp_path, steps)
    rank0 = tmp_path / "rank0.arrow"
    raw = bytearray(rank0.read_bytes())  # step 1's positions damaged: its names still read, its record not
    raw[raw.index(np.arange(5).tobytes()) + 9] ^= 0x40
    rank0.write_bytes(bytes(raw))
    t = pt.open(tmp_path)
    monkeypatch.setattr(reader_mod.zlib, "crc32", lambda *a: pytest.fail("a payload was read"))
    assert t.view_names(1, 0, "target") == {"positions", "req_ids"}
    assert t.view_names(2, 0, "draft_0") == {"fwd_input_ids"}
    assert t.views_anywhere("draft_0") == {"fwd_input_ids"} and t.views_anywhere("verify") == frozenset()
    assert t.views_anywhere("target") == {"positions", "req_ids"}
    with pytest.raises(KeyError, match="phase 'draft_0' not recorded at step 3 on rank 0"):
        t.view_names(3, 0, "draft_0")
    with pytest.raises(KeyError, match="step 9 not recorded on rank 0"):
        t.view_names(9, 0, "target")
    monkeypatch.undo()
    with pytest.raises(pt.TraceError, match="step 1: view 'positions'.*crc32 mismatch"):
        t.record(1, 0, "target")


def test_damage_in_the_middle_keeps_the_steps_before_it(tmp_path):
    sizes = _write(tmp_path, {s: _small_step(s) for s in range(5)})
    rank0 = tmp_path / "rank0.arrow"
    raw = bytearray(rank0.read_bytes())
    at = raw.index(b"draft_0", sizes[2], sizes[3])  # a phase name inside step 2's batch
    raw[at + 6] = ord("1")  # "draft_0" -> "draft_1": still a valid name; only the checksum knows
    rank0.write_bytes(bytes(raw))
    with pytest.warns(pt.TraceWarning, match="index checksum mismatch"):
        t = pt.open(tmp_path)
    assert t.steps == [0, 1] and t.record(1, 0, "draft_0") == _small_step(1)["draft_0"]
    assert "last complete step: step 1" in t.warnings[0]
    _trace_error(tmp_path, f"{rank0}: corrupt record batch at byte {sizes[2]}", strict=True)


@pytest.mark.slow
def test_any_single_byte_corruption_is_an_error_or_harmless(tmp_path):
    """Flip bytes of a small trace, one at a time. Damage to the schema header is an error;
    damage after it never fails open: the steps before it are kept (with a warning) and a
    damaged payload fails its checksum when decoded. Never is wrong data returned."""
    src = tmp_path / "src"
    steps = {s: _small_step(s) for s in range(3)}
    steps[1]["target"]["segments"] = pt.segments_table([[(0, 0, 1, 0, 1)], [(0, 1, 2, 0, 1)]])
    sizes = _write(src, steps)
    full = (src / "rank0.arrow").read_bytes()
    run = tmp_path / "bad"
    run.mkdir()
    (run / "run.json").write_bytes((src / "run.json").read_bytes())
    rank0 = run / "rank0.arrow"
    outcomes = {"open error": 0, "decode error": 0, "dropped": 0, "harmless": 0}
    for at in range(len(full)):
        raw = bytearray(full)
        raw[at] ^= 0x01 if at % 2 else 0xA5
        rank0.write_bytes(bytes(raw))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = pt.open(run)
        except pt.TraceError as exc:
            assert at < sizes[0], (at, str(exc))  # only the schema header is vital
            assert str(exc).startswith(f"{rank0}: "), (at, str(exc))
            outcomes["open error"] += 1
            continue
        kept = t.rank_steps(0)
        assert kept == list(range(len(kept))), at
        assert bool(t.warnings) == (kept != list(steps)) or at >= sizes[-1], at
        try:
            for step in kept:
                for phase in t.phases(step, 0):
                    assert t.record(step, 0, phase) == steps[step][phase], (at, step, phase)
        except pt.TraceError as exc:
            assert str(exc).startswith(f"{rank0}: step "), (at, str(exc))
            outcomes["decode error"] += 1
            continue
        outcomes["dropped" if t.warnings else "harmless"] += 1
    # every path was exercised
    assert min(outcomes.values()) > 0, outcomes


def _raw_trace(tmp_path: Path, rows_by_step: list[tuple[int, list[tuple[str, str, S.Encoded]]]]) -> Path:
    """A rank file written from raw rows (bypassing the writer's validation)."""
    pt.write_run_meta(tmp_path, {"producer": "raw"})
    path = tmp_path / "rank0.arrow"
    parts = [S.arrow_schema(0).serialize().to_pybytes()]
    for step, rows in rows_by_step:
        parts.append(W._build_batch(step, rows).serialize().to_pybytes())
    path.write_bytes(b"".join(parts))
    return path


def _enc(value) -> S.Encoded:
    return S.encode_value(value)


def test_content_problems_name_file_and_step(tmp_path):
    ok = [("target", "positions", _enc(np.arange(3)))]
    cases = [
        ([(7, ok), (7, ok)], "step 7: duplicate step (also record batch #0)"),
        ([(7, ok), (5, ok)], "step 5: comes after step 7; steps must increase"),
        ([(7, [("bogus", "positions", _enc([1]))])], "step 7: phase 'bogus' is not a valid phase"),
        ([(7, [("target", "Bad-Name", _enc([1]))])], "step 7: view name 'Bad-Name' is not an identifier"),
        ([(7, [("target", "positions", S.Encoded("foo", (3,), memoryview(bytes(24))))])],
         "step 7: view 'positions' has dtype 'foo' not understood (phase 'target')"),
        ([(7, [("target", "positions", S.Encoded("<i8", (4,), memoryview(bytes(24))))])],
         "step 7: view 'positions' holds 24 bytes, expected 32 for <i8 [4]"),
        ([(7, ok + ok)], "step 7: view 'positions' appears twice in phase 'target'"),
    ]
    for i, (rows, match) in enumerate(cases):
        run = tmp_path / str(i)
        path = _raw_trace(run, rows)
        for strict in (False, True):
            _trace_error(run, f"{path}: {match}", strict)


def test_bad_string_payload_is_reported_on_decode(tmp_path):
    path = _raw_trace(tmp_path, [(1, [("verify", "req_ids", S.Encoded("str", (3,), memoryview(b'["a"]')))])])
    t = pt.open(tmp_path)
    with pytest.raises(pt.TraceError, match=f"{path}: step 1: view 'req_ids' .*not a list of 3 strings"):
        t.record(1, 0, "verify")


def test_no_rank_files_and_unrelated_files(tmp_path):
    pt.write_run_meta(tmp_path, {"producer": "none"})
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "rank01.arrow").write_text("not a canonical rank file name; ignored")
    t = pt.open(tmp_path)
    assert t.ranks == [] and t.steps == [] and t.warnings == []


def test_a_string_payload_nested_deep_is_a_one_line_trace_error(tmp_path, monkeypatch):
    """A string payload (valid crc) nested 100,000 deep is refused by the depth guard, never
    recursed into (a RecursionError would also upset CPython's AST counter afterwards)."""
    import ast

    orig = S.encode_value

    def deep(value):
        e = orig(value)
        return S.Encoded("str", e.shape, memoryview(b"[" * 100_000 + b"]" * 100_000)) if e.tag == "str" else e

    monkeypatch.setattr(S, "encode_value", deep)
    with pt.TraceWriter(tmp_path, 0, meta={"producer": "x", "pcp": 1, "block_size": 16}) as w:
        w.write_step(0, {"target": {"req_ids": np.array(["a", "b"]), "positions": np.arange(3)}})
    monkeypatch.undo()
    t = pt.open(tmp_path)
    with pytest.raises(pt.TraceError) as e:
        t.record(0, 0, "target")
    assert "nested too deeply" in str(e.value) and "\n" not in str(e.value) and "req_ids" in str(e.value)
    ast.parse("x = " + "[" * 50 + "]" * 50)  # the interpreter is still fine
