"""``pcpviz explain TRACE`` without a GOOD run on every shipped healthy trace (issue 39 item 9):
exit 0. It says up front what it re-runs and how to skip it; a re-run by another producer (real
vLLM, a GPU) is no reference for views, tokens or acceptance, so its differences are not
blamed. Each case re-runs the engine on CPU (tens of seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # an engine re-run per trace

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.name for p in (REPO / "data" / "traces").iterdir() if (p / "run.json").exists())


@pytest.mark.parametrize("name", SHIPPED)
def test_explain_without_good_is_clean_on_shipped_traces(name):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "pcpviz.cli", "explain", str(REPO / "data" / "traces" / name)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "verdict: CLEAN" in r.stdout
    # said up front, or (a flight dump records no prompts) the report says why there is no re-run
    assert ("re-running the" in r.stderr and "--no-rerun skips it" in r.stderr) or "no re-run:" in r.stdout
