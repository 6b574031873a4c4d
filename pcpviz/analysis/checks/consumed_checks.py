"""What each draft forward consumed against what was prepared for it (vLLM plugin traces).

The plugin records a draft phase twice: the speculator's and the PCP manager's prepared buffers
(``draft_input_ids``, ``draft_positions``, ``slot_mapping_draft``; ``hidden_in_fp``) and what the
forward consumed (``fwd_*``: the draft model's arguments, or a FULL graph's captured buffers read
right before its replay; ``fwd_source`` says which, ``pcpviz.vllm.recording.consumed``). A bug
between the two, e.g. positions shifted by one on their way to RoPE in the first draft forward,
leaves every prepared view right; here it fails at its own phase::

    draft_0 fwd_positions: the forward consumed other positions than were prepared
            index 0: prepared 20, consumed 21

Rows: the prepared views' (a padded graph batch feeds more rows; draft decodes record R rows).
"""

from __future__ import annotations

import numpy as np

from pcpviz.trace import draft_index

from .columns import Block, bulk_skip
from .context import Ctx, Skip, check

PAIRS = (("fwd_positions", "draft_positions", "positions"), ("fwd_input_ids", "draft_input_ids", "token ids"),
         ("fwd_slot_mapping", "slot_mapping_draft", "KV slots"), ("fwd_hidden_fp", "hidden_in_fp", "hidden rows"))
"""(consumed view, prepared view, what they hold)."""


def _prefix(consumed: np.ndarray, prepared: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The two views on the prepared rows (last axis), or None when they cannot be lined up."""
    c, p = np.asarray(consumed), np.asarray(prepared)
    if p.ndim == 1 and c.ndim == 2 and c.shape[0] == 1:
        c = c[0]
    if c.ndim != p.ndim or c.shape[:-1] != p.shape[:-1] or c.shape[-1] < p.shape[-1]:
        return None
    return c[..., : p.shape[-1]].astype(np.int64), p.astype(np.int64)


_NO_SOURCE = "no fwd_source (no consumed inputs recorded: a trace of another producer or an older plugin)"


@check("forward_consumed_prepared",
       "each draft forward consumed what the speculator and the PCP manager prepared for it: its fwd_positions, "
       "fwd_input_ids, fwd_slot_mapping and fwd_hidden_fp equal draft_positions, draft_input_ids, "
       "slot_mapping_draft and hidden_in_fp on the prepared rows (the plugin's fwd_* views; other traces skip it)")
def forward_consumed_prepared(c: Ctx) -> None:
    phases = [p for _, p in c.draft_phases() if c.get(p, "fwd_source") is not None]
    if not phases:
        raise Skip(_NO_SOURCE)
    for phase in phases:
        source = str(c.get(phase, "fwd_source"))
        for consumed_view, prepared_view, what in PAIRS:
            consumed, prepared = c.get(phase, consumed_view), c.get(phase, prepared_view)
            if consumed is None or prepared is None:
                continue
            lined = _prefix(consumed, prepared)
            if lined is None:
                c.fail(phase, consumed_view, f"the forward consumed {what} of shape {tuple(np.shape(consumed))}, "
                       f"prepared {tuple(np.shape(prepared))} ({prepared_view}; read from {source})")
            got, want = lined
            c.expect(phase, consumed_view, want=want, got=got,
                     what=f"the forward consumed other {what} than were prepared in {prepared_view} "
                          f"(consumed read from {source})")


@bulk_skip("forward_consumed_prepared")
def _no_fwd_source(b: Block, rank: int) -> list:
    """The check's first test: no draft phase of the rank recorded fwd_source."""
    return [None if any(draft_index(p) is not None and "fwd_source" in rec for p, rec in sv.recs.get(rank, {}).items())
            else _NO_SOURCE for sv in b.svs]
