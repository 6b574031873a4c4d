"""A compact text description of one global batch, for the CLI and notebooks.

Grammar: comma-separated rows, each ``<kind><tokens>[@<computed>]``:

* ``p13``     a fresh 13-token prefill (computed 0)
* ``p10@12``  a continued prefill chunk: 10 tokens from position 12
* ``d1``      a decode with no drafts; ``d4`` a decode carrying 3 drafts
* ``d4@20``   that decode, its cursor at position 20 (default: 16 for decodes)
* ``p0``/``d0`` a zero-token row (scheduled but given nothing this step)

Example: ``p13,d1,d4`` = a 13-token prefill and two decodes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pcpviz.batch import GlobalBatch

__all__ = ["BatchSpec", "parse_batch_spec"]

_ROW = re.compile(r"^(?P<kind>[pd])(?P<tokens>\d+)(?:@(?P<computed>\d+))?$")
DEFAULT_DECODE_CURSOR = 16


@dataclass(frozen=True)
class BatchSpec:
    kinds: tuple[str, ...]  # 'p' or 'd' per row
    num_scheduled_tokens: tuple[int, ...]
    num_computed_tokens: tuple[int, ...]

    @property
    def is_prefilling(self) -> tuple[bool, ...]:
        return tuple(k == "p" for k in self.kinds)

    def to_global_batch(self) -> GlobalBatch:
        """Request ids p0, d1, ...; a prefill's prompt ends with its chunk, a
        decode's prompt is taken to end before its cursor."""
        prefill_len = [
            c + q if k == "p" else max(c - 1, 0)
            for k, q, c in zip(self.kinds, self.num_scheduled_tokens, self.num_computed_tokens)
        ]
        return GlobalBatch.build(
            self.num_scheduled_tokens,
            self.num_computed_tokens,
            prefill_len=prefill_len,
            is_prefilling=self.is_prefilling,
            req_ids=[f"{k}{i}" for i, k in enumerate(self.kinds)],
        )


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
                f"batch row {i + 1} {raw.strip()!r} is not understood; expected p<tokens>[@<computed>] "
                "or d<tokens>[@<cursor>], e.g. 'p13', 'p10@12', 'd4@20'"
            )
        kind = m["kind"]
        default = 0 if kind == "p" else DEFAULT_DECODE_CURSOR
        kinds.append(kind)
        tokens.append(int(m["tokens"]))
        computed.append(int(m["computed"]) if m["computed"] is not None else default)
    return BatchSpec(tuple(kinds), tuple(tokens), tuple(computed))
