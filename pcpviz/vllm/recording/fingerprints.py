"""Fingerprints of the hidden states at vLLM 0.33.0's own hand-offs (MTP), for the hand-off
checks (``pcpviz.analysis.checks.handoff_checks``): the same views the engine records, read where
vLLM moves the rows, so the checks prove data movement in vLLM and not only its indices.

=====================================  =========================  ===========================================
where (vLLM 0.33.0)                    view                       rows fingerprinted
=====================================  =========================  ===========================================
``propose(last_hidden_states=...)``    target ``hidden_local_fp``  the target's output the drafter receives
                                                                  (rank-local under PCP: before the restore)
``PCPManager.restore_for_sampling``    target ``hidden_fp``        its output: the restored rows (PCP > 1)
``_run_model``, before the forward     draft_k ``hidden_in_fp``    ``speculator.hidden_states``: draft_0 the
                                                                  target's rows, draft_k (k >= 1) one per request
``_run_model``, its output             draft_0 ``mtp_local_fp``    the MTP layer's rank-local output
                                       draft_k ``hidden_out_fp``   draft_k's output rows (k >= 1), handed on
``restore_draft_prefill`` (PCP > 1),   draft_0 ``hidden_last_fp``  the restored MTP output at
or draft_0's output (PCP = 1)          / ``hidden_out_fp``         ``last_token_indices`` (what draft_1 reads)
=====================================  =========================  ===========================================

PCP=2, K=2, a 6-token prefill (rank 0 holds tokens 0, 1, 4, 5): rank 0's target
``hidden_local_fp`` is ``[a0 a1 a4 a5]``, its draft_0 ``hidden_in_fp`` the same when vLLM copies
the rows it was given; draft_0's ``hidden_out_fp`` is the restored MTP row of token 5 and draft_1's
``hidden_in_fp`` must equal it. A forward replayed as a FULL CUDA graph runs no Python: its phase
gets no fingerprints, and the checks skip it.
"""

from __future__ import annotations

from typing import Any

import torch

from pcpviz.vllm.recording.host import HOST_FP_MAX_BYTES, Deferred, Fresh, fingerprint_view

__all__ = ["on_target_hidden", "on_restored_target", "before_forward", "after_forward", "on_restored_draft"]


def _fp(t: Any) -> Deferred | Fresh | None:
    """The rows' fingerprints (``host.fingerprint_view``: small rows copied now, fingerprinted by the drain)."""
    return fingerprint_view(t)


def on_target_hidden(ctx: Any, last_hidden_states: Any) -> None:
    """``propose`` received the target's hidden states: target ``hidden_local_fp``. Small rows are
    copied with the step's last copy (``host.Fresh``), not now: nothing writes the target's output
    before the next target forward (the drafter copies it into its own ``hidden_states``), and the
    step's end copies the draft tokens anyway (one copy fewer a step on vLLM's thread)."""
    fp = fingerprint_view(last_hidden_states, at_step_end=True)
    if fp is not None and not ctx.dummy:
        ctx.target_rows = int(last_hidden_states.shape[0])
        ctx.rec.put("target", hidden_local_fp=fp)


def on_restored_target(rec: Any, restored: Any) -> None:
    """``restore_for_sampling``'s restored rows (global order): target ``hidden_fp``."""
    fp = _fp(restored)
    if fp is not None:
        rec.put("target", hidden_fp=fp)


def before_forward(ctx: Any, num_tokens: int) -> None:
    """The hidden rows the draft forward about to run reads: ``hidden_in_fp`` of its phase."""
    if ctx.dummy or not ctx.phases:
        return
    k = len(ctx.phases) - 1
    buf = getattr(ctx.spec, "hidden_states", None)
    if not isinstance(buf, torch.Tensor):
        return
    rows = ctx.target_rows if k == 0 and ctx.target_rows is not None else (int(num_tokens) if k == 0 else ctx.num_reqs)
    ctx.rec.put(ctx.phases[-1], hidden_in_fp=_fp(buf[:rows]))


def after_forward(ctx: Any, out: Any) -> None:
    """The draft forward's output ``(last_hidden_states, hidden_states)``: draft_0's
    ``mtp_local_fp`` (and at PCP=1, where nothing is restored, ``hidden_last_fp`` and
    ``hidden_out_fp``), draft_k's ``hidden_out_fp``."""
    if ctx.dummy or not ctx.phases or not isinstance(out, tuple) or len(out) != 2:
        return
    last, hidden = out
    k, name, r = len(ctx.phases) - 1, ctx.phases[-1], ctx.num_reqs
    if k > 0:
        ctx.rec.put(name, hidden_out_fp=_fp(hidden[:r]))
        return
    with ctx.rec.pack.hold():  # one copy
        ctx.rec.put(name, mtp_local_fp=_fp(last))
        if ctx.spec.pcp_manager is None:
            on_restored_draft(ctx, last, hidden)


def on_restored_draft(ctx: Any, last: Any, hidden: Any) -> None:
    """draft_0's restored (global) output: ``hidden_last_fp`` (what draft token 0 is sampled from)
    and ``hidden_out_fp`` (what draft_1 reads), both at ``last_token_indices``."""
    if ctx.dummy or not ctx.phases or not isinstance(last, torch.Tensor):
        return
    lti = ctx.spec.last_token_indices[: ctx.num_reqs]
    ctx.rec.put(ctx.phases[0], hidden_last_fp=_fp_at(last, lti), hidden_out_fp=_fp_at(hidden, lti))


def _fp_at(t: Any, index: torch.Tensor) -> Deferred | Fresh | None:
    """``_fp(t[index])``; rows small enough for the host are copied whole with ``index`` and
    gathered by the drain (no gather kernel on the step's thread)."""
    if isinstance(t, torch.Tensor) and t.ndim == 2 and t.is_floating_point() \
            and t.numel() * t.element_size() <= HOST_FP_MAX_BYTES:
        return Deferred("row_fp_at", [t, index])
    return _fp(t[index])
