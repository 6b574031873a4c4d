"""Views of a trace: figures, the Workbench widgets, the text diagram, exports."""
