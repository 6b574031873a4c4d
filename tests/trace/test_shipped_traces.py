"""The traces shipped in data/traces: every one passes every check, and the one recorded on
2 H200 GPUs with NCCL (benchmarks/bench_engine.py --trace-out) holds exactly the tokens and
drafts that the same run produces here on CPU with gloo."""

from pathlib import Path

import numpy as np
import pytest

import pcpviz
import pcpviz.trace as pt
from pcpviz.analysis.checks import DCP_CHECKS, ENGINE_VIEW_CHECKS, run_checks

TRACES = sorted(p for p in (Path(__file__).resolve().parents[2] / "data" / "traces").iterdir() if p.is_dir())
GPU_TRACE = Path(__file__).resolve().parents[2] / "data" / "traces" / "h200x2-nccl-pcp2-mtp2"


EXPORT_LIMIT_BYTES = 8_000_000

# With K = 1 vLLM's propose returns before the block-table gather: no replicated draft steps.
K1_SKIPS = {"draft_decode_replicated", "draft_block_tables_global", "draft_positions_advance"}


# A PCP=1 trace has no PCP layout, rank-local batch or second rank to check.
PCP1_SKIPS = {"layout_matches_plan", "restore_gather_identity", "kv_written_once", "gathered_slots_are_global",
              "kv_write_mask_canonical", "local_batch_matches_layout", "local_positions_are_global",
              "local_seq_lens", "ranks_agree", "target_outputs_agree"}
GRAPHS = "graph_inputs_are_captured"  # needs the graph-replay ledger: PIECEWISE traces recorded with it


@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_shipped_trace_passes_every_check(path):
    trace = pt.open(path)
    report = run_checks(trace)
    assert report.ok, report.format()
    assert not report.failed
    # traces recorded before the fingerprints (and vLLM's) skip the checks of those views, saying so
    optional = ENGINE_VIEW_CHECKS
    skipped = set(report.results) - set(report.passed)
    ledger = any("graph_replays" in trace.record(s, r, ph) for r in trace.ranks for s in trace.rank_steps(r)
                 for ph in trace.phases(s, r))
    assert (GRAPHS in report.passed) == ledger
    skipped.discard(GRAPHS)
    if trace.meta.get("dcp", 1) == 1:
        skipped -= DCP_CHECKS
    if trace.meta["pcp"] == 1:
        assert skipped - optional == PCP1_SKIPS - optional, report.format()
    elif trace.meta["num_speculative_tokens"] == 1:
        assert skipped <= K1_SKIPS | optional and len(report.passed) >= 17
    else:
        assert skipped <= optional and len(report.passed) >= 20
    for name in set(report.skipped) & optional:
        assert "no " in report[name].skip_reason or "single rank" in report[name].skip_reason


@pytest.mark.slow
@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_shipped_trace_renders(path, tmp_path):
    from pcpviz.views.export.html import export_html
    from pcpviz.views.widgets import Workbench

    out = tmp_path / "review.html"
    export_html(path, out)
    assert out.stat().st_size > 100_000 and b"plotly" in out.read_bytes()[:2_000_000]
    # issue 15: every shipped trace's self-contained review stays under 8 MB (plotly.js is ~4.8 MB)
    assert out.stat().st_size < EXPORT_LIMIT_BYTES, f"{path.name}: {out.stat().st_size / 1e6:.2f} MB"
    wb = Workbench(pt.open(path))
    assert wb is not None


@pytest.mark.slow
def test_gpu_trace_tokens_equal_a_cpu_rerun(tmp_path):
    gpu = pt.open(GPU_TRACE)
    meta = gpu.meta
    assert meta["device"] == "cuda" and meta["pcp"] == 2
    pcpviz.run(meta["prompt_token_ids"], pcp=2, num_speculative_tokens=meta["num_speculative_tokens"],
               device="cpu", max_new_tokens=meta["max_new_tokens"],
               max_num_batched_tokens=meta["max_num_batched_tokens"], trace_dir=str(tmp_path),
               progress=False)
    cpu = pt.open(tmp_path)
    assert cpu.steps == gpu.steps
    for step in gpu.steps:
        for phase in gpu.phases(step, 0):
            for view in ("sampled_token_ids", "num_accepted", "draft_tokens", "input_ids", "positions"):
                g = gpu.record(step, 0, phase)
                if view in g:
                    np.testing.assert_array_equal(cpu.record(step, 0, phase)[view], g[view],
                                                  err_msg=f"step {step} {phase} {view}")
