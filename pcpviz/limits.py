"""Every bound pcpviz puts on its input, in one table: what a trace file may dictate, and what a run
of the engine may ask for. Each module that checks a bound imports it from here
(``tests/repo/test_limits.py`` holds that no other module defines one of these names, and that a run
the engine accepts writes a trace the reader accepts).

Two tables because two kinds of input:

* **A trace** comes from any producer, real vLLM 0.33.0 included, so its bounds are wide: they
  keep a damaged or hostile file from sizing an allocation, never refuse a run vLLM could make.
  vLLM 0.33.0 bounds the KV block size only from below (``CacheConfig.block_size: int =
  Field(default=None, gt=0)``, vllm/config/cache.py:187), so the trace's bound is ours and wide,
  ``MAX_BLOCK_SIZE = 2**20``: it only stops a file from sizing an allocation. Parallel sizes are bounded by
  ``MAX_WORLD_SIZE``, which is also the most rank files a trace may have (one per PCP rank).
* **A run of pcpviz's own engine** (``pcpviz.run``, ``pcpviz run``) is narrower: it is a tiny
  model on CPU processes or a few GPUs, and each bound is what that engine sensibly allocates. Each
  is at most its trace bound, so every trace the engine writes is one the reader takes
  (``MAX_ENGINE_BLOCK_SIZE`` 4096 <= ``MAX_BLOCK_SIZE``; ``MAX_CPU_RANKS`` 32 <= ``MAX_WORLD_SIZE``).

A PCP=2 example: a run.json saying ``"pcp": 2, "block_size": 16, "num_speculative_tokens": 2`` is
within every bound; ``"block_size": 2097152`` is refused with one line naming run.json and the key
(``pcpviz.trace.validate``), and ``pcpviz run --block-size 8192`` with one line naming the option.

Presentation caps (how many steps or ranks an HTML report precomputes, how many labels a figure
draws) are not input bounds: they stay beside the figure that uses them.
"""

from __future__ import annotations

__all__ = [
    "MAX_WORLD_SIZE", "MAX_SPECULATIVE_TOKENS", "MAX_BLOCK_SIZE", "MAX_COUNT", "MAX_INDEX", "MAX_TOKENS",
    "MAX_STRING_CHARS", "MAX_NDIM", "MAX_RECORD_BYTES", "MAX_META_BYTES", "MAX_JSON_DEPTH",
    "MAX_JSON_INPUT_BYTES", "MAX_LAYOUT_WORLD", "MAX_LAYOUT_TOKENS", "MAX_LAYOUT_ROWS", "MAX_LAYOUT_SLOTS",
    "MAX_SYNTH_TOKENS", "MAX_CPU_RANKS",
    "MAX_ENGINE_BLOCK_SIZE", "MAX_BATCHED_TOKENS", "MAX_NUM_SEQS", "MAX_TIMEOUT_S", "MAX_PROMPTS", "MAX_PROMPT_TOKENS",
    "MAX_ONSET_STEP", "MAX_SAFETENSORS_HEADER_BYTES",
]

# --------------------------------------------------------------------------- a trace

MAX_WORLD_SIZE = 4096
"""Largest pcp / dcp / tp accepted in run.json, and so the most rank files a trace may have
(``rank99999.arrow`` is not read)."""
MAX_SPECULATIVE_TOKENS = 64
"""Largest K (run.json's num_speculative_tokens), and the most draft tokens one request carries."""
MAX_BLOCK_SIZE = 1 << 20
"""Largest KV block size (and DCP interleave) accepted in run.json; vLLM 0.33.0 sets no upper bound."""
MAX_COUNT = 1 << 40
"""Largest token budget, length or vocabulary size accepted in run.json."""
MAX_INDEX = (1 << 31) - 1
"""Largest position, length, slot, block id or row index a view may hold (vLLM keeps them in
int32 on the GPU)."""
MAX_TOKENS = 1 << 24
"""Most tokens one step may schedule (global ``T``), and the longest any 1-d view may be."""
MAX_STRING_CHARS = 4096
"""Longest string (a request id) a view may hold."""
MAX_NDIM = 4
"""Most axes any view may have (the widest declared is [G, R, W])."""
MAX_RECORD_BYTES = 16 << 20
"""A completion record (complete.json) larger than this is refused (an entry is ~150 bytes)."""
MAX_META_BYTES = 64 << 20
"""A run.json larger than this is refused (it holds settings and prompt ids, not data)."""
MAX_JSON_DEPTH = 200
"""Deepest nesting of any JSON pcpviz reads from a file it did not write itself."""
MAX_JSON_INPUT_BYTES = 64 << 20
"""A JSON input file of the command line (``--prompts-file``, the cost model's ``--fit``) larger
than this is refused."""

# --------------------------------------------------------------------------- a run

MAX_LAYOUT_WORLD = 1024
"""Largest ``--pcp`` / ``--dcp`` of ``pcpviz layout`` and ``pcpviz run`` (a drawing or a run past
this is not one anybody reads)."""
MAX_LAYOUT_TOKENS = 1 << 16
"""Most scheduled tokens of the batch ``pcpviz layout`` draws (what a text diagram can show)."""
MAX_LAYOUT_ROWS = 4096
"""Most requests of the batch ``pcpviz layout`` draws."""
MAX_LAYOUT_SLOTS = 1 << 20
"""Most slots of ``pcpviz layout``'s maps: --pcp x (--pad or tokens) and --pcp x rows (each option
within its own bound can still multiply to gigabytes)."""
MAX_SYNTH_TOKENS = 1 << 20
"""Most prompt tokens of one ``pcpviz synth`` trace, all requests together (~45 MB of trace per 128k
tokens at PCP = 4); its rank-local rows (tokens x ranks) at most 8 times this."""
MAX_CPU_RANKS = 32
"""Most ranks (processes) a CPU run of the engine starts."""
MAX_ENGINE_BLOCK_SIZE = 4096
"""Largest KV block size a run of the engine takes (its KV cache is allocated whole)."""
MAX_BATCHED_TOKENS = 1 << 20
"""Largest max_num_batched_tokens of a run of the engine."""
MAX_NUM_SEQS = 4096
"""Largest max_num_seqs (requests in one step) of a run of the engine."""
"""Largest max_num_batched_tokens of a run of the engine."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest timeout of a run of the engine (a week)."""
MAX_PROMPTS = 4096
"""Most prompts one run takes (each is a request the scheduler keeps state for)."""
MAX_PROMPT_TOKENS = 1 << 22
"""Most prompt tokens, all prompts together, one run prefills."""
MAX_ONSET_STEP = 1 << 20
"""Latest step a fault may start at (``NAME@STEP``): no run is longer; a larger step would
never fire, so it is refused rather than accepted silently."""

MAX_SAFETENSORS_HEADER_BYTES = 100 << 20
"""A model's ``model.safetensors`` header past this is refused before it is read (the format's
own reader has the same bound): ``pcpviz.engine.model_files``."""
