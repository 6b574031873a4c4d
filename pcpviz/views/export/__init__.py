"""Exports of a trace: a self-contained HTML page and a Chrome trace."""
