"""One table of limits (issue 40): every bound pcpviz puts on its input is defined in
``pcpviz/limits.py`` and imported from there; no other module assigns one of those names (nor a
``MAX_*`` bound of a trace or a run under another name); a run the engine accepts writes a trace the
reader accepts; and each bound is enforced where it is read.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pcpviz import limits as L

ROOT = Path(__file__).resolve().parents[2]

# Presentation caps and the recorder's own knobs are not input bounds (pcpviz/limits.py says so).
NOT_INPUT_BOUNDS = {"MAX_ENTRIES", "MAX_DRAWN_RANKS", "MAX_PAGE_RUNS", "MAX_REPORT_RUNS", "MAX_TITLE_REQS",
                    "MAX_LABELS", "MAX_REPLACEMENTS", "MAX_STEPS", "DEFAULT_MAX_MB", "MAX_TEXT", "MAX_LINES",
                    # the recorder's cache of byte views (vllm/recording/copyplan.py): memory it holds, not input
                    "MAX_VIEWS", "MAX_HELD_BYTES", "MAX_ENTRY_BYTES", "MAX_PLANS", "MAX_UNREAD",
                    "MAX_POOLED_EVENTS"}  # vllm/recording/staged.py: CUDA events kept for reuse


def _module_assignments():
    for path in sorted((ROOT / "pcpviz").rglob("*.py")):
        if path == ROOT / "pcpviz" / "limits.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])
            for t in targets:
                for name in ([t] if isinstance(t, ast.Name) else getattr(t, "elts", [])):
                    if isinstance(name, ast.Name):
                        yield path.relative_to(ROOT), name.id, node.lineno


def test_no_other_module_defines_a_limit():
    names = set(L.__all__)
    assert {"MAX_WORLD_SIZE", "MAX_BLOCK_SIZE", "MAX_ENGINE_BLOCK_SIZE", "MAX_SPECULATIVE_TOKENS",
            "MAX_TOKENS"} <= names
    assert all(hasattr(L, n) for n in names)
    again = [f"{p}:{line}: {n}" for p, n, line in _module_assignments() if n in names]
    assert not again, "limits defined outside pcpviz/limits.py (import them from there):\n" + "\n".join(again)
    other = [f"{p}:{line}: {n}" for p, n, line in _module_assignments()
             if n.lstrip("_").startswith("MAX_") and n.lstrip("_") not in NOT_INPUT_BOUNDS]
    assert not other, "a bound outside the table (add it to pcpviz/limits.py):\n" + "\n".join(other)


def test_a_run_the_engine_takes_writes_a_trace_the_reader_takes():
    assert L.MAX_ENGINE_BLOCK_SIZE <= L.MAX_BLOCK_SIZE
    assert L.MAX_CPU_RANKS <= L.MAX_LAYOUT_WORLD <= L.MAX_WORLD_SIZE
    assert L.MAX_BATCHED_TOKENS <= L.MAX_TOKENS <= L.MAX_INDEX
    assert L.MAX_PROMPT_TOKENS <= L.MAX_COUNT


def test_the_bounds_are_enforced_where_they_are_read():
    from pcpviz.engine.run_config import build_config
    from pcpviz.trace.validate import validate_meta

    ok = {"producer": "test", "pcp": 2, "block_size": L.MAX_BLOCK_SIZE, "num_speculative_tokens": 2}
    assert validate_meta(ok, "run.json") == []
    for key, bad in (("block_size", L.MAX_BLOCK_SIZE + 1), ("pcp", L.MAX_WORLD_SIZE + 1),
                     ("num_speculative_tokens", L.MAX_SPECULATIVE_TOKENS + 1)):
        problems = [p.message for p in validate_meta({**ok, key: bad}, "run.json")]
        assert problems and all(m.startswith(f"run.json: {key}: ") for m in problems), (key, problems)
    for key, bad in (("block_size", L.MAX_ENGINE_BLOCK_SIZE + 1), ("max_num_seqs", L.MAX_NUM_SEQS + 1),
                     ("num_speculative_tokens", L.MAX_SPECULATIVE_TOKENS + 1)):
        with pytest.raises(ValueError, match=f"^{key}={bad} is larger than pcpviz runs"):
            build_config(["x"], pcp=1, device="cpu", **{key: bad})
