"""How much one engine run may be asked to do: prompts and prompt tokens, bounded before any
rank starts (a 5M-prompt --prompts-file is one line, not gigabytes of scheduler state)::

    check_prompt_budget(["def f(", "import os"])   # fine
    check_prompt_budget(["x"] * 5000)              # ValueError: 5000 prompts; a run takes at most 4096
"""

from __future__ import annotations

from typing import Sequence

from pcpviz.limits import MAX_PROMPT_TOKENS, MAX_PROMPTS

__all__ = ["check_prompt_budget"]



def check_prompt_budget(prompts: Sequence) -> None:
    """ValueError (one line) for no prompts, more than ``MAX_PROMPTS`` prompts or more than
    ``MAX_PROMPT_TOKENS`` tokens (or characters of a string prompt, about as many tokens)."""
    if not prompts:
        raise ValueError("no prompts given")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"{len(prompts)} prompts; a run takes at most {MAX_PROMPTS}")
    total = 0
    for i, p in enumerate(prompts):
        total += len(p) if isinstance(p, (str, list, tuple)) else 0
        if total > MAX_PROMPT_TOKENS:
            raise ValueError(f"prompts 0..{i} hold more than {MAX_PROMPT_TOKENS} tokens (characters); "
                             "a run prefills at most that many")
