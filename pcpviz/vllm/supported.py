"""The one vLLM version pcpviz drives, records and replays (the plugin, the launcher and the CPU
patches check it; ``pcpviz.vllm`` re-exports it). A leaf module: the launcher imports it without
importing the package's ``__init__``, which reaches the launcher lazily."""

SUPPORTED_VLLM_VERSION = "0.33.0"
