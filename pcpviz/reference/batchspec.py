"""A compact text description of one global batch, for the CLI and notebooks.

Grammar: comma-separated rows, each ``<kind><tokens>[@<computed>]``:

* ``p13``     a fresh 13-token prefill (computed 0)
* ``p10@12``  a continued prefill chunk: 10 tokens from position 12
* ``d1``      a decode with no drafts; ``d4`` a decode carrying 3 drafts
* ``d4@20``   that decode, its cursor at position 20 (default: 16 for decodes)
* ``p0``/``d0`` a zero-token row (scheduled but given nothing this step)

Example: ``p13,d1,d4`` = a 13-token prefill and two decodes. Rows count from 0 (as the
layout's request indices do) and are named by letter, ``row_name(i)``: A = row 0, B = row 1,
..., so a name never reads like a row description (``d1`` is a 1-token decode, not row 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["BatchSpec", "parse_batch_spec", "row_name"]

_ROW = re.compile(r"^(?P<kind>[pd])(?P<tokens>\d+)(?:@(?P<computed>\d+))?$")
DEFAULT_DECODE_CURSOR = 16


def row_name(i: int) -> str:
    """The name of batch row ``i``: ``A``..``Z`` for rows 0..25, then ``A1``..``Z1``, ``A2``, ...
    (the diagram's lanes draw row i's tokens with the letter ``row_name(i)[0]``)."""
    return chr(ord("A") + i % 26) + (str(i // 26) if i >= 26 else "")


@dataclass(frozen=True)
class BatchSpec:
    kinds: tuple[str, ...]  # 'p' or 'd' per row
    num_scheduled_tokens: tuple[int, ...]
    num_computed_tokens: tuple[int, ...]

    @property
    def is_prefilling(self) -> tuple[bool, ...]:
        return tuple(k == "p" for k in self.kinds)


def parse_batch_spec(spec: str) -> BatchSpec:
    """Parse ``"p13,d1,d4"``; raises ValueError naming the bad row."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("empty batch description; expected rows like 'p13,d1,d4'")
    kinds, tokens, computed = [], [], []
    for i, raw in enumerate(spec.split(",")):
        row = raw.strip().lower()
        m = _ROW.match(row)
        if not m:
            raise ValueError(
                f"batch row {i} {raw.strip()!r} (rows count from 0) is not understood; expected p<tokens>[@<computed>] "
                "or d<tokens>[@<cursor>], e.g. 'p13', 'p10@12', 'd4@20'"
            )
        kind = m["kind"]
        default = 0 if kind == "p" else DEFAULT_DECODE_CURSOR
        kinds.append(kind)
        tokens.append(int(m["tokens"]))
        computed.append(int(m["computed"]) if m["computed"] is not None else default)
    return BatchSpec(tuple(kinds), tuple(tokens), tuple(computed))
