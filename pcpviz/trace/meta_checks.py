"""The structure checks of run.json's keys: each takes a JSON value and returns why it is
malformed (one phrase) or None. ``pcpviz.trace.meta_model`` names one per key (``META_SCHEMA``).

Only structure: the type, and the bounds of ``pcpviz.limits``. Whether a well-formed value is
true of the data (``pcp`` vs the rank files, ``block_size`` vs the slot mappings) is
``pcpviz.trace.validate``'s business. For example ``int_in(1, 4096)("2")`` is ``"expected an int
in 1..4096, got str '2'"``, ``int_in(1, 4096)(2)`` is None.
"""

from __future__ import annotations

from typing import Any, Callable

from pcpviz.limits import MAX_BLOCK_SIZE

__all__ = ["Check", "INT64", "int_in", "is_str", "is_bool", "str_list", "block_sizes", "token_ids",
           "prompt_list", "json_object", "launch_object"]

Check = Callable[[Any], "str | None"]
INT64 = 1 << 63


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def int_in(lo: int, hi: int) -> Check:
    """An int (not a bool) in ``lo..hi``."""
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return f"expected an int in {lo}..{hi}, got {type(v).__name__} {_short(v)}"
        if not lo <= v <= hi:
            return f"expected an int in {lo}..{hi}, got {_short(v)}"
        return None
    check.__doc__ = f"int in {lo}..{hi}"
    return check


def is_str(v: Any) -> str | None:
    return None if isinstance(v, str) else f"expected a string, got {type(v).__name__} {_short(v)}"


def is_bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else f"expected true or false, got {_short(v)}"


def str_list(v: Any) -> str | None:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        return f"expected a list of strings, got {_short(v)}"
    return None


def block_sizes(v: Any) -> str | None:
    if not isinstance(v, list) or not 1 <= len(v) <= 64:
        return f"expected a list of 1..64 block sizes, got {_short(v)}"
    for x in v:
        bad = int_in(1, MAX_BLOCK_SIZE)(x)
        if bad:
            return f"entry {_short(x)}: {bad}"
    return None


def token_ids(v: Any) -> str | None:
    """A list of prompts (or a dict request id -> prompt); a prompt is a list of ints >= 0."""
    prompts = v.values() if isinstance(v, dict) else v
    if not isinstance(v, (list, dict)):
        return f"expected a list of token-id lists, got {type(v).__name__}"
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not all(type(t) is int and 0 <= t < INT64 for t in p):
            return f"prompt {i}: expected a list of token ids (ints >= 0)"
    return None


def prompt_list(v: Any) -> str | None:
    """A list of prompts, each a string, a token-id list or an object (``{"prompt_token_ids": [...]}``)."""
    if not isinstance(v, list) or not all(isinstance(p, (str, list, dict)) for p in v):
        return f"expected a list of prompts (strings, token-id lists or objects), got {_short(v)}"
    return None


def json_object(v: Any) -> str | None:
    return None if isinstance(v, dict) else f"expected an object, got {type(v).__name__} {_short(v)}"


def launch_object(v: Any) -> str | None:
    """An object whose ``llm_kwargs``, ``sampling`` and ``env``, where recorded, are objects."""
    if not isinstance(v, dict):
        return json_object(v)
    for key in ("llm_kwargs", "sampling", "env"):
        if key in v and not isinstance(v[key], dict):
            return f"{key}: expected an object, got {type(v[key]).__name__} {_short(v[key])}"
    return None
