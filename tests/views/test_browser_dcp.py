"""The DCP shards panel at real sizes (issue 38): synthetic PCP=DCP steps of 2k and 16k tokens
(interleave 64, block 64, as a FlashMLA deployment has them), drawn by plotly.js in Chromium 940 px
wide from the spec the Workbench pushes (``Workbench._spec("dcp_shards")``), screenshot to
``shots/dcp_<case>.png``, and checked in pixels: the owner strip draws every token, its blue
(DCP rank 0) and orange (DCP rank 1) pixels split as the tokens do, the rank's share strip is
drawn end to end, and no two labels overlap."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import test_browser_views as tbv  # tests/views is on sys.path (rootless test dirs)
from test_browser_views import plotly_js  # noqa: F401, F811 - the fixture
from pcpviz.trace import open as open_trace
from pcpviz.views import figures as fg
from pcpviz.views.figures.canvas import REPLICA_COLOR, WRITTEN_COLOR
from pcpviz.views.widgets import Workbench

pytestmark = pytest.mark.slow  # Chromium

CASES = {"2k": (2048, 2), "16k": (16384, 2)}


def _rgb(hex_color: str) -> np.ndarray:
    return np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])


@pytest.mark.parametrize("case", CASES)
def test_dcp_shards_panel_is_legible_at_real_sizes(case, browser, plotly_js, tmp_path, monkeypatch):  # noqa: F811
    from pcpviz.synthetic import long_prompt_run

    t, pcp = CASES[case]
    run = long_prompt_run(pcp=pcp, prompt_len=t, chunk=t, num_short=2, max_new_tokens=4, num_speculative_tokens=2,
                          block_size=64, dcp=pcp, dcp_interleave=64)
    trace = open_trace(run.write(tmp_path / "trace"))
    step = tbv._largest_step(trace)
    wb = Workbench(trace, step=step, checks=False)
    spec = wb._spec("dcp_shards")
    monkeypatch.setattr(tbv, "SHOTS", tbv.REPO / "shots")
    tbv.SHOTS.mkdir(exist_ok=True)
    measured, shots = tbv._draw(browser, plotly_js, {"dcp_shards": spec}, f"dcp_{case}")
    print(shots["dcp_shards"])
    img = np.asarray(Image.open(shots["dcp_shards"]).convert("RGB"))
    target = trace.record(step, 0, "target")
    owner = np.asarray(target["dcp_owner"])
    assert owner.shape[0] >= t // 2
    ax = measured["dcp_shards"]["axes"]
    a = ax["x"]
    y = int(round((a["y0"] + a["y1"]) / 2))
    width = a["x1"] - a["x0"]
    tbv._close(tbv._coverage(img, a, y), 1.0, width, f"{case} owner strip", cells=owner.shape[0])
    row = img[y, int(round(a["x0"])) + 1:int(round(a["x1"])) - 1].astype(int)
    near = {r: (np.abs(row - _rgb(c)).max(axis=1) < 40).sum() for r, c in ((0, WRITTEN_COLOR), (1, REPLICA_COLOR))}
    share0 = near[0] / max(near[0] + near[1], 1)
    assert abs(share0 - (owner == 0).mean()) < 0.08, (near, (owner == 0).mean())
    b = ax["x2"]
    tbv._close(tbv._coverage(img, b, (b["y0"] + b["y1"]) / 2), 1.0, b["x1"] - b["x0"], f"{case} share strip",
               cells=owner.shape[0])
    tbv._no_overlaps(measured["dcp_shards"]["texts"], f"{case} dcp_shards")
    title = spec["layout"]["title"]["text"]
    assert f"T = {owner.shape[0]}" in title and str(np.bincount(owner).tolist()) in title


def test_dcp_shards_drawn_data_names_the_owner_of_every_token():
    """The drawn data of the shipped DCP trace: the owner strip's runs are the interleave's."""
    trace = open_trace(tbv.REPO / "data" / "traces" / "cpu-pcp2-dcp2-mtp2")
    step = tbv._largest_step(trace)
    target = trace.record(step, 1, "target")
    spec = fg.dcp_shards_spec(target, trace.record(step, 1, "draft_1"), rank=1, draft_phase="draft_1")
    owner = np.asarray(target["dcp_owner"])
    heat = spec["data"][0]
    drawn = [t for t in np.asarray(heat["text"]).ravel().tolist() if t]
    assert drawn and set(drawn) <= {"r0", "r1", "rank 0", "rank 1"}
    assert ("r1" in drawn or "rank 1" in drawn) == bool((owner == 1).any())
    titles = [a["text"] for a in spec["layout"]["annotations"]]
    assert any("rank 1's slot_mapping_global" in x for x in titles)
    assert any("draft_1 on rank 1" in x for x in titles)
