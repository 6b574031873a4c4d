"""ipywidgets + plotly views over pcpviz layouts and traces."""

from pcpviz.widgets.layout_builder import LayoutBuilder

__all__ = ["LayoutBuilder"]
