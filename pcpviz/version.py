"""pcpviz's version: a leaf module, so the trace writer stamps it into each rank file without
importing the package's ``__init__`` (which reaches ``pcpviz.run`` and the engine)."""

__version__ = "0.1.0"
