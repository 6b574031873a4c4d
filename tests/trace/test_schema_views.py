"""The view contract: every view a pcpviz producer writes is declared in ``pcpviz.trace.schema``
(``VIEW_SPECS``) with the dtype kind and number of axes it is written with. Shipped traces
(engine and real vLLM), synthetic runs (clean and with every fault) are held to it here; a
fresh engine run in ``test_engine`` and fresh CPU replays in ``test_vllm_replay``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pcpviz.trace as pt
from pcpviz import synthetic
from pcpviz.faults import SYNTHETIC, faults_of
from pcpviz.trace import schema as S
from pcpviz.trace.validate import undeclared_views

from tracegen import clean_run

TRACES = sorted(p for p in (Path(__file__).resolve().parents[2] / "data" / "traces").iterdir()
                if (p / "run.json").is_file())


def test_every_shipped_trace_is_shipped():
    names = {p.name for p in TRACES}
    assert {"cpu-pcp2-mtp2", "vllm-h200x2-pcp2-mtp2", "vllm-serve-h200x2-pcp2-mtp2"} <= names


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_shipped_trace_views_are_declared(path):
    assert undeclared_views(pt.open(path)) == []


def test_synthetic_runs_write_declared_views(tmp_path):
    assert undeclared_views(pt.open(clean_run().write(tmp_path / "clean"))) == []
    reqs = [synthetic.RequestSpec(f"req{i}", n, 6) for i, n in enumerate((19, 3, 11))]
    for fault in faults_of(SYNTHETIC):
        run = synthetic.generate(reqs, pcp=2, num_speculative_tokens=2, faults=[fault], timestamps=True)
        assert undeclared_views(pt.open(run.write(tmp_path / fault))) == [], fault


def test_an_undeclared_view_or_a_wrong_dtype_is_named(tmp_path):
    with pt.TraceWriter(tmp_path, 0, meta={"producer": "test", "pcp": 1}) as w:
        w.write_step(0, {"target": {"positions": np.arange(3), "my_view": np.zeros(2)},
                         "verify": {"num_accepted": np.zeros(2, dtype=np.float32)},
                         "draft_1": {"draft_positions": np.zeros((2, 2), dtype=np.int64)}})
    lines = undeclared_views(pt.open(tmp_path))
    assert "rank 0 step 0 target/my_view: not declared in pcpviz.trace.schema" in lines
    assert "rank 0 step 0 verify/num_accepted: dtype float32 is not int64" in lines
    assert "rank 0 step 0 draft_1/draft_positions: 2-d, declared [R]" in lines


def test_specs_are_complete_and_consistent():
    for spec in S.VIEW_SPECS:
        assert S.is_valid_view_name(spec.name), spec.name
        assert spec.meaning.strip() and "\n" not in spec.meaning
        assert set(spec.phases) <= set(S.PHASE_CLASSES)
        assert spec.scope in (S.GLOBAL, S.RANK)
        assert spec.kinds and spec.ndims, spec.name
        assert spec.panel in ("token_order", "timeline", "block_tables", "slot_mappings", "dcp_shards")
    assert S.view_spec("draft_7", "draft_positions").shape == "[R]"
    assert S.view_spec("draft_0", "draft_positions").scope == S.RANK
    assert S.view_spec("target", "padded_gather_idx").decl == "int64[N*P]"
    assert "0 on padding rows" in S.view_spec("target", "padded_gather_idx").pad
    assert S.view_spec("verify", "sampled_token_ids").pad == "-1 past num_sampled"
    assert S.view_spec("target", "no_such_view") is None
    fps = {"hidden_local_fp", "hidden_fp", "hidden_in_fp", "mtp_local_fp", "hidden_last_fp", "hidden_out_fp"}
    graphs = {"graph_replays", "graph_full_replays", "graph_inputs_moved", "graph_mode"}  # the replay ledger
    assert {"t_start_us", "t_end_us", "hidden_hash", "idx_mapping", "local_idx_mapping"} | fps | graphs == \
        S.RUN_SPECIFIC_VIEWS
    table = S.views_markdown()
    assert table.count("\n") == len(S.VIEW_SPECS) + 1 and "`int64[N*P]`" in table
