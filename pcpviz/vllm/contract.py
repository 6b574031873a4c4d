"""What pcpviz and vLLM agree on, in one leaf module (no import of the package's ``__init__``,
which reaches the launcher lazily): the one vLLM version pcpviz drives, records and replays (the
plugin, the launcher and the CPU patches check it; ``pcpviz.vllm`` re-exports it), and the
environment variable that turns the plugin on (the launcher sets it, the plugin and the recording
sessions read it)::

    PCPVIZ_TRACE_DIR=runs/x vllm serve ...   # the plugin records into runs/x
"""

__all__ = ["SUPPORTED_VLLM_VERSION", "ENV_TRACE_DIR", "ENV_FIXES"]

SUPPORTED_VLLM_VERSION = "0.33.0"

ENV_TRACE_DIR = "PCPVIZ_TRACE_DIR"
"""Directory the plugin records into (unset or empty: the plugin is inert)."""

ENV_FIXES = "PCPVIZ_FIXES"
"""pcpviz's opt-in patches of vLLM the plugin applies (``pcpviz.vllm.fixes``; the launcher passes it on)."""
