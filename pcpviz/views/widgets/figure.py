"""The Workbench's figure widget: a plotly ``FigureWidget`` that survives a page reload.

A page reload with the kernel alive: JupyterLab asks the kernel for every widget's state and
re-creates the widgets' front ends from it. Two things broke the Workbench's figures there:

* **the state was the figure as built.** Plotly keeps what a ``FigureWidget`` shows in its
  synced ``_widget_data`` / ``_widget_layout`` traits only as constructed (every later edit
  travels as a one-off message), so a reload drew empty axes. ``RestorableFigureWidget``
  answers a state request with the figure it shows now.
* **anywidget's two seconds.** A ``FigureWidget``'s front end is an anywidget module: plotly's
  5 MB ``widgetbundle.js``, sent in every figure's state and parsed from a fresh blob URL by
  every figure. anywidget gives each model two seconds to load its module; after that the model
  ignores every message from the kernel (the console says ``[anywidget] Failed to initialize
  model``) while its view still draws what it was restored with: figures that no longer follow
  the controls. Five parses of the bundle at once took 8.9 s in Chromium on the 2-core CI
  machine (one: 2 s), and 25 MB of state can overrun JupyterLab's 4 s wait for the kernel's
  answer (seen there: the page then says ``Error displaying widget: model not found``). Here the bundle travels
  once per kernel
  (``BundleCarrier``, never displayed) and is imported once per page; every figure's module
  (``ESM``, 1 kB) awaits that import. A figure whose model still missed its window says so: its
  front end pings the kernel, and when the kernel has answered (its ``idle`` status for the ping
  came) but the pong never reached the model, it sends ``deaf``; the Workbench then shows that
  view in a new widget (``on_deaf``), which loads at once from the page's import.

PCP=2 example: ``Workbench("data/traces/cpu-pcp2-mtp2")`` at step 1, page reloaded: the five
figures come back drawn at step 1 (their state is the figure they showed) and follow the step
slider again; a figure whose model timed out is replaced within a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import anywidget
import plotly
import plotly.graph_objects as go

__all__ = ["RestorableFigureWidget", "BundleCarrier", "bundle_carrier", "ESM", "CARRIER_ESM", "PLOTLY_BUNDLE"]

PLOTLY_BUNDLE = Path(plotly.__file__).parent / "package_data" / "widgetbundle.js"
"""Plotly's anywidget front end (plotly.js included): what every ``FigureWidget`` loads."""

PONG_GRACE_MS = 3000
"""After the kernel's ``idle`` for a ping, how long the front end waits for the pong to arrive."""

_SLOT = """const KEY = Symbol.for(%(key)s);
function slot() {  // the page's one import of plotly's widget bundle, shared by every figure
  let s = globalThis[KEY];
  if (!s) {
    let resolve;
    const promise = new Promise((r) => { resolve = r; });
    s = globalThis[KEY] = {promise, resolve, provided: false};
  }
  return s;
}
"""

_CARRIER = """// pcpviz: plotly's FigureWidget front end, carried once per kernel (pcpviz.views.widgets.figure)
%(slot)s
const SRC = %(src)s;
export default () => {
  const s = slot();
  if (!s.provided) {
    s.provided = true;
    s.resolve(import(URL.createObjectURL(new Blob([SRC], {type: "text/javascript"}))));
  }
  return {initialize() {}, render() {}};
};
"""

_FIGURE = """// pcpviz: a plotly FigureWidget on the page's shared plotly bundle (pcpviz.views.widgets.figure)
%(slot)s
function watch(model) {
  // the kernel's pong goes through the model's message handling, which anywidget closes for
  // good when the model missed its load window; the kernel's idle status for the ping does not
  let ponged = false;
  model.on("msg:custom", (msg) => { if (msg && msg.pcpviz === "pong") ponged = true; });
  const idle = (msg) => {
    if (msg.content.execution_state !== "idle") return;
    setTimeout(() => { if (!ponged) model.send({pcpviz: "deaf"}); }, %(grace)d);
  };
  model.send({pcpviz: "ping"}, {iopub: {status: idle}});
}
export default async () => {
  const plotly = (await slot().promise).default();
  return {
    initialize(ctx) { plotly.initialize(ctx); watch(ctx.model); },
    render(ctx) { return plotly.render(ctx); },
  };
};
"""


def _modules() -> tuple[str, str]:
    """``(carrier ESM, figure ESM)``."""
    slot = _SLOT % {"key": json.dumps(f"pcpviz.plotly-widget/{plotly.__version__}")}
    src = PLOTLY_BUNDLE.read_text(encoding="utf-8")
    return (_CARRIER % {"slot": slot, "src": json.dumps(src)},
            _FIGURE % {"slot": slot, "grace": PONG_GRACE_MS})


CARRIER_ESM, ESM = _modules()
"""The front-end modules: ``CARRIER_ESM`` holds plotly's bundle as a string and imports it once
per page (``BundleCarrier``, one widget per kernel); ``ESM`` (every ``RestorableFigureWidget``)
awaits that import and runs plotly's own ``initialize`` / ``render``."""


class BundleCarrier(anywidget.AnyWidget):
    """The one widget per kernel that brings plotly's 5 MB widget bundle to the page (never
    displayed): a page reload then carries it once, not once per figure."""

    _esm = CARRIER_ESM


_carrier: list[BundleCarrier] = []


def bundle_carrier() -> BundleCarrier:
    """The kernel's ``BundleCarrier`` (a new one when there is none or it was closed)."""
    if not _carrier or _carrier[0].comm is None:
        _carrier[:] = [BundleCarrier()]
    return _carrier[0]


class RestorableFigureWidget(go.FigureWidget):
    """A ``FigureWidget`` that comes back drawn after a page reload (see the module docstring).

    ``on_deaf``: called with the widget when its front end reports that kernel messages no
    longer reach it (then show a new widget in its place); None: ignored.
    """

    _esm = ESM
    on_deaf: Callable[[RestorableFigureWidget], None] | None = None

    def __init__(self, *args, **kwargs) -> None:
        bundle_carrier()  # opened first: its front end imports the bundle this one awaits
        super().__init__(*args, **kwargs)
        self.on_msg(self._front_end_msg)

    def _front_end_msg(self, _widget, content, _buffers) -> None:
        kind = content.get("pcpviz") if isinstance(content, dict) else None
        if kind == "ping":
            self.send({"pcpviz": "pong"})
        elif kind == "deaf" and self.on_deaf is not None:
            self.on_deaf(self)

    def get_state(self, key=None, drop_defaults=False):  # ipywidgets.Widget.get_state
        """The widget's state, with the figure it shows now as ``_widget_data`` / ``_widget_layout``."""
        state = super().get_state(key, drop_defaults=drop_defaults)
        current = {"_widget_data": getattr(self, "_data", None), "_widget_layout": getattr(self, "_layout", None)}
        for k, v in current.items():
            if k in state and v is not None:
                state[k] = self.trait_metadata(k, "to_json")(v, self)
        return state
