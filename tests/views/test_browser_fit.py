"""The Workbench on one 1400 x 900 screen, in JupyterLab and Chromium (issue 39 item 11).

00_quickstart runs in JupyterLab; with the Workbench scrolled to the top of the notebook panel,
its controls, the token-order view and the block tables must all lie inside the 1400 x 900
viewport (they used to be stacked 940 px wide, ~2,800 px tall: one screen showed the controls
and the token order only). The screenshot of that screen is ``artifacts/browser/fit_1400x900.png``;
``python tools/docs/readme_image.py`` makes it the README's picture (docs/img/workbench.png).
"""

from __future__ import annotations

import time

import pytest

from test_browser import CHROME_ARGS, SHOTS, _all_cells_ran, _chromium, _open_and_run_all, _workbench_state
from test_browser import lab  # noqa: F401 (the JupyterLab fixture)

pytestmark = pytest.mark.slow  # JupyterLab and Chromium in a real browser

SCREEN = {"width": 1400, "height": 900}

_BOXES = """() => {
  const wb = document.querySelector('.pcpviz-workbench');
  const box = e => { const r = e.getBoundingClientRect(); return {x0: r.left, y0: r.top, x1: r.right, y1: r.bottom}; };
  const plots = [...wb.querySelectorAll('.js-plotly-plot')].map(box);
  return {controls: box(wb.querySelector('.pcpviz-controls') || wb), plots, workbench: box(wb),
          area: box(wb.closest('.jp-OutputArea-output') || wb)};
}"""


def _inside(b: dict, what: str) -> None:
    assert b["x0"] >= 0 and b["y0"] >= 0 and b["x1"] <= SCREEN["width"] and b["y1"] <= SCREEN["height"], \
        f"{what} lies outside the 1400 x 900 screen: {b}"


def test_controls_token_order_and_block_tables_fit_one_1400x900_screen(lab):  # noqa: F811
    from playwright.sync_api import sync_playwright

    base, token = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROME_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport=SCREEN)
            page.set_default_timeout(60_000)
            _open_and_run_all(page, base, token, "00_quickstart.ipynb")
            deadline = time.monotonic() + 240
            while True:
                state = _workbench_state(page)
                if state.get("found") and state["plots"] >= 5 and _all_cells_ran(page) and all(state["titles"][:4]):
                    break
                assert time.monotonic() < deadline, f"the Workbench did not render: {state.get('plots')} plots"
                page.wait_for_timeout(500)
            # the Workbench's first line at the top of the notebook panel, as a reader scrolls to it
            page.evaluate("() => document.querySelector('.pcpviz-workbench').scrollIntoView({block: 'start'})")
            page.wait_for_timeout(1500)
            boxes = page.evaluate(_BOXES)
            page.screenshot(path=str(SHOTS / "fit_1400x900.png"))
            _inside(boxes["controls"], "the controls")
            _inside(boxes["plots"][0], "the token-order view")
            _inside(boxes["plots"][2], "the block tables")
        finally:
            browser.close()
