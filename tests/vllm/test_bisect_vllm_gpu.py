"""``pcpviz bisect --producer vllm`` on real vLLM 0.33.0 (GPU tier: one GPU, PCP=1). Every rung of
the graph-mode knob runs and records, and the plugin's views pass ``check`` under each mode; the
job ``tools/gpu/jobs.py bisect-pcp1`` keeps the same report in data/bench/bisect_vllm_h200x1.json."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_bisect_on_real_vllm_runs_every_graph_mode_rung(tmp_path):
    from pcpviz.bisect import bisect

    report = bisect("vllm", out_dir=tmp_path, knobs=["graph_mode"],
                    base={"pcp": 1, "k": 2, "max_new_tokens": 16,
                          "engine_args": {"gpu_memory_utilization": 0.3, "disable_custom_all_reduce": True}})
    assert [r.rung.name for r in report.rungs] == ["graph_mode=NONE", "graph_mode=PIECEWISE"]
    assert all(r.error is None for r in report.rungs), [r.error for r in report.rungs]
    assert report.base.check == "passes" and all(r.check == "passes" for r in report.rungs)
    assert all(math.isnan(x) or 0.0 <= x <= 1.0 for r in (report.base, *report.rungs) for x in r.acceptance)
    for r in report.rungs:  # a flip is a token divergence or an acceptance move, and says which
        assert r.flips == (not r.tokens_equal or r.acceptance_flip is not None)
    assert json.loads(json.dumps(report.to_dict()))["producer"] == "vllm"
