"""ipywidgets + plotly views over pcpviz layouts and traces.

``LayoutBuilder`` and ``Workbench`` are imported on first use: the HTML exporter and the CLI read
``pcpviz.views.widgets.status`` alone, and plotly's ``FigureWidget`` pulls nbformat and jsonschema
(about 3 s on the 2-core development machine, most of it building an RFC 3987 grammar) that no
command needs.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LayoutBuilder", "Workbench"]

_WHERE = {"LayoutBuilder": "pcpviz.views.widgets.layout_builder", "Workbench": "pcpviz.views.widgets.workbench"}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'pcpviz.views.widgets' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
