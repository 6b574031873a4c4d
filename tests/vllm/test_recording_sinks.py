"""The plugin's writer process (``recording.procsink``, ``pcpviz.trace.procwriter``): a lenient
session's steps are resolved, encoded and written by a process of its own; the trace is the one
the inline writer makes, view for view; a writer that dies is one warning and a ``partial`` trace,
never a hang; the flight ring lives in the writer and dumps on request, on a signal and at
shutdown."""

from __future__ import annotations

import logging
import os
import signal
import time
import types

import numpy as np
import pytest

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()  # before the recording classes import vLLM's worker modules

import torch  # noqa: E402

import pcpviz.trace as pt  # noqa: E402
from pcpviz.trace.flight import FlightConfig  # noqa: E402
from pcpviz.vllm import recording  # noqa: E402
from pcpviz.vllm.recording import recorder as recorder_module  # noqa: E402
from pcpviz.vllm.recording.host import Fresh  # noqa: E402


def _ns(**kw):
    return types.SimpleNamespace(**kw)


def _batch(step: int, r: int = 3):
    """A PCP=1 global batch of ``r`` decodes (1 + 2 tokens each) and the runner's block tables,
    with a previous occupant's entries left past each request's blocks."""
    t = 3 * r
    num_blocks = torch.tensor([[2, 3, 1, 0, 0, 0]], dtype=torch.int32)
    rows = torch.arange(1, 6 * 8 + 1, dtype=torch.int32).view(6, 8) + step
    bt = _ns(block_sizes=[4], num_blocks=_ns(gpu=num_blocks), block_tables=[_ns(gpu=rows)])
    batch = _ns(num_reqs=r, num_tokens=t, req_ids=[f"r{i}-{step}" for i in range(r)],
                idx_mapping=torch.tensor([2, 0, 1, 5, 5, 5], dtype=torch.int32),
                num_scheduled_tokens=np.full(r, 3, dtype=np.int32), num_computed_tokens_np=np.arange(r) + step,
                query_start_loc=torch.arange(r + 1, dtype=torch.int32) * 3, positions=torch.arange(t) + step,
                input_ids=torch.arange(t, dtype=torch.int32) * 7 + step, seq_lens=torch.full((r,), 9 + step),
                is_prefilling_np=np.zeros(r, dtype=bool), prefill_len_np=np.full(r, 9, dtype=np.int32),
                logits_indices=torch.arange(t), num_draft_tokens_per_req=np.full(r, 2, dtype=np.int32))
    runner = _ns(block_tables=bt, dcp_size=1, dcp_rank=0, cp_interleave=1)
    return runner, batch, rows


def _steps(rec, n: int, *, start: int = 0) -> None:
    """``n`` steps through the recorder's own hooks (target, block tables, verify, a fresh view)."""
    for step in range(start, start + n):
        runner, batch, rows = _batch(step)
        rec.guard(rec.begin_step)
        rec.guard(rec.on_global_batch, runner, batch, 1000 + step)
        rec.guard(rec.on_runner_attn, runner, batch, block_tables=[rows], slot_mappings=torch.arange(20).view(1, 20))
        sampled = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]]) + step
        rec.guard(rec.on_postprocess_sampled, batch.idx_mapping[:3], sampled,
                  torch.tensor([1, 3, 2], dtype=torch.int32), num_rejected=torch.tensor([2, 0, 1], dtype=torch.int32),
                  t0=2000 + step)
        rec.guard(rec.put, "target", hidden_fp=Fresh(torch.arange(9) * step), bf=torch.ones(2, dtype=torch.bfloat16))
    rec.guard(rec.flush)


@pytest.fixture
def clock(monkeypatch):
    """Deterministic ``t_end_us`` (the two traces compared were recorded at different times)."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(recorder_module, "now_us", lambda: next(ticks))


def _views(trace):
    return {(s, r, ph, v): np.asarray(x) for s in trace.steps for r in trace.ranks for ph in trace.phases(s, r)
            for v, x in trace.record(s, r, ph).items()}


@pytest.mark.slow
def test_the_writer_process_writes_the_inline_writers_trace(tmp_path, clock, monkeypatch):
    monkeypatch.delenv("PCPVIZ_WRITER", raising=False)
    with recording.session(tmp_path / "proc", producer="t", meta={"pcp": 1}) as s:
        rec = s.recorder_for_rank(0, 1)
        assert rec.sink.kind == "process"
        _steps(rec, 4)
        assert rec.sink.stats()["steps_written"] == 4
        pid = rec.sink.proc.pid
    assert rec.sink.proc.poll() == 0 and pid != os.getpid()
    monkeypatch.setattr(recorder_module, "now_us", iter(range(10**6)).__next__)
    with recording.session(tmp_path / "inline", producer="t", meta={"pcp": 1}, strict=True) as s:
        rec = s.recorder_for_rank(0, 1)
        assert rec.sink.kind == "inline"
        _steps(rec, 4)
    a, b = pt.open(tmp_path / "proc"), pt.open(tmp_path / "inline")
    va, vb = _views(a), _views(b)
    assert list(va) == list(vb)  # the same views, in the same order
    for key, x in va.items():
        y = vb[key]
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), key
    assert pt.validate(a).ending == "complete" and (tmp_path / "proc" / "rank0.arrow").read_bytes() == \
        (tmp_path / "inline" / "rank0.arrow").read_bytes()
    target, verify = a.record(1, 0, "target"), a.record(1, 0, "verify")
    # rows of requests 2, 0, 1 (1, 2 and 3 blocks): zeroed past num_blocks, cut to the columns in use
    assert target["block_table_global"].tolist() == [[[2, 0, 0], [10, 11, 0], [18, 19, 20]]]
    assert int(target["block_table_global_stale_tail"]) == 7 + 6 + 5
    assert verify["sampled_token_ids"].tolist() == [[6, -1, -1], [9, 10, 11], [12, 13, -1]]
    assert verify["num_accepted"].tolist() == [0, 2, 1] and verify["num_sampled"].dtype == np.int64
    assert target["req_ids"].tolist() == ["r0-1", "r1-1", "r2-1"] and target["bf"].dtype == np.float32


def test_a_killed_writer_process_is_one_warning_and_a_partial_trace(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("PCPVIZ_WRITER", raising=False)
    s = recording.TraceSession(tmp_path / "t", producer="t", meta={"pcp": 1})
    rec = s.recorder_for_rank(0, 1)
    with caplog.at_level(logging.WARNING, logger="vllm.pcpviz"):
        _steps(rec, 3)
        assert rec.sink.stats()["steps_written"] == 3
        rec.sink.proc.kill()
        rec.sink.proc.wait()
        t0 = time.monotonic()
        _steps(rec, 5, start=3)  # recording switches itself off; vLLM's steps go on
        rec.sink.drain()
        s.close()
        assert time.monotonic() - t0 < 30
    warnings_ = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings_) == 1 and "writer process died" in warnings_[0], warnings_
    assert rec.disabled
    t = pt.open(tmp_path / "t")
    status = pt.validate(t)
    assert t.steps == [0, 1, 2] and status.ending.startswith("partial: the trace writer process died"), status.lines()


def test_the_flight_ring_lives_in_the_writer_and_dumps_on_request_signal_and_shutdown(tmp_path, monkeypatch):
    monkeypatch.delenv("PCPVIZ_WRITER", raising=False)
    cfg = FlightConfig(steps=2, signal=signal.SIGUSR2)
    with recording.session(tmp_path / "t", producer="t", meta={"pcp": 1}, flight=cfg) as s:
        rec = s.recorder_for_rank(0, 1)
        _steps(rec, 3)
        rec.dump("exception: RuntimeError: boom")
        assert not (tmp_path / "t" / "rank0.arrow").exists()
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.monotonic() + 30
        while not list((tmp_path / "t").glob("flight-001-signal/complete.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        _steps(rec, 1, start=3)
    dumps = sorted(p.name for p in (tmp_path / "t").iterdir())
    assert dumps == ["flight-000-exception", "flight-001-signal", "flight-002-shutdown"], dumps
    assert pt.open(tmp_path / "t" / "flight-000-exception").steps == [1, 2]
    last = pt.open(tmp_path / "t" / "flight-002-shutdown")
    assert last.steps == [2, 3] and pt.validate(last).ending == "complete"
    assert last.meta["flight_recorder"]["trigger"] == "shutdown"


def test_steps_that_wait_together_go_to_the_writer_in_one_message_and_write_the_same_trace(tmp_path, clock,
                                                                                          monkeypatch):
    """The sender takes the steps queued within ``DRAIN_PERIOD_S`` together (one host copy, one
    message): fewer messages than steps, and the trace the inline writer writes, byte for byte."""
    from pcpviz.vllm.recording import procsink

    monkeypatch.delenv("PCPVIZ_WRITER", raising=False)
    monkeypatch.setattr(procsink, "DRAIN_PERIOD_S", 0.3)
    sent: list[int] = []
    send = procsink.ProcessSink._send

    def counted(self, msg, data=None):
        if msg[0] == "steps":
            sent.append(len(msg[1]))
        return send(self, msg, data)

    monkeypatch.setattr(procsink.ProcessSink, "_send", counted)
    with recording.session(tmp_path / "proc", producer="t", meta={"pcp": 1}) as s:
        rec = s.recorder_for_rank(0, 1)
        _steps(rec, 6)
        assert rec.sink.stats()["steps_written"] == 6
    assert sum(sent) == 6 and len(sent) < 6 and max(sent) > 1, sent
    assert rec.sink.sender_ns[2] == 6
    monkeypatch.setattr(recorder_module, "now_us", iter(range(10**6)).__next__)
    with recording.session(tmp_path / "inline", producer="t", meta={"pcp": 1}, strict=True) as s:
        _steps(s.recorder_for_rank(0, 1), 6)
    assert (tmp_path / "proc" / "rank0.arrow").read_bytes() == (tmp_path / "inline" / "rank0.arrow").read_bytes()


def test_a_run_meta_key_the_recorder_misnames_switches_recording_off_with_the_key(tmp_path, monkeypatch, caplog):
    """The recorder's run.json is encoded from ``RunMeta``: a key that is no field is a recorder bug,
    named in the reason, and the rank file still ends (partial), nothing hangs."""
    monkeypatch.delenv("PCPVIZ_WRITER", raising=False)
    with recording.session(tmp_path / "t", producer="t", meta={"pcp": 1, "rack": "r7"}) as s:
        rec = s.recorder_for_rank(0, 1)
        _steps(rec, 2)
        rec.sink.drain()
        rec.update_meta(blok_size=16)  # misspelled
        _steps(rec, 2, start=2)
        rec.sink.drain()
        assert rec.disabled and "'blok_size' is no RunMeta field" in rec.disabled_reason
    t = pt.open(tmp_path / "t")
    ending = pt.validate(t).ending
    assert t.meta["rack"] == "r7" and ending.startswith("partial") and "'blok_size' is no RunMeta field" in ending
