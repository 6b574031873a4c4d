"""The LayoutBuilder widget reacts to its controls (no browser needed: the
FigureWidget's Python-side data is what the front end renders)."""

import numpy as np

from pcpviz.views.widgets import LayoutBuilder
from pcpviz.views.widgets.layout_builder import parse_lengths


def lanes(builder):
    return np.array(builder.figure.data[0].z, dtype=float)


def test_controls_drive_the_layout_and_figure():
    b = LayoutBuilder(prompts="13, 7", decodes="1, 4", pcp=2)
    assert b.pcp_layout.pcp_world_size == 2
    assert lanes(b).shape[0] == 3  # global + 2 ranks
    before = lanes(b)
    b.pcp.value = 4
    assert b.pcp_layout.pcp_world_size == 4 and lanes(b).shape[0] == 5
    assert not np.array_equal(before.shape, lanes(b).shape)
    assert "per-rank [7, 6, 6, 6]" in b.status.value


def test_rows_follow_vllm_scheduler_order():
    b = LayoutBuilder(prompts="13", decodes="1, 4", pcp=2)
    q, prefill, names = b.batch()
    assert names == ["d1", "d0", "p0"] and q == [4, 1, 13] and prefill == [False, False, True]


def test_decode_mode_switch_changes_write_mask():
    b = LayoutBuilder(prompts="8", decodes="1, 1", pcp=2, decode_mode="sharded")
    sharded = b.pcp_layout.kv_write_mask.copy()
    b.decode_mode.value = "replicated"
    assert b.pcp_layout.shard_decode_requests is False
    assert not np.array_equal(sharded, b.pcp_layout.kv_write_mask)


def test_invalid_input_is_reported_and_keeps_last_layout():
    b = LayoutBuilder(prompts="13", decodes="1", pcp=2)
    good = b.pcp_layout
    b.prompts.value = "13, x"
    assert "invalid batch" in b.status.value and "is not a whole number" in b.status.value
    assert b.pcp_layout is good


def test_highlight_dims_other_requests():
    b = LayoutBuilder(prompts="13", decodes="1, 4", pcp=2)
    b.highlight.value = 2  # p0
    z = lanes(b)
    assert (z[np.isfinite(z)] == -0.5).any() and (z == 2).any()


def test_parse_lengths_errors():
    assert parse_lengths(" 3, 4;5 ,", "x") == [3, 4, 5]
    for bad, msg in (("3,-1", "negative"), ("a", "not a whole number")):
        try:
            parse_lengths(bad, "prefill lengths")
        except ValueError as e:
            assert msg in str(e) and "prefill lengths" in str(e)
        else:
            raise AssertionError("no error")


def test_every_widget_message_is_json_compliant(widget_messages):
    """Padding and empty lane cells reach the browser as null, never NaN (not JSON)."""
    b = LayoutBuilder(prompts="13, 7", decodes="1, 4", pcp=2)
    b.pcp.value = 4
    assert widget_messages.sent and not widget_messages.not_json()
