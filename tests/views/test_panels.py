"""The panel registry (``pcpviz.views.panels``) is the one list of panels: every panel a trace
view names in the schema is registered, the Workbench and the export show the registered panels
under the same titles, and a bad registration fails at once."""

from __future__ import annotations

import html
from pathlib import Path

import ipywidgets as W
import pytest

from pcpviz.trace.schema import VIEW_SPECS
from pcpviz.views.panels import PANELS, affects, panel, run_panels, step_panels


def test_every_panel_a_view_names_is_registered():
    named = {s.panel for s in VIEW_SPECS}
    assert named and named <= set(PANELS), sorted(named - set(PANELS))


def test_affects_follows_depends():
    a = affects()
    assert a["phase"] == {"timeline", "block_tables", "slot_mappings", "dcp_shards"}
    assert a["step"] == {"token_order", "timeline", "block_tables", "slot_mappings", "dcp_shards", "acceptance_marker"}
    assert a["highlight"] == set(PANELS)
    assert [p.name for p in step_panels()] + [p.name for p in run_panels()] == list(PANELS)


def test_a_bad_registration_fails():
    with pytest.raises(ValueError, match="registered twice"):
        panel("token_order", "again", depends={"step"})
    with pytest.raises(ValueError, match="unknown dependency 'stpe'"):
        panel("new_one", "typo", depends={"stpe"})
    assert "new_one" not in PANELS


def test_workbench_and_export_show_the_registry_titles(tmp_path):
    from pcpviz.views.export.html import export_html
    from pcpviz.views.widgets import Workbench

    trace = Path(__file__).resolve().parents[2] / "data" / "traces" / "cpu-pcp2-mtp2"
    wb = Workbench(trace, checks=False)
    heads = [c.value for c in wb.grid.children if isinstance(c, W.HTML) and c.value.startswith("<h4")]
    page = Path(export_html(trace, tmp_path / "r.html", checks=False)).read_text()
    for p in PANELS.values():
        assert any(html.escape(p.title) in h for h in heads), p.name
        assert f"<h2>{html.escape(p.title)}</h2><div class='fig' id='fig-{p.name}'>" in page
