"""Speculative-decoding acceptance, vLLM's definitions: the one implementation.

The engine's run summary (``pcpviz.run``), ``pcpviz diff``, the Workbench and the HTML export,
and the catalogue of shipped traces all count through ``count``/``Counts`` and divide through
``Counts.rates``. The definitions are vLLM 0.33.0's ``SpecDecodingStats``: a *draft* is one
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
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from pcpviz.trace import TraceError
from pcpviz.trace.schema import int_view, rank_file_name
from pcpviz.trace.validate import MAX_SPECULATIVE_TOKENS

__all__ = ["Counts", "count", "ratio", "json_ratio", "verify_counts", "RequestAcceptance",
           "StepAcceptance", "Acceptance", "acceptance", "acceptance_from_records"]


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
    ``max(k, widest acceptance)`` entries."""
    nacc = np.asarray(num_accepted, dtype=np.int64).reshape(-1)
    nd = np.asarray(num_draft_tokens, dtype=np.int64).reshape(-1)
    if nacc.shape != nd.shape:
        raise ValueError(f"num_accepted has {nacc.shape[0]} rows, num_draft_tokens {nd.shape[0]}")
    has = nd > 0
    width = max(int(k), int(nacc[has].max()) if has.any() else 0)
    per = ((np.arange(width)[None, :] < nacc[:, None]) & has[:, None]).sum(axis=0)
    return Counts(int(has.sum()), int(nd[has].sum()), int(nacc[has].sum()), tuple(int(x) for x in per))


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


# --------------------------------------------------------------------------- a run's acceptance

@dataclass(frozen=True)
class RequestAcceptance:
    req_id: str
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]

    @property
    def mean_acceptance_length(self) -> float:
        return Counts(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens).mean_acceptance_length

    @property
    def acceptance_rate(self) -> float:
        return ratio(self.num_accepted_tokens, self.num_draft_tokens)


@dataclass(frozen=True)
class StepAcceptance:
    step: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int


@dataclass(frozen=True)
class Acceptance:
    """Speculative-decoding acceptance of one run (vLLM's definitions; see the module doc)."""

    num_speculative_tokens: int  # K
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # length K
    rate_per_position: tuple[float, ...]  # accepted_per_position[k] / num_drafts (NaN: no drafts)
    acceptance_rate: float  # num_accepted_tokens / num_draft_tokens (NaN: no drafts)
    mean_acceptance_length: float  # 1 + num_accepted_tokens / num_drafts (NaN: no drafts)
    per_request: Mapping[str, RequestAcceptance]
    per_step: tuple[StepAcceptance, ...]
    rank: int | None  # the rank whose verify records were read

    def to_dict(self) -> dict[str, Any]:
        f = json_ratio
        return {
            "num_speculative_tokens": self.num_speculative_tokens, "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_position),
            "acceptance_rate_per_pos": [f(x) for x in self.rate_per_position],
            "acceptance_rate": f(self.acceptance_rate), "mean_acceptance_length": f(self.mean_acceptance_length),
            "rank": self.rank,
            "per_request": {k: {"num_drafts": v.num_drafts, "num_draft_tokens": v.num_draft_tokens,
                                "num_accepted_tokens": v.num_accepted_tokens,
                                "num_accepted_tokens_per_pos": list(v.accepted_per_position),
                                "mean_acceptance_length": f(v.mean_acceptance_length)}
                            for k, v in self.per_request.items()},
        }


def _check_draft_width(nd: np.ndarray, k: int | None) -> None:
    """A request carries at most K draft tokens (``MAX_SPECULATIVE_TOKENS`` where K is unknown):
    a wider count is a malformed view, not a measurement (and would size ``count``'s arrays)."""
    cap = MAX_SPECULATIVE_TOKENS if k is None else min(int(k), MAX_SPECULATIVE_TOKENS)
    if nd.size and int(nd.max()) > cap:
        i = int(np.argmax(nd))
        raise ValueError(f"request row {i} carries {int(nd[i])} draft tokens, more than "
                         f"{'K = ' + str(cap) if k is not None else f'the bound {cap}'}")


def acceptance_from_records(records: Iterable[tuple[int, Mapping[str, Any]]], *, k: int | None = None,
                            rank: int | None = None) -> Acceptance:
    """``Acceptance`` from ``(step, verify record)`` pairs (records without the counts are
    skipped). K is ``k``, else the width of ``sampled_token_ids`` minus one."""
    total = Counts()
    per_req: dict[str, Counts] = {}
    steps = []
    for step, rec in records:
        try:
            counts = verify_counts(rec)
            if counts is None:
                continue
            nacc, nd = counts
            ids = np.asarray(rec["req_ids"]) if "req_ids" in rec else np.arange(nd.size)
            if nacc.ndim != 1 or nd.shape != nacc.shape or ids.shape != nacc.shape:
                raise ValueError(f"num_accepted {list(nacc.shape)}, num_draft_tokens {list(nd.shape)} and "
                                 f"req_ids {list(ids.shape)} are not one entry per request")
            if ((nd < 0) | (nacc < 0) | (nacc > nd)).any():
                i = int(np.flatnonzero((nd < 0) | (nacc < 0) | (nacc > nd))[0])
                raise ValueError(f"request row {i} accepts {int(nacc[i])} of {int(nd[i])} draft tokens")
            ids = rec["req_ids"].tolist() if "req_ids" in rec else [f"row{i}" for i in range(nd.shape[0])]
            if k is None and "sampled_token_ids" in rec and np.ndim(rec["sampled_token_ids"]) == 2:
                k = int(np.shape(rec["sampled_token_ids"])[1]) - 1
            _check_draft_width(nd, k)  # keeps count()'s width and the sums bounded
            c = count(nacc, nd)
            req_counts = [(str(ids[i]), count(nacc[i:i + 1], nd[i:i + 1])) for i in np.flatnonzero(nd > 0)]
        except (IndexError, ValueError, TypeError, KeyError) as exc:  # a producer's malformed view
            raise ValueError(f"step {step}: verify: malformed acceptance counts: "
                             f"{' '.join(str(exc).split())}") from None
        total = total + c
        steps.append(StepAcceptance(int(step), c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens))
        for rid, rc in req_counts:
            per_req[rid] = per_req.get(rid, Counts()) + rc
    k = int(k or 0)
    total = total.widened(k)
    width = len(total.accepted_per_position)
    requests = {rid: RequestAcceptance(rid, c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens,
                                       c.widened(width).accepted_per_position)
                for rid, c in per_req.items()}
    return Acceptance(
        num_speculative_tokens=k, num_drafts=total.num_drafts, num_draft_tokens=total.num_draft_tokens,
        num_accepted_tokens=total.num_accepted_tokens, accepted_per_position=total.accepted_per_position,
        rate_per_position=total.rate_per_position, acceptance_rate=total.acceptance_rate,
        mean_acceptance_length=total.mean_acceptance_length,
        per_request=MappingProxyType(requests), per_step=tuple(steps), rank=rank,
    )


def acceptance(trace: Any, *, rank: int | None = None) -> Acceptance:
    """Acceptance statistics from the verify records of ``rank`` (default: the lowest rank;
    verify is identical on every rank unless a fault made them diverge). ``trace`` is a
    ``pcpviz.trace.Trace`` (or anything with its ``ranks``/``rank_steps``/``has``/``record``/
    ``meta``) or a run directory. K is run.json's ``num_speculative_tokens``, else the width of
    ``sampled_token_ids`` minus one."""
    if isinstance(trace, (str, os.PathLike)):
        from pcpviz.trace import open as open_trace

        trace = open_trace(trace)
    if rank is None:
        rank = trace.ranks[0] if trace.ranks else None
    k_meta = trace.meta.get("num_speculative_tokens")
    k = int(k_meta) if isinstance(k_meta, (int, float)) and not isinstance(k_meta, bool) else None
    steps = [] if rank is None else trace.rank_steps(rank)
    records = ((s, trace.record(s, rank, "verify")) for s in steps if trace.has(s, rank, "verify"))
    try:
        return acceptance_from_records(records, k=k, rank=rank)
    except ValueError as exc:
        if isinstance(exc, TraceError):  # names its file already
            raise
        raise ValueError(f"{Path(str(trace.path)) / rank_file_name(rank)}: {exc}") from None
