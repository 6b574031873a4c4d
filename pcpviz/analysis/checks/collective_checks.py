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
  attention combines over DCP: the rule is then skipped.

PCP=2, K=2, the tiny dense model, one step of the CPU replay (rank 0; rank 1 the same)::

    target   all_gather pcp float32[14, 512] dim=0   (per layer: latent KV, then its rope part)
             all_gather pcp float32[14, 64] dim=0
             ...
             all_gather pcp float32[14, 256] dim=0   (restore_hidden_states)
    verify   -
    draft_0  ... the MTP layer's KV, the hidden rows restored twice
    draft_1  -
"""

from __future__ import annotations

import numpy as np

from .context import Ctx, Skip, check


def _lines(a: np.ndarray | None) -> list[str]:
    return [] if a is None else [str(x) for x in np.asarray(a).reshape(-1)]


@check("collectives_match_vllm",
       "the collectives each phase ran (CPU replay, engine): the same on every rank, none in verify, none in a "
       "dense model's replicated draft decodes at DCP = 1 (vLLM 0.33.0 ops/pcp.py:28-33)")
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
