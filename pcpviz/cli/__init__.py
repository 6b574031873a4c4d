"""The ``pcpviz`` command: one subcommand per task (``pcpviz --help``), one-line errors."""

from pcpviz.cli.commands import main

__all__ = ["main"]
