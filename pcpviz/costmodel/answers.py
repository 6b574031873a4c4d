"""Answers to "when do PCP and MTP pay off?": break-even prompt lengths and speedup tables.

Plain functions over ``step``; the notebook and ``python -m pcpviz.costmodel predict`` print
them. With the shipped fit (docs/cost-model.md has the table), PCP=2 prefill beats PCP=1 by
1.5x only from ~130k tokens for the tiny model under vLLM (four times the 32k positions it
has; until then its per-token PCP host work is as large as the attention PCP halves), but
from ~3k tokens for DeepSeek-V3 on TP=8, whose attention dwarfs every fixed cost (from ~37k once
its MoE's PCP all-gather and reduce-scatter are counted: ``moe_gather=True``).
"""

from __future__ import annotations

from pcpviz.costmodel.specs import Hardware, ModelSpec, System
from pcpviz.costmodel.step import (decode_step, expected_accepted_tokens, geometric_acceptance, mtp_speedup,
                                   pcp_prefill_speedup, prefill_step, prefill_time)

__all__ = ["pcp_breakeven", "pcp_curve", "mtp_grid"]


def pcp_breakeven(model: ModelSpec, hw: Hardware, sysm: System, *, pcp: int = 2, threshold: float = 1.5,
                  k: int = 0, tp: int = 1, lo: int = 256, hi: int = 1 << 24, moe_gather: bool = False) -> int | None:
    """The shortest prompt (one prefill step) whose PCP=1 time over PCP=``pcp`` time reaches
    ``threshold``; None if not by ``hi`` tokens. Scans powers of 2^(1/8), then bisects, so the
    answer is exact to a token when the speedup grows with length (it does here: the quadratic
    attention is the only term PCP splits that grows faster than the rest)."""
    if threshold >= pcp:
        raise ValueError(f"threshold {threshold} must be below pcp={pcp} (the limit)")

    def good(n: int) -> bool:
        return pcp_prefill_speedup(model, hw, sysm, tokens=n, pcp=pcp, k=k, tp=tp, moe_gather=moe_gather) >= threshold

    prev, n = None, lo
    while n <= hi:
        if good(n):
            break
        prev, n = n, int(n * 2 ** 0.125) + 1
    else:
        return None
    if prev is None:
        return n
    while n - prev > 1:
        mid = (n + prev) // 2
        prev, n = (prev, mid) if good(mid) else (mid, n)
    return n


def pcp_curve(model: ModelSpec, hw: Hardware, sysm: System, *, tokens: list[int], pcp: int = 2, k: int = 0,
              tp: int = 1) -> list[dict]:
    """One row per prompt length: PCP=1 and PCP=``pcp`` prefill seconds, the speedup, and the
    share of the PCP=1 step that is attention (target and draft layers)."""
    rows = []
    for n in tokens:
        one = prefill_step(model, hw, sysm, tokens=n, k=k, tp=tp)
        many = prefill_time(model, hw, sysm, tokens=n, pcp=pcp, k=k, tp=tp)
        rows.append({"tokens": n, "pcp1_s": one.total_s, f"pcp{pcp}_s": many, "speedup": one.total_s / many,
                     "attention_share": one.attention_s / one.total_s, "overhead_share": one.overhead_s / one.total_s})
    return rows


def mtp_grid(model: ModelSpec, hw: Hardware, sysm: System, *, alphas: list[float], batches: list[int],
             context: int, k: int = 2, pcp: int = 1, tp: int = 1) -> list[dict]:
    """MTP speedup for each (conditional acceptance ``alpha`` at every position, batch):
    rows with the expected tokens per step L, the K=0 and K step seconds, and the speedup."""
    rows = []
    for batch in batches:
        base = decode_step(model, hw, sysm, batch=batch, context=context, k=0, pcp=pcp, tp=tp).total_s
        spec = decode_step(model, hw, sysm, batch=batch, context=context, k=k, pcp=pcp, tp=tp).total_s
        for a in alphas:
            acc = geometric_acceptance(a, k)
            rows.append({"alpha": a, "batch": batch, "accepted": expected_accepted_tokens(acc), "k0_step_s": base,
                         "k_step_s": spec, "speedup": mtp_speedup(model, hw, sysm, batch=batch, context=context,
                                                                  k=k, acceptance=acc, pcp=pcp, tp=tp)})
    return rows
