"""Speculative-decoding acceptance counts, vLLM's definitions: the one implementation.

Below the producers and the analysis alike: the engine's run summary (``pcpviz.run``) counts
through ``count``/``Counts`` as it runs, and a trace's acceptance (``pcpviz.analysis.acceptance``:
``pcpviz diff``, the Workbench, the HTML export, the catalogue) sums the same ``Counts`` and
divides through their properties. The definitions are vLLM 0.33.0's ``SpecDecodingStats``: a *draft* is one
request in one step that carried draft tokens (``num_draft_tokens > 0`` in verify)::

    num_drafts                       number of such (request, step) verify events
    num_draft_tokens                 draft tokens they carried
    num_accepted_tokens              draft tokens accepted
    num_accepted_tokens_per_pos[k]   events whose draft at position k was accepted
                                     (k < num_accepted), k = 0..K-1
    acceptance rate at position k    num_accepted_tokens_per_pos[k] / num_drafts
    acceptance rate                  num_accepted_tokens / num_draft_tokens
    mean acceptance length           1 + num_accepted_tokens / num_drafts

**Edge policy: a ratio whose denominator is 0 is NaN** (nothing was drafted: there is no rate,
and 0 or 1 would read as a measurement). ``to_dict``/``json_ratio`` write NaN as ``null``, the
figures draw nothing for it and print ``-``.

A PCP=2, K=2 step with two requests, ``a`` accepting both drafts and ``b`` none::

    >>> c = count(num_accepted=[2, 0], num_draft_tokens=[2, 2], k=2)
    >>> c.num_drafts, c.num_accepted_tokens, c.accepted_per_position
    (2, 2, (1, 1))
    >>> c.rate_per_position, c.acceptance_rate, c.mean_acceptance_length
    ((0.5, 0.5), 0.5, 2.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from pcpviz.trace.schema import int_view

__all__ = ["Counts", "count", "count_rows", "ratio", "json_ratio", "verify_counts", "SMALL_BATCH", "METRIC_PER_POS",
           "vllm_acceptance_metric"]


def ratio(num: float, den: float) -> float:
    """``num / den``, NaN when ``den`` is 0 (the edge policy)."""
    return num / den if den else math.nan


def json_ratio(x: float) -> float | None:
    """A ratio for strict JSON: NaN becomes None."""
    return None if isinstance(x, float) and math.isnan(x) else x


@dataclass(frozen=True)
class Counts:
    """Acceptance counts (of a step, a request or a run); ``+`` adds two."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # int[K]

    def __add__(self, other: "Counts") -> "Counts":
        a, b = self.accepted_per_position, other.accepted_per_position
        w = max(len(a), len(b))
        per = tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(w))
        return Counts(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                      self.num_accepted_tokens + other.num_accepted_tokens, per)

    def widened(self, k: int) -> "Counts":
        """The same counts with ``accepted_per_position`` zero-padded to at least ``k`` positions."""
        pad = max(0, k - len(self.accepted_per_position))
        return Counts(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                      self.accepted_per_position + (0,) * pad)

    @property
    def rate_per_position(self) -> tuple[float, ...]:
        return tuple(ratio(a, self.num_drafts) for a in self.accepted_per_position)

    @property
    def acceptance_rate(self) -> float:
        return ratio(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + ratio(self.num_accepted_tokens, self.num_drafts) if self.num_drafts else math.nan


def count(num_accepted: Sequence[int] | np.ndarray, num_draft_tokens: Sequence[int] | np.ndarray, *,
          k: int = 0) -> Counts:
    """Counts of one verify outcome: ``num_accepted`` and ``num_draft_tokens`` are int[R] (one
    entry per request); rows without drafts do not count. ``accepted_per_position`` has
    ``max(k, widest acceptance)`` entries. A batch of up to ``SMALL_BATCH`` requests (every decode
    step of a small deployment) is counted on Python integers: NumPy's per-call cost is most of
    the work there, and a 100,000-step trace counts 200,000 of them."""
    nacc = np.asarray(num_accepted, dtype=np.int64).reshape(-1)
    nd = np.asarray(num_draft_tokens, dtype=np.int64).reshape(-1)
    if nacc.shape != nd.shape:
        raise ValueError(f"num_accepted has {nacc.shape[0]} rows, num_draft_tokens {nd.shape[0]}")
    if nd.shape[0] <= SMALL_BATCH:
        return count_rows(nacc.tolist(), nd.tolist(), k=k)
    has = nd > 0
    width = max(int(k), int(nacc[has].max()) if has.any() else 0)
    per = ((np.arange(width)[None, :] < nacc[:, None]) & has[:, None]).sum(axis=0)
    return Counts(int(has.sum()), int(nd[has].sum()), int(nacc[has].sum()), tuple(int(x) for x in per))


SMALL_BATCH = 64
"""Requests up to which ``count`` counts on Python integers (``count_rows``)."""


def count_rows(num_accepted: list[int], num_draft_tokens: list[int], *, k: int = 0) -> Counts:
    """``count`` of Python integer lists of equal length (the same counts, without NumPy)."""
    rows = [(a, d) for a, d in zip(num_accepted, num_draft_tokens) if d > 0]
    width = max(int(k), max((a for a, _ in rows), default=0))
    per = [0] * width
    for a, _ in rows:
        for j in range(min(a, width)):
            per[j] += 1
    return Counts(len(rows), sum(d for _, d in rows), sum(a for a, _ in rows), tuple(per))


def verify_counts(rec: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(num_accepted, num_draft_tokens)`` int64[R] of a verify record; ``num_draft_tokens`` is
    ``num_accepted + num_rejected`` where a producer did not record it; None without either."""
    if "num_accepted" not in rec:
        return None
    nacc = int_view(rec["num_accepted"], "num_accepted")
    if "num_draft_tokens" in rec:
        return nacc, int_view(rec["num_draft_tokens"], "num_draft_tokens")
    if "num_rejected" in rec:
        return nacc, nacc + int_view(rec["num_rejected"], "num_rejected")
    return None


METRIC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_acceptance_metric(meta: Any) -> list[int] | None:
    """vLLM's own per-position accepted-token counter (``vllm:spec_decode_num_accepted_tokens_per_pos``,
    from ``LLM.get_metrics()``) if a recording stored it anywhere in its ``run.json``, else None."""
    if isinstance(meta, Mapping):  # run.json as read (Trace.meta is a read-only mapping), or a part of it
        for key, value in meta.items():
            if key in (METRIC_PER_POS, "num_accepted_tokens_per_pos") and isinstance(value, list):
                return [int(v) for v in value]
            found = vllm_acceptance_metric(value)
            if found is not None:
                return found
    elif isinstance(meta, list):
        for value in meta:
            found = vllm_acceptance_metric(value)
            if found is not None:
                return found
    return None
