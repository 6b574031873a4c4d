"""PCP=2's hooks are planned like PCP=1's (``recording.target_views``, ``DraftContext._local_plan_key``):
the PCP manager's partition and attention views and the rank-local draft_0 replayed as a FULL graph
are one copy per step once their shape repeats, and what they record equals the per-view path,
view for view. Driven by the recorder benchmark's stand-in step (vLLM's shapes, dtypes and persistent
buffers; ``benchmarks/bench_recorder_host.py``), whose bytes change every step."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch

from pcpviz.trace import open as open_trace
from pcpviz.vllm import recording
from pcpviz.vllm.recording import replayplan

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_recorder_host", ROOT / "benchmarks" / "bench_recorder_host.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _record(bench, out: Path, steps: int = 10):
    torch.manual_seed(0)
    st = bench.Stage(2, 256, 2)
    x = torch.zeros(8)
    s = recording.TraceSession(out, producer="bench", meta={"pcp": 2}, strict=True)
    rec = s.recorder_for_rank(0, 2)
    s.mode = "record"
    for i in range(steps):
        st.input_ids[:64] = torch.arange(64, dtype=st.input_ids.dtype) + i  # new bytes in the same buffers
        st.num_sampled[:2] = 1 + i % 3
        x = bench.step(rec, st, x, 0, on=True)
    s.close()
    return open_trace(out)


def test_pcp2_hooks_are_planned_and_record_what_the_per_view_path_records(tmp_path, monkeypatch):
    bench = _bench()
    hit: dict[str, int] = {}
    get = replayplan.PlanBook.get

    def counted(self, key):
        plan = get(self, key)
        if plan is not None and isinstance(key[0], str):
            hit[key[0]] = hit.get(key[0], 0) + 1
        return plan

    with monkeypatch.context() as m:
        m.setattr(replayplan.PlanBook, "get", counted)
        planned = _record(bench, tmp_path / "planned")
    assert all(hit.get(k, 0) >= 8 for k in ("partition", "prepare_attn", "rank_local", "verify")), hit
    with monkeypatch.context() as m:
        m.setattr(replayplan.PlanBook, "get", lambda self, key: None)
        plain = _record(bench, tmp_path / "plain")
    compared = 0
    for step in planned.steps:
        for ph in planned.phases(step, 0):
            a, b = planned.record(step, 0, ph), plain.record(step, 0, ph)
            names = {v for v in a if v not in ("t_start_us", "t_end_us")}
            assert names == {v for v in b if v not in ("t_start_us", "t_end_us")}, (step, ph)
            for v in names:
                assert np.array_equal(np.asarray(a[v]), np.asarray(b[v])), (step, ph, v)
                compared += 1
    assert compared > 500
