"""ipywidgets + plotly views over pcpviz layouts and traces."""

from pcpviz.widgets.layout_builder import LayoutBuilder
from pcpviz.widgets.workbench import Workbench

__all__ = ["LayoutBuilder", "Workbench"]
