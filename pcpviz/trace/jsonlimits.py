"""JSON from files we did not write, parsed without deep recursion.

``json.loads`` recurses once per nesting level. A hostile file nested 100,000 deep raises
RecursionError, and on CPython 3.11 catching that can leave the interpreter's AST recursion
counter off, so a later, unrelated ``ast.parse`` fails with "AST constructor recursion depth
mismatch". Triton's interpreter hits that. ``loads_bounded`` measures the depth with a loop first
and refuses deep input before ``json.loads`` sees it.

    loads_bounded('{"a": [1, 2]}')           # {'a': [1, 2]}
    loads_bounded("[" * 1000 + "]" * 1000)   # ValueError: nested too deeply (more than 200 levels)
    loads_bounded('{"pcp": 2, "pcp": 7}')    # ValueError: duplicate key 'pcp' (json.loads keeps the last)
"""

from __future__ import annotations

import json
from typing import Any

from pcpviz.limits import MAX_JSON_DEPTH

__all__ = ["loads_bounded"]


def _depth(text: str) -> int:
    """The deepest nesting of [ and { outside strings (a loop, no recursion)."""
    depth = deepest = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def loads_bounded(data: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` for input nested at most ``max_depth`` levels; deeper input raises
    ValueError (one line) without recursing. An object that names a key twice raises too:
    which of two values a file meant is not ours to guess."""
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    if text.count("[") + text.count("{") > max_depth and _depth(text) > max_depth:
        raise ValueError(f"nested too deeply (more than {max_depth} levels)")
    return json.loads(text, object_pairs_hook=_unique_keys)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out
