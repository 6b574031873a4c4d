"""Big steps legible at full view (issue 39 item 10), held on the drawn data: a 16-request step of
4k tokens (``pcpviz.synthetic``) and the shipped CPU trace.

* a per-token hover says the token's position (the ``positions`` view), not its x coordinate;
* the request colours stay apart (CIE76 Delta E) for 16 requests, and a 16-request step at full
  width names every request on the global lane;
* padding is drawn at least ``PAD_MIN_PX`` wide in its grey; a highlight dims to a grey distinct
  from padding;
* run labels are at least 11 px and in black or white, whichever reads on the cell;
* every block-table subplot has x tick labels.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcpviz.synthetic import RequestSpec, generate
from pcpviz.trace import open as open_trace
from pcpviz.views import figures as fg
from pcpviz.views.figures.canvas import level_color
from pcpviz.views.figures.lod import PAD_MIN_PX, PLOT_PX, pixel_cells, record_strips
from pcpviz.views.figures.palette import DIM_COLOR, PAD_COLOR, REQUEST_COLORS, delta_e, srgb_to_lab
from test_browser import REPO  # tests/views is on sys.path (rootless test dirs)

L_PAD = 0


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """Step 0 of a 16-request prefill of 4,072 tokens at PCP=2 (uneven prompts: padding; one-token
    blocks, so each block-table row is ~250 columns: runs with range labels at full width); the
    16k-token steps are drawn in ``test_browser_legible.py``."""
    reqs = [RequestSpec(f"r{i}", 256 - 3 * (i % 4), 2) for i in range(16)]
    run = generate(reqs, pcp=2, num_speculative_tokens=2, block_size=1, max_num_batched_tokens=4096, max_num_reqs=16)
    t = open_trace(run.write(tmp_path_factory.mktemp("big") / "trace"))
    return t.record(0, 0, "target")


def test_a_per_token_hover_says_the_tokens_position_not_its_x():
    t = open_trace(REPO / "data" / "traces" / "cpu-pcp2-mtp2")
    rec = t.record(0, 0, "target")  # req0: global tokens 0-22 at positions 0-22; req1: 23-47 at 0-24
    pos = np.asarray(rec["positions"])
    with record_strips() as calls:
        fg.token_order_spec(rec, windows={"xaxis": (0, 48)})
    d = calls[0].drawn
    assert d.per_token
    x0 = int(d.edges[0])
    for j in range(48):
        assert d.hover[0, j - x0].endswith(f"position {pos[j]}"), (j, d.hover[0, j - x0])
    assert "position 30" not in d.hover[0, 30 - x0]  # token 30 is req1's position 7


def test_sixteen_request_colours_stay_apart():
    first16 = REQUEST_COLORS[:16]
    gaps = [delta_e(a, b) for i, a in enumerate(first16) for b in first16[i + 1:]]
    assert min(gaps) >= 25, min(gaps)  # the old palette: 12.8 (#EF553B against #D62728)
    assert len(set(REQUEST_COLORS)) == len(REQUEST_COLORS) >= 16
    assert min(delta_e(c, g) for c in REQUEST_COLORS for g in (PAD_COLOR, DIM_COLOR)) >= 30


def test_sixteen_requests_draw_sixteen_colours_and_are_named_at_full_width(big):
    spec = fg.token_order_spec(big, px=PLOT_PX)
    z = np.array(spec["data"][0]["z"], dtype=float)[0]  # the global lane
    colours = {level_color(v) for v in z[np.isfinite(z)]}
    assert len(colours) == 16
    names = {a["text"] for a in spec["layout"]["annotations"] if a.get("yref") == "y" and a["y"] == 0}
    assert names >= {f"r{i}" for i in range(16)}, sorted(names)


@pytest.mark.parametrize("px", [300, PLOT_PX])  # a Workbench column, the 940 px figure
def test_padding_is_drawn_at_least_three_pixels_wide_at_full_width(big, px):
    # rank 0's 24 padding rows of 4,072 tokens: 1.8 px at 300 px before PAD_MIN_PX
    with record_strips() as calls:
        fg.token_order_spec(big, px=px)
    d = calls[0].drawn
    per_rank = np.asarray(big["per_rank_num_tokens"])
    padded = int(np.asarray(big["padded_gather_idx"]).shape[0] // per_rank.shape[0])
    assert per_rank[0] < padded  # rank 0 has padding rows
    cell_px = np.diff(d.edges) / (d.window[1] - d.window[0]) * px
    lane = d.z[1]  # rank 0
    assert cell_px[lane == L_PAD].sum() >= PAD_MIN_PX - 0.5
    assert level_color(L_PAD) == PAD_COLOR


def test_highlight_dims_to_a_grey_distinct_from_padding(big):
    spec = fg.token_order_spec(big, px=PLOT_PX, highlight="r3")
    z = np.array(spec["data"][0]["z"], dtype=float)
    dims = {level_color(v) for v in z[np.isfinite(z)]} - {level_color(fg.token_order.req_levels(["r3"], None, None)[0])}
    assert DIM_COLOR in dims and delta_e(DIM_COLOR, PAD_COLOR) >= 20
    lab = srgb_to_lab(DIM_COLOR)
    assert abs(lab[1]) < 3 and abs(lab[2]) < 3  # a grey


def _contrast(a: str, b: str) -> float:
    def lum(c):
        rgb = np.array([int(c.lstrip("#")[i:i + 2], 16) for i in (0, 2, 4)]) / 255
        lin = np.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
        return float(lin @ [0.2126, 0.7152, 0.0722])
    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_block_range_labels_are_11px_and_contrast_with_their_cell_and_every_panel_has_ticks(big):
    with record_strips() as calls:
        spec = fg.block_tables_spec(big, px=PLOT_PX)
    labels = [a for a in spec["layout"]["annotations"] if a.get("xref", "").startswith("x") and "font" in a
              and a["xref"] != "paper"]
    assert labels
    drawn = {k: c.drawn for k, c in enumerate(calls)}
    for a in labels:
        assert a["font"]["size"] >= 11, a
        k = int(a["xref"][1:] or 1) - 1
        d = drawn[k]
        col = min(int(np.searchsorted(d.edges, a["x"], side="right")) - 1, d.z.shape[1] - 1)
        assert _contrast(a["font"]["color"], level_color(d.z[int(a["y"]), col])) >= 3, a
    axes = [v for k, v in spec["layout"].items() if k.startswith("xaxis")]
    assert len(axes) == 3 and all(ax.get("showticklabels", True) for ax in axes)


def test_pixel_cells_widens_a_run_that_wants_it_and_leaves_others():
    # a 2-token run among 10,000 tokens drawn 100 px wide: 0.02 px, one borrowed pixel without min_px
    edges = np.array([0, 5000, 5002, 10000])
    pe, runs, _ = pixel_cells(edges, 0, 10000, px=100, min_px=np.array([0, 3, 0]))
    widths = dict(zip(runs.tolist(), np.diff(pe).tolist()))
    assert widths[1] == 3 and widths[0] + widths[2] == 97
    pe, runs, _ = pixel_cells(edges, 0, 10000, px=100)
    assert dict(zip(runs.tolist(), np.diff(pe).tolist()))[1] == 1
