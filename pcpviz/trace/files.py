"""The names of a run directory's files (``pcpviz.trace.schema`` re-exports them)::

    runs/x/run.json  rank0.arrow  rank1.arrow  complete.json
"""

import re

__all__ = ["RUN_META_FILE", "COMPLETION_FILE", "COMPLETION_KEY", "RANK_FILE_RE", "rank_file_name"]

RUN_META_FILE = "run.json"
"""Name of the run's meta file inside the run directory."""

COMPLETION_FILE = "complete.json"
"""The completion record (``pcpviz.trace.completion``), written last by a writer that ends cleanly."""
COMPLETION_KEY = "pcpviz_completion"
"""Arrow schema metadata key of a rank file whose writer writes ``COMPLETION_FILE`` (its value)."""

RANK_FILE_RE = re.compile(r"^rank(0|[1-9][0-9]*)\.arrow$")
"""File names of rank files; the number is the rank."""


def rank_file_name(rank: int) -> str:
    """``rank3.arrow`` for rank 3."""
    return f"rank{int(rank)}.arrow"
