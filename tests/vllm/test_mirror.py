"""pcpviz's data path against recorded traces (pcpviz.analysis.mirror): the real vLLM 0.33.0 traces from
2 H200s and the CPU replay of vLLM's classes. Same scheduled batches in, same views out, with no
GPU; a changed view is named with its step, rank, phase and index."""

from pathlib import Path

import numpy as np
import pytest

import pcpviz.trace as pt
import pcpviz.vllm
from pcpviz.analysis.mirror import mirror

# the PCP data path: the PCP = 2 traces (a PCP = 1 trace has no layout or rank-local views to mirror)
TRACES = sorted(p for p in (Path(__file__).resolve().parents[2] / "data" / "traces").iterdir()
                if p.is_dir() and "pcp1" not in p.name)
REAL = [p for p in TRACES if p.name.startswith("vllm-")]


def _targets(trace):
    return sum(trace.has(s, r, "target") for s in trace.steps for r in trace.ranks)


def test_real_vllm_traces_are_shipped():
    names = {p.name for p in REAL}
    for k in (1, 2, 3):
        assert f"vllm-h200x2-pcp2-mtp{k}" in names
    assert {"vllm-h200x2-pcp2-mtp2-chunked", "vllm-h200x2-pcp2-mtp2-piecewise"} <= names


@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_engine_data_path_equals_every_shipped_trace(path):
    trace = pt.open(path)
    if trace.meta.get("dcp_group"):
        with pytest.raises(ValueError, match="is not modelled here"):
            mirror(trace)
        return
    report = mirror(trace)
    assert report.ok, str(report.first)
    assert report.compared == _targets(trace) and report.views >= 10 * report.compared


@pytest.fixture(scope="module", params=["sharded", "replicated"])
def replay_trace(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"replay-{request.param}")
    return pcpviz.vllm.replay(pcp=2, mtp=3, trace_dir=str(d), scenario="mixed", decodes=request.param).trace


@pytest.mark.slow
def test_engine_data_path_equals_vllm_replay(replay_trace):
    report = mirror(replay_trace)
    assert report.ok, str(report.first)
    assert report.compared >= 2 * len(replay_trace.ranks)


class _Altered:
    """A trace whose one view at one (step, rank, phase) is changed at one index."""

    def __init__(self, trace, step, rank, phase, view, index, delta):
        self._t, self._at, self._view, self._index, self._delta = trace, (step, rank, phase), view, index, delta

    def __getattr__(self, name):
        return getattr(self._t, name)

    def record(self, step, rank, phase):
        rec = self._t.record(step, rank, phase)
        if (step, rank, phase) != self._at:
            return rec
        out = {k: rec[k] for k in rec.keys()}
        a = np.array(out[self._view])
        a[self._index] += self._delta
        out[self._view] = a
        return out


@pytest.mark.parametrize("phase,view,index", [
    ("target", "slot_mapping_gathered", (0, 5)),
    ("target", "local_positions", (3,)),
    ("target", "block_table_local", (0, 1, 0)),
    ("draft_1", "slot_mapping_draft", (0, 2)),
])
def test_a_changed_view_is_named(phase, view, index):
    trace = pt.open(REAL[0].parent / "vllm-h200x2-pcp2-mtp2")
    step = trace.steps[len(trace.steps) // 2]
    report = mirror(_Altered(trace, step, 1, phase, view, index, 7))
    assert not report.ok
    first = report.first
    assert (first.step, first.rank, first.phase, first.view, first.index) == (step, 1, phase, view, index)
    assert first.actual - first.expected == 7
