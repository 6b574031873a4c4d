"""Issue 35: the recorder's device ring, what the draft forwards consumed, and FULL-replayed draft
phases, through vLLM 0.33.0's own classes on CPU (``pcpviz.vllm.replay``: stand-in models and
stand-in FULL graphs, declared there). The ring's code is the same on a GPU (device-agnostic torch
ops; only the event and the pinned side-stream copy are CUDA-only: the ``gpu`` test below)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

import pcpviz.trace as pt  # noqa: E402
from pcpviz.analysis.checks import run_checks  # noqa: E402
from pcpviz.vllm import recording  # noqa: E402
from pcpviz.vllm.recording import patching  # noqa: E402
from pcpviz.vllm.recording.ring import DeviceRing  # noqa: E402
from pcpviz.vllm.replay import replay  # noqa: E402
from pcpviz.vllm.replay.stand_ins import StandInMTP  # noqa: E402


def test_ring_spans_wrap_and_overflow():
    ring = DeviceRing(64)
    ring.ensure(torch.device("cpu"))
    assert ring.reserve(20) == 0 and ring.reserve(4) == 24  # aligned to 8
    first = ring.finish()
    assert first == (0, 28)
    assert ring.reserve(24) == 32 and ring.finish() == (32, 56)
    # the next step does not fit before the end, nor at the start while step 0 is undrained
    assert ring.reserve(16) is None and ring.finish() is None and ring.overflow_steps == 1
    ring.release(first)  # the drain copied step 0 out: the start is free again
    ring.buf[56:64] = 7
    assert ring.reserve(4) == 56 and ring.reserve(8) is not None  # moved to the ring's start with its bytes
    assert ring.start == 0 and bytes(ring.buf[:4].tolist()) == b"\x07" * 4
    span = ring.finish()
    assert span == (0, 16)
    assert ring.reserve(100) is None and ring.finish() is None and ring.overflow_steps == 2  # larger than the ring


def test_step_pack_copies_into_the_ring_once_per_dtype_and_reads_back():
    from pcpviz.vllm.recording.host import Fresh, StepPack

    pack = StepPack(DeviceRing(1 << 12))
    phase: dict = {}
    a, b = torch.arange(6, dtype=torch.int64).view(2, 3), torch.arange(5, dtype=torch.int32)
    pack.put(phase, {"a": a[:, 1:], "b": b, "c": np.arange(3), "f": Fresh(torch.ones(2, dtype=torch.int64))})
    a.fill_(-1)  # vLLM overwrites its buffer after the hook: the copy holds the hook's moment
    staged = pack.stage({"p": phase})
    out = staged.resolve()["p"]
    assert out["a"].tolist() == [[1, 2], [4, 5]] and out["b"].tolist() == [0, 1, 2, 3, 4]
    assert out["f"].tolist() == [1, 1] and out["c"].tolist() == [0, 1, 2]
    assert not pack.ring.spans and pack.ring.start == 0  # drained: the span went back


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    return (replay(pcp=1, mtp=2, trace_dir=d / "full", scenario="mixed", graph_mode="FULL_DECODE_ONLY"),
            replay(pcp=1, mtp=2, scenario="mixed", graph_mode="FULL_DECODE_ONLY", record=False))


@pytest.mark.slow
def test_full_replayed_draft_phases_carry_views_and_pass_the_checks(full):
    run, _ = full
    t = run.trace
    seen = {}
    for step in t.steps:
        for ph in t.phases(step, 0):
            if ph.startswith("draft_"):
                rec = t.record(step, 0, ph)
                seen.setdefault((str(rec["graph_mode"]), str(rec.get("fwd_source"))), []).append((step, ph))
                if str(rec["graph_mode"]) == "FULL":
                    for view in ("draft_input_ids", "draft_positions", "fwd_positions", "fwd_input_ids",
                                 "hidden_in_fp", "fwd_hidden_fp", "draft_tokens"):
                        assert view in rec, (step, ph, view)
    assert ("FULL", "graph_buffers") in seen and ("NONE", "model_call") in seen
    assert any(ph == "draft_0" for _, ph in seen[("FULL", "graph_buffers")])  # a FULL draft prefill
    report = run_checks(t)
    assert report.ok, report.format()
    for name in ("forward_consumed_prepared", "draft_input_ids", "draft_positions_advance", "hidden_handoffs"):
        assert name not in report.skipped, name


@pytest.mark.slow
def test_recording_full_replays_does_not_change_results(full):
    on, off = full
    for a, b in zip(on.steps, off.steps):
        assert np.array_equal(a[0].draft_tokens, b[0].draft_tokens)
        assert np.array_equal(a[0].slot_mapping_gathered, b[0].slot_mapping_gathered)
    for x, y in zip(on.kv_draft + on.kv_target, off.kv_draft + off.kv_target):
        assert np.array_equal(x, y)


def _shift_first_draft_positions(monkeypatch):
    """Plant the bug: the first draft forward of every propose hands RoPE its positions + 1 (the
    speculator's buffers stay right). Planted outside the recorder's model wrapper, where vLLM's
    ``_run_model`` would compute the argument."""
    patching.install_model_wrapper(StandInMTP.__new__(StandInMTP))  # the recorder's wrapper first (inner)
    inner = StandInMTP.__call__

    def planted(self, *args, **kwargs):
        frame, first = sys._getframe(1), False
        while frame is not None:
            if frame.f_code.co_name in ("_prefill", "_generate_draft"):
                first = frame.f_code.co_name == "_prefill"
                break
            frame = frame.f_back
        if first:
            kwargs = {**kwargs, "positions": kwargs["positions"] + 1}
        return inner(self, *args, **kwargs)

    planted._pcpviz_wrapper = True  # the recorder does not wrap it again (its wrapper stays inside)
    planted._pcpviz_original = inner
    monkeypatch.setattr(StandInMTP, "__call__", planted)


@pytest.mark.slow
@pytest.mark.parametrize("pcp", [1, 2])
def test_positions_shifted_on_their_way_to_rope_fail_at_draft_0(tmp_path, monkeypatch, pcp):
    _shift_first_draft_positions(monkeypatch)
    # the weightless stand-in MTP (models="scripted") is where the bug is planted; the recorder's
    # wrapper is the same for the tiny model's
    run = replay(pcp=pcp, mtp=2, trace_dir=tmp_path / "bug", scenario="mixed", models="scripted")
    report = run_checks(run.trace)
    v = report["forward_consumed_prepared"].first_violation
    assert v is not None, report.format()
    assert (v.phase, v.view) == ("draft_0", "fwd_positions")
    assert "consumed other positions" in v.message and v.index is not None
    assert v.actual.startswith(f"[{v.index[0]}") and "*" in v.actual  # e.g. "[0:5]=[*1, 2, 3, 4, 5]" vs "*0, ..."
    # the prepared views alone pass the draft checks at draft_0: only the consumed ones see it there
    for name in ("draft_input_ids", "draft_prefill_rank_local", "draft_last_token_indices"):
        first = report[name].first_violation
        assert first is None or first.phase != "draft_0", (name, first)


@pytest.mark.slow
def test_a_tiny_device_ring_drops_steps_and_the_trace_says_so(tmp_path, monkeypatch, caplog):
    # 7864 bytes: the scenario's steps take 5.6 to 8.3 kB of the ring (the hidden rows fingerprinted by the
    # drain included); the largest do not fit
    monkeypatch.setenv("PCPVIZ_DEVICE_RING_MB", "0.0075")
    run = replay(pcp=1, mtp=2, trace_dir=tmp_path / "t", scenario="mixed", dummy=False, models="scripted")
    meta = json.loads((tmp_path / "t" / "run.json").read_text())
    lost = meta["device_ring_overflow"]
    assert lost["ring_bytes"] == 7864 and 1 <= lost["steps"] < len(run.steps)
    ending = json.loads((tmp_path / "t" / "complete.json").read_text())["ranks"]["0"]
    assert ending["status"] == "partial" and "device ring overflow" in ending["reason"]
    report = run_checks(pt.open(tmp_path / "t"))
    assert not report.complete and "device ring overflow" in report.format()
    assert len(run.trace.steps) + lost["steps"] == len(run.steps)  # every step written or counted
    assert any("device ring" in r.message for r in caplog.records)


@pytest.mark.gpu
def test_full_replayed_draft_phase_carries_views_on_real_vllm(tmp_path):
    """Real vLLM 0.33.0 on one GPU, FULL_AND_PIECEWISE, PCP=1, K=2: the draft phases replayed as
    FULL graphs carry their views, read from the graph's captured buffers."""
    from pcpviz.vllm.launch import run

    trace, _ = run("data/models/pcpviz-tiny-dsv3", ["def add(a, b):\n    return", "import os\n"], pcp=1,
                   num_speculative_tokens=2, trace_dir=tmp_path / "t", max_tokens=16,
                   cudagraph_mode="FULL_AND_PIECEWISE")
    full = [(s, ph) for s in trace.steps for ph in trace.phases(s, 0) if ph.startswith("draft_")
            and str(trace.record(s, 0, ph).get("graph_mode")) == "FULL"]
    assert full
    for s, ph in full:
        rec = trace.record(s, 0, ph)
        assert str(rec["fwd_source"]) in ("graph_capture", "graph_buffers")
        assert {"draft_positions", "fwd_positions", "fwd_input_ids", "hidden_in_fp"} <= set(rec)
    assert run_checks(trace).ok
    assert recording is not None


def test_one_copy_of_mixed_dtypes_strided_columns_and_host_fingerprints_resolves_exactly():
    """A put of int64 / int32 / bool / bf16 tensors, a strided column and an expanded view (one
    byte-level copy), and rows fingerprinted by the drain, resolve to the tensors' values; the
    host fingerprints equal the device ones."""
    from pcpviz.trace.fingerprints import row_fingerprints
    from pcpviz.vllm.recording.host import StepPack, fingerprint_view
    from pcpviz.vllm.recording.ring import DeviceRing

    pack = StepPack(DeviceRing(1 << 16))
    a = torch.arange(12, dtype=torch.int64).view(4, 3)
    hidden = torch.randn(3, 8).to(torch.bfloat16)
    views = {"col": a[:, 1], "i32": torch.arange(5, dtype=torch.int32), "mask": torch.tensor([True, False, True]),
             "wide": torch.tensor([7], dtype=torch.int64).expand(4), "h": hidden, "fp": fingerprint_view(hidden)}
    phase: dict = {}
    with pack.hold():
        pack.put(phase, views)
    assert len(pack.layout) == 1  # one copy for the whole put
    got = pack.stage({"p": phase}).resolve()["p"]
    assert got["col"].tolist() == [1, 4, 7, 10] and got["i32"].tolist() == [0, 1, 2, 3, 4]
    assert got["mask"].tolist() == [True, False, True] and got["wide"].tolist() == [7, 7, 7, 7]
    assert np.array_equal(got["h"], hidden.float().numpy())
    assert got["fp"].tolist() == row_fingerprints(hidden).tolist()
