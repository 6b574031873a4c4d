"""The collectives each phase ran (the ``collectives`` view, ``str[M]``: one line a call, in
order), held to what vLLM 0.33.0 runs there.

Recorded by the CPU replay, where every line is a call vLLM's own code made on the PCP group
(``pcpviz.vllm.recording.collectives``), and by the engine (its ``ProcessGroupPCP``, in phases that
ran eagerly: a CUDA-graph replay runs no Python to see); absent elsewhere, and the check skips.
The engine issues fewer calls than vLLM for the same work (one gather of a layer's 576-wide
latent-and-rope row where vLLM gathers ``kv_c`` and ``k_pe`` apart; one hidden restore in draft_0
where vLLM makes two), so the rules are the ones both obey:

* **every rank runs the same collectives in a phase, with the same shapes.** A collective one
  rank calls and another does not leaves the first waiting (or pairs it with the next call of the
  others); vLLM pads every rank's rows to the same count before it gathers
  (``v1/worker/gpu/pcp_manager.py:836``, ``v1/attention/ops/pcp.py:37-41``);
* **verify runs none**: rejection sampling and ``post_update`` work on the global batch every rank
  holds;
* **a replicated draft decode (draft_k, k >= 1) of a dense model at DCP = 1 runs none**: its slot
  mapping is unexpanded, so the KV write returns before gathering (``v1/attention/ops/pcp.py:28-33``),
  and its hidden states are already global (nothing to restore). With routed experts (run.json
  ``model_moe``) the MoE layers all-gather and reduce-scatter over PCP in every forward
  (``model_executor/layers/fused_moe/runner/moe_runner.py:824-829, 853-861``), and at DCP > 1 the
  attention combines over DCP: the rule is then skipped;
* **a MoE model's forwards run the MoE's collectives** (run.json ``model_moe``, PCP > 1): every
  phase but verify has at least one, and each reduce-scatter follows the all-gathers of its input
  rows ``[n, H]`` and their router logits ``[n, E]``, and scatters ``[pcp * n, H]``: the MoE layer
  gathers every rank's rows, computes its share of the experts over all of them and sums back
  (``moe_runner.py:824-829, 853-861``; the engine's ``pcpviz.engine.moe``).

PCP=2, K=2, the tiny dense model, one step of the CPU replay (rank 0; rank 1 the same)::

    target   all_gather pcp float32[14, 512] dim=0   (per layer: latent KV, then its rope part)
             all_gather pcp float32[14, 64] dim=0
             ...
             all_gather pcp float32[14, 256] dim=0   (restore_hidden_states)
    verify   -
    draft_0  ... the MTP layer's KV, the hidden rows restored twice
    draft_1  -

The MoE + DSA model in the CPU replay (``replay(model_dir=...pcpviz-tiny-moe-dsa)``), rank 0 of a
step of 17 padded rows a rank and 4 requests: every layer also gathers its indexer keys
(``float32[17, 128]``), the MoE layer adds its triple, and draft_1 holds the MTP block's::

    target   ... all_gather pcp float32[17, 256] dim=0    (the MoE layer's rows)
                 all_gather pcp float32[17, 8] dim=0      (its router logits, 8 experts)
                 reduce_scatter pcp float32[34, 256] dim=0
    draft_1  all_gather pcp float32[4, 256] dim=0, all_gather pcp float32[4, 8] dim=0,
             reduce_scatter pcp float32[8, 256] dim=0
"""

from __future__ import annotations

import re

import numpy as np

from .context import Ctx, Skip, check


def _lines(a: np.ndarray | None) -> list[str]:
    return [] if a is None else [str(x) for x in np.asarray(a).reshape(-1)]


_CALL = re.compile(r"^(\w+) (\w+) (\w+)\[([\d, ]*)\] dim=0$")


def _shape(line: str) -> tuple[str, tuple[int, ...]] | None:
    """(kind, shape) of a ``describe`` line of the PCP group along dim 0, else None."""
    m = _CALL.match(line)
    if m is None or m.group(2) != "pcp":
        return None
    return m.group(1), tuple(int(x) for x in m.group(4).split(",") if x.strip())


def moe_collectives_problem(lines: list[str], pcp: int) -> tuple[int, str] | None:
    """(index, why) of the first line that breaks the MoE rule of one phase, or None.

    >>> ok = ["all_gather pcp float32[12, 256] dim=0", "all_gather pcp float32[12, 8] dim=0",
    ...       "reduce_scatter pcp float32[24, 256] dim=0"]
    >>> moe_collectives_problem(ok, 2) is None, moe_collectives_problem(ok[:2], 2)[1][:24]
    (True, 'no MoE reduce-scatter in')
    """
    calls = [_shape(x) for x in lines]
    scatters = [i for i, c in enumerate(calls) if c is not None and c[0] == "reduce_scatter"]
    if not scatters:
        return 0, "no MoE reduce-scatter in a forward of a MoE model"
    for i in scatters:
        rows, logits = (calls[i - 2], calls[i - 1]) if i >= 2 else (None, None)
        if rows is None or logits is None or rows[0] != "all_gather" or logits[0] != "all_gather":
            return i, "a reduce-scatter not preceded by the all-gathers of its rows and router logits"
        (_, (n, h)), (_, ln), (_, rs) = rows, logits, calls[i]
        if len(ln) != 2 or ln[0] != n or rs != (pcp * n, h):
            return i, f"rows [{n}, {h}], router logits {list(ln)}, then a reduce-scatter of {list(rs)}: " \
                      f"vLLM scatters [pcp * rows, hidden] = [{pcp * n}, {h}]"
    return None


@check("collectives_match_vllm",
       "the collectives each phase ran (CPU replay, engine): the same on every rank, none in verify, none in a "
       "dense model's replicated draft decodes at DCP = 1 (vLLM 0.33.0 ops/pcp.py:28-33), a MoE model's "
       "all-gathers and reduce-scatter in every forward (moe_runner.py:824-861)")
def collectives_match_vllm(c: Ctx) -> None:
    phases = [p for p, rec in c.phases.items() if "collectives" in rec]
    if not phases:
        raise Skip("no collectives view (recorded by the CPU replay and the engine, not yet on a GPU by the plugin)")
    for phase in phases:
        mine = _lines(c.get(phase, "collectives"))
        if phase == "verify" and mine:
            c.fail(phase, "collectives", f"verify ran {len(mine)} collective(s), the first {mine[0]!r}; vLLM's "
                   "verify runs none", index=(0,))
        dense = c.run_meta.model_moe is False and c.run_meta.dcp == 1
        if phase.startswith("draft_") and phase != "draft_0" and mine and dense:
            c.fail(phase, "collectives", f"a replicated draft decode of a dense model ran {len(mine)} collective(s), "
                   f"the first {mine[0]!r}; vLLM's KV write returns before gathering an unexpanded slot mapping "
                   "(ops/pcp.py:28-33)", index=(0,))
        if c.run_meta.model_moe and (c.run_meta.pcp or 1) > 1 and phase != "verify":
            bad = moe_collectives_problem(mine, c.run_meta.pcp)
            if bad is not None:
                c.fail(phase, "collectives", f"collective {bad[0]}: {bad[1]} (moe_runner.py:824-829, 853-861)",
                       index=(bad[0],))
        if c.rank != 0:
            continue
        for r in sorted(c.sv.recs):
            if r == 0 or phase not in c.sv.recs[r]:
                continue
            theirs = _lines(c.rank_view(r, phase, "collectives"))
            if theirs != mine:
                i = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
                a = mine[i] if i < len(mine) else "nothing"
                b = theirs[i] if i < len(theirs) else "nothing"
                c.fail(phase, "collectives", f"collective {i}: rank 0 ran {a!r}, rank {r} ran {b!r} (every rank "
                       "must run the same collectives with the same shapes)", index=(i,))
