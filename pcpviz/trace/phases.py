"""The phase vocabulary of a trace: ``target``, ``draft_<k>``, ``verify``, ``dummy``; their
two orders (the listing order and the causal one) and the classes views are declared under.

PCP=2, K=3: a step records ``target``, ``draft_0`` (rank-local), ``draft_1`` and ``draft_2``
(replicated) and ``verify``; ``phase_sort_key`` lists them in that order, ``causal_phase_key``
puts ``verify`` before the drafts (vLLM samples, then proposes), and ``phase_class("draft_2")``
is ``draft_k``.
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

__all__ = ["PHASE_TARGET", "PHASE_VERIFY", "PHASE_DUMMY", "DRAFT_PHASE_PREFIX", "PHASES", "PHASE_CLASSES",
           "draft_phase", "draft_index", "is_valid_phase", "causal_phase_key", "phase_sort_key", "phase_class"]


PHASE_TARGET = "target"
"""The target model's forward on this rank's PCP-local rows."""
PHASE_VERIFY = "verify"
"""Sampling/rejection outcome on the global batch (identical on every rank)."""
PHASE_DUMMY = "dummy"
"""A profile/dummy run: the memory-profile run has no KV gather, other dummy runs all-gather, and an MoE
model's expert gather runs in every one (docs/vllm-0.33-pcp-mtp.md, dummy runs)."""
DRAFT_PHASE_PREFIX = "draft_"
"""Draft step k is phase ``draft_{k}``: k=0 rank-local draft prefill, k>=1 replicated decodes."""

PHASES: dict[str, str] = {
    PHASE_DUMMY: "profile/dummy run (the memory-profile run has no KV gather, other dummy runs all-gather; "
                 "an MoE model's expert gather runs in every one)",
    PHASE_TARGET: "target forward on the rank-local DualChunkSwap rows",
    "draft_<k>": "draft step k: k=0 rank-local draft prefill, k>=1 replicated draft decode",
    PHASE_VERIFY: "sampling/rejection outcome on the global batch",
}
"""The phase vocabulary with a one-line doc each (``draft_<k>`` stands for draft_0, draft_1, ...)."""

_PHASE_RE = re.compile(r"^(?:target|verify|dummy|draft_(?:0|[1-9][0-9]*))$")


def draft_phase(k: int) -> str:
    """Name of draft step ``k`` (``draft_phase(0) == "draft_0"``)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"draft step must be an int >= 0, got {k!r}")
    return f"{DRAFT_PHASE_PREFIX}{int(k)}"


def draft_index(phase: str) -> int | None:
    """k for ``draft_k``, None for any other phase."""
    return _draft_index(phase) if isinstance(phase, str) else None


@lru_cache(maxsize=1024)
def _draft_index(phase: str) -> int | None:
    if is_valid_phase(phase) and phase.startswith(DRAFT_PHASE_PREFIX):
        return int(phase[len(DRAFT_PHASE_PREFIX):])
    return None


@lru_cache(maxsize=1024)
def _valid_phase(phase: str) -> bool:
    return _PHASE_RE.match(phase) is not None


def is_valid_phase(phase: object) -> bool:
    """True for ``target``, ``verify``, ``dummy`` and ``draft_<int>`` (no leading zeros)."""
    return isinstance(phase, str) and _valid_phase(phase)


def causal_phase_key(phase: str) -> tuple[int, int]:
    """The order phases actually run in vLLM's ``sample_tokens``: target forward, then
    sampling/verification, then the drafter's propose (draft_0 .. draft_{K-1}). ``phase_sort_key``
    (the trace's listing order) shows ``verify`` last; checks, diffs and timelines need this one."""
    k = draft_index(phase)
    if k is not None:
        return (3, k)
    return {PHASE_DUMMY: (0, 0), PHASE_TARGET: (1, 0), PHASE_VERIFY: (2, 0)}.get(phase, (4, 0))


def phase_sort_key(phase: str) -> tuple[int, int]:
    """Execution order within a step: dummy, target, draft_0 .. draft_{K-1}, verify."""
    k = draft_index(phase)
    if k is not None:
        return (2, k)
    return {PHASE_DUMMY: (0, 0), PHASE_TARGET: (1, 0), PHASE_VERIFY: (3, 0)}[phase]


PHASE_CLASSES = (PHASE_TARGET, "draft_0", "draft_k", PHASE_VERIFY, PHASE_DUMMY)
"""The phase classes views are declared for: ``draft_k`` stands for every draft phase k >= 1."""


def phase_class(phase: str) -> str:
    """The class a phase's views are declared under: ``draft_3`` -> ``draft_k``."""
    k = draft_index(phase)
    return phase if k is None else ("draft_0" if k == 0 else "draft_k")
