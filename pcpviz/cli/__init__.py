"""The ``pcpviz`` command: one subcommand per task (``pcpviz --help``), one-line errors."""

from pcpviz.cli.main import main

__all__ = ["main"]
