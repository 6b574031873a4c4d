"""ipywidgets + plotly views over pcpviz layouts and traces."""

from pcpviz.views.widgets.layout_builder import LayoutBuilder
from pcpviz.views.widgets.workbench import Workbench

__all__ = ["LayoutBuilder", "Workbench"]
