"""Export files appear whole or not at all, and never through a device or FIFO: the views'
name for ``pcpviz.trace.outputs.atomic_output`` (one helper for every file pcpviz writes)::

    with atomic_output("runs/demo.html") as fh:   # fh: a text file in runs/.demo.html.<rand>.tmp
        fh.write(doc)                             # renamed to runs/demo.html on success
"""

from __future__ import annotations

from pcpviz.trace.outputs import SpecialFileError, atomic_output

__all__ = ["atomic_output", "SpecialFileError"]
