"""pcpviz.views.export.chrome: valid Chrome-trace JSON, one process per rank and one lane per phase,
distributedInfo per rank file (HTA), recorded vs synthetic timestamps; ``pcpviz export``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

import pcpviz.cli.commands as cli
import pcpviz.cli.trace_commands as trace_commands
import pcpviz.trace as pt
import pcpviz.views.export.chrome as chrome_mod
from pcpviz.analysis.parallel import windowed_map
from pcpviz.views.export.chrome import SYNTHETIC_PHASE_US, chrome_trace, export_chrome
from tracegen import clean_run


def _load(path):
    with open(path) as fh:
        return json.load(fh)


def _phase_events(doc):
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"].count(" ") == 2]


def _lanes(doc, pid):
    return {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}


def test_per_rank_files_for_hta(tmp_path):
    run = clean_run(2, k=3)
    trace = pt.open(run.write(tmp_path / "t"))
    out = tmp_path / "chrome"
    written = export_chrome(trace, out)
    assert sorted(p.name for p in written) == ["rank0.json", "rank1.json"]
    assert sorted(p.name for p in out.iterdir()) == ["rank0.json", "rank1.json"]  # HTA reads every .json
    for rank in (0, 1):
        text = (out / f"rank{rank}.json").read_text()
        # HTA takes a file's rank from the first match of this regex, and reads the metadata only
        # up to "traceEvents"
        assert int(re.search(r'"rank":\s+(\d+)', text).group(1)) == rank
        assert text.index('"distributedInfo"') < text.index('"traceEvents"')
        doc = _load(out / f"rank{rank}.json")
        assert doc["distributedInfo"] == {"rank": rank, "world_size": 2}
        assert doc["otherData"]["pcpviz"]["timestamps"] == "synthetic"
        assert "synthetic" in doc["otherData"]["pcpviz"]["timestamps_note"]
        events = _phase_events(doc)
        # one event per (step, phase) of this rank, named "step S phase", pid = rank
        want = Counter((s, p) for s in trace.rank_steps(rank) for p in trace.phases(s, rank))
        got = Counter((int(e["name"].split()[1]), e["name"].split()[2]) for e in events)
        assert got == want
        assert {e["pid"] for e in doc["traceEvents"]} == {rank}
        lanes = _lanes(doc, rank)
        assert lanes == {0: "step", 1: "target", 2: "verify", 3: "draft_0", 4: "draft_1", 5: "draft_2"}
        for e in events:
            assert lanes[e["tid"]] == e["name"].split()[2]
            assert {"ph", "cat", "name", "pid", "tid", "ts", "dur", "args"} <= set(e)
            assert isinstance(e["ts"], int) and e["dur"] == SYNTHETIC_PHASE_US
        # the target event carries this rank's token counts
        s0 = trace.rank_steps(rank)[0]
        tgt = trace.record(s0, rank, "target")
        ev = next(e for e in events if e["name"] == f"step {s0} target")
        assert ev["args"]["local_tokens"] == int(tgt["per_rank_num_tokens"][rank])
        assert ev["args"]["global_tokens"] == int(tgt["num_scheduled_tokens"].sum())
        assert ev["args"]["padded_tokens"] == tgt["local_positions"].shape[0]
        # phases of a step follow each other; whole-step events span them
        steps = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"].count(" ") == 1]
        assert len(steps) == len(trace.rank_steps(rank))
        by_step = {}
        for e in sorted(events, key=lambda e: e["ts"]):
            by_step.setdefault(e["name"].split()[1], []).append(e)
        for s, evs in by_step.items():
            assert [e["name"].split()[2] for e in evs] == ["target", "verify", "draft_0", "draft_1", "draft_2"]
            assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(evs, evs[1:]))
        counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
        assert len(counters) == len(trace.rank_steps(rank))


def test_recorded_timestamps_are_used(tmp_path):
    run = clean_run(2, k=2, timestamps=True)
    trace = pt.open(run.write(tmp_path / "t"))
    doc = chrome_trace(trace, rank=1)
    assert doc["otherData"]["pcpviz"]["timestamps"] == "recorded"
    for e in _phase_events(doc):
        _, step, phase = e["name"].split()
        rec = trace.record(int(step), 1, phase)
        assert e["ts"] == pytest.approx(float(rec["t_start_us"]))
        assert e["ts"] + e["dur"] == pytest.approx(float(rec["t_end_us"]))


def test_partially_recorded_timestamps_fall_back_to_synthetic(tmp_path):
    run = clean_run(2, k=2, timestamps=True)
    del run.views(run.step_ids[1], 0, "verify")["t_start_us"]
    doc = chrome_trace(run.write(tmp_path / "t"))
    assert doc["otherData"]["pcpviz"]["timestamps"] == "synthetic"


def test_merged_file_has_every_rank(tmp_path):
    run = clean_run(4, k=1)
    path = run.write(tmp_path / "t")
    (out,) = export_chrome(path, tmp_path / "all.json")
    doc = _load(out)
    assert "distributedInfo" not in doc
    assert {e["pid"] for e in _phase_events(doc)} == {0, 1, 2, 3}
    assert _lanes(doc, 3) == {0: "step", 1: "target", 2: "verify", 3: "draft_0"}
    n_phase_records = sum(len(pt.open(path).phases(s, r)) for r in range(4) for s in pt.open(path).rank_steps(r))
    assert len(_phase_events(doc)) == n_phase_records


def test_export_into_a_file_path_that_is_not_json_is_an_error(tmp_path):
    path = clean_run(2, k=1).write(tmp_path / "t")
    (tmp_path / "out.txt").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        export_chrome(path, tmp_path / "out.txt")


# --------------------------------------------------------------------------- CLI

def pcpviz(*args):
    return subprocess.run([sys.executable, "-m", "pcpviz.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_export_chrome(tmp_path):
    path = clean_run(2, k=2).write(tmp_path / "t")
    r = pcpviz("export", str(path), "--chrome", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "rank0.json" in r.stdout and "rank1.json" in r.stdout
    assert _load(tmp_path / "out" / "rank1.json")["distributedInfo"]["rank"] == 1
    r = pcpviz("export", str(path), "--chrome", str(tmp_path / "one.json"))
    assert r.returncode == 0 and (tmp_path / "one.json").is_file()


@pytest.mark.parametrize("args,needle", [
    (["--chrome", "OUT"], "pcpviz export: "),  # not a trace
    ([], "nothing to export"),
])
def test_cli_export_bad_input_exits_2(tmp_path, args, needle):
    args = [a.replace("OUT", str(tmp_path / "o")) for a in args]
    r = pcpviz("export", str(tmp_path / "missing"), *args)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr


def test_cli_export_html_dispatch(tmp_path, capsys):
    path = clean_run(2, k=1).write(tmp_path / "t")
    rc = cli.main(["export", str(path), "--html", str(tmp_path / "r.html")])
    assert rc == 0 and (tmp_path / "r.html").exists()


def test_cli_export_dispatcher_is_extensible(tmp_path, monkeypatch, capsys):
    path = clean_run(2, k=1).write(tmp_path / "t")
    formats = dict(trace_commands.EXPORT_FORMATS)
    formats["alias"] = ("chrome again", "pcpviz.views.export.chrome:export_chrome")
    monkeypatch.setattr(trace_commands, "EXPORT_FORMATS", formats)
    assert cli.main(["export", str(path), "--alias", str(tmp_path / "x.json")]) == 0
    assert (tmp_path / "x.json").is_file()


# --------------------------------------------------------------------------- streamed in forked windows

def _export_bytes(path, out, monkeypatch, workers):
    monkeypatch.setenv("PCPVIZ_WORKERS", str(workers))
    written = export_chrome(path, out)
    return [p.read_bytes() for p in written]


@pytest.mark.parametrize("timestamps,want", [(False, "synthetic"), (True, "recorded"), ("gap", "synthetic")])
def test_forked_windows_write_what_one_process_writes(tmp_path, monkeypatch, timestamps, want):
    run = clean_run(2, k=2, timestamps=bool(timestamps))
    assert len(run.step_ids) > 8
    if timestamps == "gap":  # a late phase without times: the export starts again on the synthetic timeline
        del run.views(run.step_ids[-2], 1, "verify")["t_start_us"]
    path = run.write(tmp_path / "t")
    monkeypatch.setattr(chrome_mod, "CHUNK_STEPS", 2)  # many chunks, several windows of fork_map
    monkeypatch.setattr(chrome_mod, "WINDOW_CHUNKS", 2)
    for out in ("one.json", "dir"):
        one = _export_bytes(path, tmp_path / "w1" / out, monkeypatch, 1)
        for workers in (2, 3):
            assert _export_bytes(path, tmp_path / f"w{workers}" / out, monkeypatch, workers) == one
    assert json.loads(one[0])["otherData"]["pcpviz"]["timestamps"] == want


def test_windowed_map_is_in_order_and_raises_what_fn_raises():
    assert list(windowed_map(lambda i: i * i, 7, workers=3, window=2)) == [i * i for i in range(7)]
    assert list(windowed_map(str, 0, workers=2, window=2)) == []

    def fn(i):
        if i == 5:
            raise KeyError(i)
        return i

    got = []
    with pytest.raises(KeyError):
        for x in windowed_map(fn, 9, workers=2, window=2):
            got.append(x)
    assert got == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("value", [0, -3, 2**70, 1.5, 1e300, -0.0, "s\u00e9\"\n", [1, "a", 2.5], None, True])
def test_event_json_is_json_dumps(value):
    assert chrome_mod._json(value) == json.dumps(value, allow_nan=False)
    args = {"step": 3, "phase": "draft_0", "x": value}
    assert chrome_mod._args_json(args) == json.dumps(args, allow_nan=False)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_event_json_refuses_what_json_dumps_refuses(value):
    with pytest.raises(ValueError) as want:
        json.dumps(value, allow_nan=False)
    with pytest.raises(ValueError) as got:
        chrome_mod._json(value)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("array", [
    np.array([3, 4], dtype=np.int32), np.array([True, False, True]), np.array([], dtype=np.int64),
    np.array([2**62, 2**62], dtype=np.int64),  # NumPy's sum wraps around: the Python one must not differ
    np.array([2**63 - 1, 1, -5], dtype=np.int64), np.array([4_000_000_000] * 3, dtype=np.uint32),
    np.array([2**64 - 1, 1], dtype=np.uint64), np.array([1.5, 2.5]), np.arange(200, dtype=np.int16),
    np.array([[1, 2], [3, 4]], dtype=np.int32), np.array(7, dtype=np.int8),
])
def test_counts_are_numpys(array):
    with np.errstate(over="ignore"):
        assert chrome_mod._sum(array) == int(array.sum())
        assert chrome_mod._sum(array, as_int64=True) == int(np.asarray(array, dtype=np.int64).sum())
