"""The cost of one serving step: prefill (with PCP) and decode (with MTP), term by term.

Every kernel class is a roofline, ``max(FLOP / (peak x eff), bytes / (HBM x bw_eff))``; the
overhead terms are ``System``'s; collectives cost ``latency + bytes / link``. What each rank
does follows vLLM 0.33.0 (docs/vllm-0.33-pcp-mtp.md):

* **PCP prefill** (``pcp`` = P ranks): DualChunkSwap gives each rank N/P query tokens and an
  equal share of the causal query-key pairs. Each layer all-gathers the new tokens' latent KV
  rows (every rank keeps the whole cache: DCP = 1, not modelled otherwise) and each rank
  up-projects all gathered rows to keys and values (``kv_b``; not split by P). The hidden
  states are all-gathered once before sampling (``restore_hidden_states``).
* **Decode**: requests are sharded, one owner rank each, so a rank computes ceil(B/P) of them
  and reads their whole latent cache (absorbed MLA: one 576-wide row per position and layer).
* **MTP** (``k`` = K drafts): the target verifies K+1 tokens per request; the draft runs K
  forwards of the one MTP layer, the first over the verified tokens (local rows, KV gathered
  like the target's), the other K-1 over one token per request, replicated on every rank.
* **The MoE's PCP traffic** (``moe_gather=True``, off by default): without expert parallelism
  vLLM 0.33.0's MoE layer all-gathers its hidden states and router logits over the PCP group and
  reduce-scatters its output (``fused_moe/runner/moe_runner.py`` lines 824-829, 853-861) in every
  forward, target and draft, the replicated draft steps included (they gather N copies of the
  same rows). ``moe_pcp_bytes`` counts it; with expert parallelism the tokens travel in the
  all-to-all instead, which is not modelled. No measured MoE point exists, so nothing is fitted
  to it.

Worked example (tiny model, the shipped vLLM-eager fit, a 16,384-token prefill with K=2): at
PCP=1 the step is ~17.6 ms: overhead 4.9 ms, target attention 5.4 ms (0.69 TFLOP at the fitted
13% of peak), the draft 7.2 ms (its fixed costs plus one more layer of attention), GEMMs
0.17 ms. PCP=2 halves the attention (2.7 ms) and the draft's, but adds 6.8 ms of per-token PCP
host work: 20.5 ms, slower, as measured (18.5 and 21.1 ms in the two runs).
"""

from __future__ import annotations

import dataclasses
import math

from pcpviz.costmodel.specs import Hardware, ModelSpec, System

__all__ = ["StepCost", "seconds_text", "causal_pairs", "prefill_step", "prefill_time", "decode_step",
           "expected_accepted_tokens", "conditional_from_vllm", "geometric_acceptance",
           "decode_time_per_token", "mtp_speedup", "pcp_prefill_speedup", "moe_pcp_bytes"]


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Seconds of one step on the slowest rank, by term (they add; no overlap assumed)."""

    overhead_s: float   # host / launch: step_s, layer_s, token_s, pcp_token_s
    gemm_s: float       # target GEMMs (weights read or FLOPs, whichever binds)
    attention_s: float  # target attention
    comm_s: float       # PCP all-gathers (KV, hidden states; the MoE's with moe_gather) and TP all-reduces
    draft_s: float      # the K draft forwards, all their terms

    @property
    def total_s(self) -> float:
        return self.overhead_s + self.gemm_s + self.attention_s + self.comm_s + self.draft_s

    def __add__(self, other: "StepCost") -> "StepCost":
        return StepCost(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    def describe(self) -> str:
        """One line: the total and each term with its share, e.g. ``17.6 ms = overhead 4.87 ms
        (28%) + GEMM 0.171 ms (1%) + attention 5.38 ms (31%) + ...``."""
        total = self.total_s
        parts = [(n, getattr(self, f)) for n, f in (("overhead", "overhead_s"), ("GEMM", "gemm_s"),
                 ("attention", "attention_s"), ("collectives", "comm_s"), ("draft", "draft_s"))]
        return f"{seconds_text(total)} = " + " + ".join(
            f"{n} {seconds_text(v)} ({v / total:.0%})" for n, v in parts if v > 0)


def seconds_text(s: float) -> str:
    """3 significant digits in s, ms or us: 0.0176 -> '17.6 ms'."""
    if s >= 1:
        return f"{s:.3g} s"
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def causal_pairs(query: float, context: float = 0) -> float:
    """Query-key pairs of ``query`` new tokens after ``context`` cached ones (causal).

    >>> causal_pairs(4)           # 1 + 2 + 3 + 4
    10.0
    >>> causal_pairs(2, 3)        # two tokens at positions 3 and 4 see 4 and 5 keys
    9.0
    """
    return float(query) * context + query * (query + 1) / 2.0


def _roofline(flops: float, nbytes: float, hw: Hardware, *, eff: float, sysm: System) -> float:
    return max(flops / (hw.flops_per_s * eff), nbytes / (hw.hbm_bytes_per_s * sysm.bw_eff))


def _collective(nbytes: float, gpus: int, hw: Hardware, *, count: int = 1) -> float:
    """``count`` all-gathers / all-reduces moving ``nbytes`` into each GPU."""
    if gpus <= 1 or count == 0:
        return 0.0
    return count * hw.link_latency_s + nbytes / hw.link_bytes_per_s(gpus)


def moe_pcp_bytes(model: ModelSpec, rows: float, *, mtp: bool = False) -> float:
    """Bytes one GPU receives in one forward's MoE PCP collectives, ``rows`` being the rows the
    other PCP ranks hold (``(P-1)/P`` of the gathered rows): per MoE layer an all-gather of the
    hidden states and of the router logits (counted at ``act_bytes``) and a reduce-scatter of the
    output. ``mtp``: the MTP module's one layer, if it routes experts. DeepSeek-V3, one row:
    58 layers x (7168 + 256 + 7168) x 2 B, ~25 times the 576-wide latent row its attention gathers::

        >>> from pcpviz.costmodel.specs import deepseek_v3
        >>> v3 = deepseek_v3(); moe_pcp_bytes(v3, 1) / v3.moe_layers, v3.latent_dim * v3.kv_bytes
        (29184.0, 1152.0)
    """
    layers = (1 if model.mtp_moe else 0) if mtp else model.moe_layers
    return rows * layers * (2 * model.hidden + model.routed_experts) * model.act_bytes


def _moe_collectives(model: ModelSpec, hw: Hardware, rows: float, gpus: int, *, pcp: int, mtp: bool = False) -> float:
    """``moe_pcp_bytes`` as time: three collectives a MoE layer (none at PCP = 1 or without MoE)."""
    if pcp <= 1:
        return 0.0
    layers = (1 if model.mtp_moe else 0) if mtp else model.moe_layers
    return _collective(moe_pcp_bytes(model, rows, mtp=mtp), gpus, hw, count=3 * layers)


def _gemm(model: ModelSpec, hw: Hardware, sysm: System, *, tokens: float, kv_b_tokens: float,
          sampled: float, tp: int, layers: str = "target") -> float:
    """GEMMs of one forward on one GPU: ``tokens`` query rows, ``kv_b_tokens`` latent rows
    up-projected (prefill: the whole context; decode: the query rows), ``sampled`` logits rows."""
    if layers == "target":
        dense, n_moe = model.dense_params, model.moe_layers
        kv_b = model.kv_b_params * model.layers
    else:  # the MTP module
        dense, n_moe = model.mtp_dense_params, (1 if model.mtp_moe else 0)
        kv_b = model.kv_b_params
    per_tok = dense - kv_b + n_moe * model.experts_per_token * model.expert_params
    flops = 2.0 * (per_tok * tokens + kv_b * kv_b_tokens + model.lm_head_params * sampled)
    weights = dense + n_moe * model.touched_experts(tokens) * model.expert_params + model.lm_head_params
    return _roofline(flops / tp, weights * model.weight_bytes / tp, hw, eff=sysm.gemm_eff, sysm=sysm)


def _prefill_attention(model: ModelSpec, hw: Hardware, sysm: System, *, pairs: float, context: float,
                       layers: int, tp: int) -> float:
    """Non-absorbed MLA over ``pairs`` query-key pairs (per GPU), reading ``context`` latent rows."""
    heads = model.heads / tp
    flops = 2.0 * heads * (model.qk_nope_dim + model.qk_rope_dim + model.v_head_dim) * pairs * layers
    nbytes = context * model.latent_dim * model.kv_bytes * layers
    return _roofline(flops, nbytes, hw, eff=sysm.attn_eff, sysm=sysm)


def _decode_attention(model: ModelSpec, hw: Hardware, sysm: System, *, reqs: float, queries: float,
                      context: float, layers: int, tp: int) -> float:
    """Absorbed MLA for ``reqs`` requests of ``queries`` tokens each over ``context`` positions:
    each request's latent rows are read once (every TP rank reads them all)."""
    heads = model.heads / tp
    flops = 2.0 * heads * (2 * model.kv_lora_rank + model.qk_rope_dim) * context * queries * reqs * layers
    nbytes = reqs * context * model.latent_dim * model.kv_bytes * layers
    return _roofline(flops, nbytes, hw, eff=sysm.attn_eff, sysm=sysm)


def _check(**kw: float) -> None:
    for name, v in kw.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    for name in ("tokens", "batch", "pcp", "tp", "chunk"):
        if name in kw and kw[name] < 1:
            raise ValueError(f"{name} must be >= 1, got {kw[name]}")
    for name in ("context", "k"):
        if name in kw and kw[name] < 0:
            raise ValueError(f"{name} must be >= 0, got {kw[name]}")


def prefill_step(model: ModelSpec, hw: Hardware, sysm: System, *, tokens: int, context: int = 0,
                 pcp: int = 1, k: int = 0, tp: int = 1, with_step: bool = True,
                 moe_gather: bool = False) -> StepCost:
    """One step prefilling ``tokens`` new tokens of one request after ``context`` cached ones.

    ``with_step=False`` leaves out ``step_s`` and the draft: the target forward alone (what
    the engine's trace times). ``moe_gather=True`` adds the MoE's PCP collectives
    (``moe_pcp_bytes``). Example, tiny model, 32,000 tokens, PCP=2: each rank attends
    16,000 queries to half the 5.1e8 causal pairs and all-gathers 18.4 MB of latent rows per
    layer; the per-token host terms still see all 32,000 tokens.
    """
    _check(tokens=tokens, context=context, pcp=pcp, k=k, tp=tp)
    local = math.ceil(tokens / pcp)
    ctx_after = context + tokens
    pairs = causal_pairs(tokens, context) / pcp
    tok_host = sysm.token_s * tokens + (sysm.pcp_token_s * tokens if pcp > 1 else 0.0)
    overhead = (sysm.step_s if with_step else 0.0) + sysm.layer_s * model.layers + tok_host
    gemm = _gemm(model, hw, sysm, tokens=local, kv_b_tokens=ctx_after, sampled=1, tp=tp)
    attn = _prefill_attention(model, hw, sysm, pairs=pairs, context=ctx_after, layers=model.layers, tp=tp)
    gpus = pcp * tp
    latent = (pcp - 1) / pcp * tokens * model.latent_dim * model.kv_bytes
    hidden = (pcp - 1) / pcp * tokens * model.hidden * model.act_bytes
    comm = _collective(latent * model.layers + hidden, gpus, hw, count=model.layers + 1) if pcp > 1 else 0.0
    comm += _collective(2 * 2 * (tp - 1) / tp * local * model.hidden * model.act_bytes * model.layers,
                        tp, hw, count=2 * model.layers)
    moe_rows = (pcp - 1) / pcp * tokens
    comm += _moe_collectives(model, hw, moe_rows, gpus, pcp=pcp) if moe_gather else 0.0
    draft = 0.0
    if with_step and k > 0 and model.mtp_layers:
        draft = _draft_forward(model, hw, sysm, tokens=local, kv_b_tokens=ctx_after, pairs=pairs,
                               context=ctx_after, tp=tp, decode=False)
        draft += _collective(latent + hidden, gpus, hw, count=2) if pcp > 1 else 0.0
        draft += (k - 1) * _draft_forward(model, hw, sysm, tokens=1, kv_b_tokens=1, pairs=0,
                                          context=ctx_after + 1, tp=tp, decode=True)
        if moe_gather:  # draft_0 on the local rows, then K-1 replicated steps of the one request
            draft += _moe_collectives(model, hw, moe_rows, gpus, pcp=pcp, mtp=True)
            draft += (k - 1) * _moe_collectives(model, hw, pcp - 1, gpus, pcp=pcp, mtp=True)
    return StepCost(overhead, gemm, attn, comm, draft)


def _draft_forward(model: ModelSpec, hw: Hardware, sysm: System, *, tokens: float, kv_b_tokens: float,
                   pairs: float, context: float, tp: int, decode: bool, reqs: float = 1) -> float:
    """One forward of the MTP module: its fixed cost, one layer's launches, GEMMs, attention."""
    t = sysm.draft_s + sysm.layer_s * model.mtp_layers
    t += _gemm(model, hw, sysm, tokens=tokens, kv_b_tokens=kv_b_tokens, sampled=reqs, tp=tp, layers="mtp")
    if decode:
        t += _decode_attention(model, hw, sysm, reqs=reqs, queries=tokens / reqs, context=context,
                               layers=model.mtp_layers, tp=tp)
    else:
        t += _prefill_attention(model, hw, sysm, pairs=pairs, context=context, layers=model.mtp_layers, tp=tp)
    return t


def prefill_time(model: ModelSpec, hw: Hardware, sysm: System, *, tokens: int, chunk: int | None = None,
                 pcp: int = 1, k: int = 0, tp: int = 1, with_step: bool = True, moe_gather: bool = False) -> float:
    """Seconds to prefill a ``tokens``-token prompt in chunks of at most ``chunk`` tokens
    (the scheduler's token budget; None: one step). 30,000 tokens at a 16,384 budget: two
    steps, the second attending 13,616 queries to 16,384 cached positions as well."""
    chunk = tokens if chunk is None else chunk
    _check(tokens=tokens, chunk=chunk)
    total, done = 0.0, 0
    while done < tokens:
        q = min(chunk, tokens - done)
        total += prefill_step(model, hw, sysm, tokens=q, context=done, pcp=pcp, k=k, tp=tp,
                              with_step=with_step, moe_gather=moe_gather).total_s
        done += q
    return total


def decode_step(model: ModelSpec, hw: Hardware, sysm: System, *, batch: int, context: int, k: int = 0,
                pcp: int = 1, tp: int = 1, moe_gather: bool = False) -> StepCost:
    """One decode step of ``batch`` requests at ``context`` positions, verifying ``k`` drafts each
    (``moe_gather``: as for ``prefill_step``).

    Example, DeepSeek-V3 on TP=8, batch 1, 128k positions, K=0: ~37 B fp8 weights / 8 GPUs and
    61 x 131,072 x 576 x 2 B = 9.2 GB of latent cache per GPU (MLA's latent is not split by
    TP): the cache, not the weights, is what a long-context decode step reads.
    """
    _check(batch=batch, context=context, k=k, pcp=pcp, tp=tp)
    reqs = math.ceil(batch / pcp)                  # one owner rank per request
    q = k + 1
    overhead = sysm.step_s + sysm.layer_s * model.layers + sysm.token_s * batch * q
    overhead += sysm.pcp_token_s * batch * q if pcp > 1 else 0.0
    gemm = _gemm(model, hw, sysm, tokens=reqs * q, kv_b_tokens=reqs * q, sampled=reqs * q, tp=tp)
    attn = _decode_attention(model, hw, sysm, reqs=reqs, queries=q, context=context + q,
                             layers=model.layers, tp=tp)
    rows = (pcp - 1) * reqs * q                    # rows each rank receives
    comm = _collective(rows * (model.latent_dim * model.kv_bytes * model.layers + model.hidden * model.act_bytes),
                       pcp * tp, hw, count=model.layers + 1) if pcp > 1 else 0.0
    comm += _collective(2 * 2 * (tp - 1) / tp * reqs * q * model.hidden * model.act_bytes * model.layers,
                        tp, hw, count=2 * model.layers)
    comm += _moe_collectives(model, hw, rows, pcp * tp, pcp=pcp) if moe_gather else 0.0
    draft = 0.0
    if k > 0 and model.mtp_layers:
        draft = _draft_forward(model, hw, sysm, tokens=reqs * q, kv_b_tokens=reqs * q, pairs=0,
                               context=context + q, tp=tp, decode=True, reqs=reqs)
        draft += _collective(rows * (model.latent_dim * model.kv_bytes + model.hidden * model.act_bytes),
                             pcp * tp, hw, count=2) if pcp > 1 else 0.0
        draft += (k - 1) * _draft_forward(model, hw, sysm, tokens=batch, kv_b_tokens=batch, pairs=0,
                                          context=context + q, tp=tp, decode=True, reqs=batch)
        if moe_gather:  # draft_0 on the owners' rows, then K-1 replicated steps of every request
            draft += _moe_collectives(model, hw, rows, pcp * tp, pcp=pcp, mtp=True)
            draft += (k - 1) * _moe_collectives(model, hw, (pcp - 1) * batch, pcp * tp, pcp=pcp, mtp=True)
    return StepCost(overhead, gemm, attn, comm, draft)


# ------------------------------------------------------------------------------ acceptance

def expected_accepted_tokens(conditional: tuple[float, ...] | list[float]) -> float:
    """Mean tokens a decode step emits per request, from the conditional acceptance of each
    draft position (``a_i`` = P(draft i accepted | drafts before it accepted)):
    ``1 + a_1 + a_1 a_2 + ...``, vLLM's "mean acceptance length".

    >>> round(expected_accepted_tokens([0.873, 0.4]), 3)     # 1 + 0.873 + 0.349
    2.222
    >>> expected_accepted_tokens([])                          # no speculation
    1.0
    """
    total, run = 1.0, 1.0
    for a in conditional:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {a!r}")
        run *= a
        total += run
    return total


def conditional_from_vllm(per_pos: tuple[float, ...] | list[float]) -> tuple[float, ...]:
    """vLLM's per-position acceptance rate (accepted at position i / drafts, so already the
    cumulative product) to conditional rates. [0.873, 0.349] -> (0.873, 0.40)."""
    out, prev = [], 1.0
    for u in per_pos:
        out.append(0.0 if prev == 0 else min(1.0, u / prev))
        prev = u
    return tuple(out)


def geometric_acceptance(alpha: float, k: int) -> tuple[float, ...]:
    """The same conditional acceptance at every position: L = (1 - alpha^(K+1)) / (1 - alpha)."""
    return (float(alpha),) * k


def decode_time_per_token(model: ModelSpec, hw: Hardware, sysm: System, *, batch: int, context: int,
                          k: int, acceptance: tuple[float, ...] | list[float] = (), pcp: int = 1,
                          tp: int = 1) -> float:
    """Seconds per emitted token of one request: a step over the tokens it emits."""
    accepted = expected_accepted_tokens(list(acceptance)[:k]) if k else 1.0
    return decode_step(model, hw, sysm, batch=batch, context=context, k=k, pcp=pcp, tp=tp).total_s / accepted


def mtp_speedup(model: ModelSpec, hw: Hardware, sysm: System, *, batch: int, context: int, k: int,
                acceptance: tuple[float, ...] | list[float], pcp: int = 1, tp: int = 1) -> float:
    """Decode tokens/s with K drafts over without: ``L x T(K=0) / T(K)``, below L always, below
    1 when acceptance is 0 (the drafts and the wider verify cost something)."""
    if len(acceptance) < k:
        raise ValueError(f"need {k} acceptance rates, got {len(acceptance)}")
    base = decode_time_per_token(model, hw, sysm, batch=batch, context=context, k=0, pcp=pcp, tp=tp)
    spec = decode_time_per_token(model, hw, sysm, batch=batch, context=context, k=k, acceptance=acceptance,
                                 pcp=pcp, tp=tp)
    return base / spec


def pcp_prefill_speedup(model: ModelSpec, hw: Hardware, sysm: System, *, tokens: int, pcp: int,
                        chunk: int | None = None, k: int = 0, tp: int = 1, moe_gather: bool = False) -> float:
    """Prefill time at PCP=1 over PCP=``pcp``: tends to ``pcp`` as causal attention (quadratic)
    outgrows every term PCP does not split (linear)."""
    one = prefill_time(model, hw, sysm, tokens=tokens, chunk=chunk, pcp=1, k=k, tp=tp)
    return one / prefill_time(model, hw, sysm, tokens=tokens, chunk=chunk, pcp=pcp, k=k, tp=tp,
                              moe_gather=moe_gather)
