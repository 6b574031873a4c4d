"""``pcpviz bisect`` on the engine (CPU ranks) with a bug planted where no catalogue looks: the
chunked-prefill must-sample rule (``must_sample_a_chunk_early``, engine/verify.py, from
``pcpviz.analysis.mutations``). Only chunked prefill exercises it, so of the ladder only the
budget rung (2048: every prompt in one chunk) flips, and the checks say which side is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pcpviz.analysis.mutations import plant

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_bisect_flips_only_the_budget_knob_on_a_planted_chunked_prefill_bug(tmp_path):
    root = plant("must_sample_a_chunk_early", tmp_path / "planted")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(ROOT), str(ROOT / "kernels")]))
    r = subprocess.run([sys.executable, "-P", "-m", "pcpviz.cli", "bisect", "--producer", "engine",
                        "--knobs", "max_num_batched_tokens,pcp", "--out", str(tmp_path / "b"), "--json"],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 1, r.stderr[-2000:]  # a knob flips
    report = json.loads(r.stdout)
    assert report["flips"] == ["max_num_batched_tokens=2048"]
    (budget,) = [x for x in report["rungs"] if x["rung"] == "max_num_batched_tokens=2048"]
    assert not budget["tokens_equal"] and budget["token_divergence"].startswith("request ")
    # the chunked base samples a chunk before the prompt ends: its own views say so, the rung's pass
    assert report["base"]["check"].startswith("fails must_sample_rule at step "), report["base"]["check"]
    assert "view num_sampled" in report["base"]["check"]
    assert budget["check"] == "passes"
    (pcp1,) = [x for x in report["rungs"] if x["rung"] == "pcp=1"]
    assert not pcp1["flips"] and pcp1["check"].startswith("fails must_sample_rule")  # the bug is not PCP's
