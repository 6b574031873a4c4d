"""The ``collectives`` view's line: one collective call as a producer records it.

``describe("all_gather", "pcp", tensor)`` -> ``"all_gather pcp float32[4, 64] dim=0"``: kind, group,
the dtype and shape this rank sent, the dimension it is gathered along. The CPU replay's
``FakePCPGroup`` (vLLM's own calls) and the engine's ``ProcessGroupPCP`` write the same lines, and
``pcpviz.analysis.checks.collective_checks`` reads them.

    >>> import numpy as np
    >>> describe("all_gather", "pcp", np.zeros((4, 64), dtype=np.float32))
    'all_gather pcp float32[4, 64] dim=0'
"""

from __future__ import annotations

from typing import Any

__all__ = ["describe"]


def describe(kind: str, group: str, tensor: Any, *, dim: int = 0) -> str:
    """One call: kind, group, the input's dtype and shape (torch or NumPy), the dimension."""
    dtype = str(getattr(tensor, "dtype", "?")).replace("torch.", "")
    shape = ", ".join(str(int(n)) for n in getattr(tensor, "shape", ()))
    return f"{kind} {group} {dtype}[{shape}] dim={dim}"
