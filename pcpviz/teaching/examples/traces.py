"""Which shipped trace a notebook opens (``pick_trace``), which pairs to diff
(``trace_pairs``), vLLM's own acceptance counter in a recording (``vllm_acceptance_metric``)
and a sentence about two runs' acceptance, computed from the numbers
(``describe_acceptance_change``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pcpviz.trace.acceptance import METRIC_PER_POS, vllm_acceptance_metric  # re-exported for the notebooks
from pcpviz.trace.meta_model import RunMeta, decode_meta

__all__ = ["describe_acceptance_change", "TracePick", "pick_trace", "trace_pairs", "vllm_acceptance_metric",
           "METRIC_PER_POS"]


def describe_acceptance_change(clean: Sequence[float], other: Sequence[float], *, tol: float = 0.05) -> str:
    """One line per draft position saying how ``other`` compares with ``clean``, from the numbers.

        >>> print(describe_acceptance_change([0.9, 0.5], [0.88, 0.1]))
        position 0: 0.90 -> 0.88 (unchanged, within 0.05)
        position 1: 0.50 -> 0.10 (dropped by 0.40)
    """
    if len(clean) != len(other):
        raise ValueError(f"{len(clean)} vs {len(other)} draft positions")
    lines = []
    for k, (a, b) in enumerate(zip(clean, other)):
        if math.isnan(a) or math.isnan(b):
            verdict = "no drafts"
        elif abs(b - a) <= tol:
            verdict = f"unchanged, within {tol:g}"
        else:
            verdict = f"{'dropped' if b < a else 'rose'} by {abs(b - a):.2f}"
        lines.append(f"position {k}: {a:.2f} -> {b:.2f} ({verdict})")
    return "\n".join(lines)


@dataclass(frozen=True)
class TracePick:
    path: Path
    producer: str
    recorded_by_vllm: bool  # by the vLLM plugin on a real deployment

    def __str__(self) -> str:
        return f"{self.path.name} (producer {self.producer})"


_PRODUCER_RANK = {"vllm-plugin": 0, "vllm-replay": 1, "pcpviz-engine": 2}


def pick_trace(root: str | Path) -> TracePick:
    """The trace directory under ``root`` a notebook should open: the first (by name) recorded by
    the vLLM plugin (``run.json`` ``producer == "vllm-plugin"``), else a vLLM CPU replay, else an
    engine trace; among those, one with K >= 2 first (it shows the view switch). Raises
    ValueError naming ``root`` when it holds no trace."""
    root = Path(root)
    found = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        meta = _run_meta(d)
        if meta is None:
            continue
        producer, k = meta.producer, meta.num_speculative_tokens
        shows_switch = isinstance(k, int) and k >= 2  # K <= 1: propose returns before the gather
        found.append((_PRODUCER_RANK.get(producer, 3), not shows_switch, d.name, d, producer))
    if not found:
        raise ValueError(f"{root}: no trace directory (with a run.json) found")
    *_, path, producer = min(found)
    return TracePick(path, producer, producer == "vllm-plugin")


def _run_meta(run_dir: Path) -> RunMeta | None:
    """``run_dir``'s run.json decoded, None where it has none that parses to a JSON object."""
    try:
        doc = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return None
    return decode_meta(doc)[0] if isinstance(doc, dict) else None


def _prompts_key(meta: RunMeta) -> str | None:
    """Runs worth diffing: the same prompts under the same PCP size and K."""
    key = "prompt_token_ids" if "prompt_token_ids" in meta.recorded else "prompts"
    prompts = meta.recorded_value(key)
    if prompts is None:
        return None
    return json.dumps([prompts, meta.pcp, meta.num_speculative_tokens])


def trace_pairs(root: str | Path) -> list[tuple[TracePick, TracePick]]:
    """Pairs of trace directories under ``root`` that recorded the same prompts (``run.json``
    ``prompt_token_ids`` or ``prompts``) with the same ``pcp`` and K, the ones to ``diff_traces``:
    vLLM-plugin recordings first, then by name. A directory without prompts in its ``run.json``
    pairs with nothing."""
    root = Path(root)
    groups: dict[str, list[tuple[int, str, TracePick]]] = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        meta = _run_meta(d)
        key = _prompts_key(meta) if meta is not None else None
        if key is None:
            continue
        producer = meta.producer
        groups.setdefault(key, []).append((_PRODUCER_RANK.get(producer, 3), d.name,
                                           TracePick(d, producer, producer == "vllm-plugin")))
    pairs = []
    for members in groups.values():
        members.sort(key=lambda m: m[:2])
        picks = [m[2] for m in members]
        pairs += [(a, b) for i, a in enumerate(picks) for b in picks[i + 1:]]
    rank = lambda t: _PRODUCER_RANK.get(t.producer, 3)  # noqa: E731
    return sorted(pairs, key=lambda ab: (rank(ab[0]), rank(ab[1]), ab[0].path.name, ab[1].path.name))
