"""The graph-replay ledger (issue 24 item 2) and the check ``graph_inputs_are_captured``.

vLLM's ``CUDAGraphWrapper`` decides capture or replay from its own entries and the forward
context; the ledger wraps it and compares what a replay is handed with what the graph was
captured on. Stand-in, said plainly: capturing a CUDA graph needs a GPU, so the *original*
``CUDAGraphWrapper.__call__`` under the ledger is replaced by a CPU stand-in that keeps vLLM's
bookkeeping (an entry per batch descriptor, ``entry.cudagraph`` set at capture, a replay returns
the captured output and reads nothing it is handed). Everything else is real: vLLM's forward
context and ``BatchDescriptor``, the ledger's wrapper, the recorder, the trace and the check.
The real-GPU counterpart is the PCP=1 PIECEWISE trace in data/traces (its check passes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pcpviz.vllm.replay import ranks  # noqa: F401 - applies the CPU patches before vLLM's imports

from vllm.compilation.cuda_graph import CUDAGraphEntry, CUDAGraphWrapper  # noqa: E402
from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context  # noqa: E402

import pcpviz.trace as pt  # noqa: E402
from pcpviz.analysis.checks import run_checks  # noqa: E402
from pcpviz.vllm import recording  # noqa: E402
from pcpviz.vllm.recording.graphs import LEDGER, wrap_graph_call  # noqa: E402


def _stand_in_original(self, *args, **kwargs):
    """CPU stand-in for vLLM's CUDAGraphWrapper.__call__ body (torch.cuda.graph needs a GPU)."""
    bd = get_forward_context().batch_descriptor
    entry = self.concrete_cudagraph_entries.setdefault(bd, CUDAGraphEntry(batch_descriptor=bd))
    if entry.cudagraph is None:
        entry.cudagraph = "captured"
        entry.output = self.runnable(*args, **kwargs)
        return entry.output
    return entry.output  # a replay reads the captured buffers, never what it was handed


def _piece(fn) -> CUDAGraphWrapper:
    w = object.__new__(CUDAGraphWrapper)  # __init__ needs a CUDA platform's graph pool
    w.__dict__.update(runnable=fn, runtime_mode=CUDAGraphMode.PIECEWISE, concrete_cudagraph_entries={})
    return w


@pytest.fixture()
def config():
    from pcpviz.vllm.replay.ranks import ReplayConfig, stand_in_vllm_config

    return stand_in_vllm_config(ReplayConfig(pcp=1, k=2, shard=False, block_size=4, max_num_reqs=4,
                                             max_num_tokens=16, max_model_len=32, vocab=97, hidden=8))


def _record(tmp_path, config, handed: list[torch.Tensor], captured: torch.Tensor) -> pt.Trace:
    call = wrap_graph_call(_stand_in_original)
    piece = _piece(lambda ids: ids * 2)
    bd = BatchDescriptor(num_tokens=captured.shape[0])
    meta = {"pcp": 1, "block_size": 4, "num_speculative_tokens": 0}
    with recording.session(tmp_path / "t", producer="test", meta=meta, strict=True) as s:
        rec = s.recorder_for_rank(0, 1)
        with set_forward_context(None, config, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE, batch_descriptor=bd):
            call(piece, captured)  # capture (vLLM does it while warming up)
            for step, buf in enumerate(handed):
                rec.begin_step()
                rec.put("target", positions=np.arange(4) + step)
                call(piece, buf)  # replay
        rec.flush()
    return pt.open(tmp_path / "t")


def test_replays_handed_the_captured_buffers_pass(tmp_path, config):
    buf = torch.arange(8, dtype=torch.int32)
    t = _record(tmp_path, config, [buf, buf], buf)
    rec = t.record(1, 0, "target")
    assert int(rec["graph_replays"]) == 1 and "graph_inputs_moved" not in rec
    res = run_checks(t, checks="graph_inputs_are_captured")["graph_inputs_are_captured"]
    assert res.verdict == "pass" and res.evaluated == 2


def test_a_replay_handed_another_buffer_fails_naming_the_graph_and_the_input(tmp_path, config):
    captured = torch.arange(8, dtype=torch.int32)
    other = torch.arange(8, dtype=torch.int32) + 100  # what PCPManager.get_draft_input_buffers hands over
    t = _record(tmp_path, config, [captured, other], captured)
    res = run_checks(t, checks="graph_inputs_are_captured")["graph_inputs_are_captured"]
    assert res.verdict == "fail" and res.failed == 1
    v = res.first_violation
    label = LEDGER.labels[max(LEDGER.labels, key=lambda k: int(LEDGER.labels[k].split("#")[1]))]
    assert (v.step, v.phase, v.view) == (1, "target", "graph_inputs_moved")
    assert v.message.startswith(f"graph {label} num_tokens=8 (target): input 0 int32[8] handed at "
                                f"0x{other.data_ptr():x}, captured at 0x{captured.data_ptr():x} int32[8]"), v.message


def test_eager_traces_skip_the_check(tmp_path):
    t = pt.open(_shipped("vllm-h200x2-pcp2-mtp2"))
    res = run_checks(t, checks="graph_inputs_are_captured")["graph_inputs_are_captured"]
    assert res.verdict == "skipped" and "no graph_replays" in res.skip_reason


def _shipped(name: str):
    from pathlib import Path

    return Path(__file__).resolve().parents[2] / "data" / "traces" / name
