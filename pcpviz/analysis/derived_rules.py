"""The rules pcpviz derives from first principles instead of taking a recorded value on trust:
one ``DerivedRule`` per rule, naming the check that holds it, the view it derives, the views it is
derived from and the vLLM 0.33.0 code it is read from (``file:line`` under ``vllm/``; held against
the installed package by ``tests/analysis/test_producers.py``). ``python -m pcpviz.teaching.docgen
docs`` lists them in ``docs/checks-and-faults.md``.

PCP=2 example (``must_sample_rule``): request p0 with prefill_len 40 scheduled 16 tokens after 16
computed has seq_len 32 < 40, so vLLM's sampler zeroes its num_sampled; the next chunk (seq_len 40)
must sample: a recorded num_sampled 0 there fails the check.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DerivedRule", "DERIVED_RULES", "TRUSTED_VIEWS"]


@dataclass(frozen=True)
class DerivedRule:
    check: str
    view: str  # phase.view the rule derives
    derived_from: tuple[str, ...]  # phase.view inputs
    rule: str
    vllm: tuple[tuple[str, int, str], ...]  # (file under vllm/, line, the name defined or read there)


DERIVED_RULES: tuple[DerivedRule, ...] = (
    DerivedRule("is_prefilling_rule", "target.is_prefilling", ("target.num_computed_tokens", "target.prefill_len"),
                "is_prefilling = num_computed_tokens < prefill_len",
                (("v1/worker/gpu/model_runner.py", 1338, "is_prefilling_np"),)),
    DerivedRule("must_sample_rule", "verify.num_sampled",
                ("target.seq_lens", "target.prefill_len"),
                "num_sampled == 0 iff seq_len < prefill_len (a partial chunk); there num_rejected = num_accepted = 0",
                (("v1/worker/gpu/input_batch.py", 517, "_get_num_sampled_and_rejected_kernel"),
                 ("v1/worker/gpu/input_batch.py", 545, "get_num_sampled_and_rejected"),
                 ("v1/worker/gpu/spec_decode/rejection_sampler.py", 464, "get_num_sampled_and_rejected"))),
    DerivedRule("cursor_rolls_back_rejections", "verify.num_computed_after",
                ("target.positions", "target.query_start_loc", "verify.num_rejected"),
                "num_computed_after = the request's first position this step + q - num_rejected",
                (("v1/worker/gpu/input_batch.py", 566, "_post_update_kernel"),
                 ("v1/worker/gpu/input_batch.py", 636, "post_update"))),
    DerivedRule("num_accepted_from_tokens", "verify.num_accepted",
                ("target.input_ids", "target.query_start_loc", "verify.num_draft_tokens", "verify.sampled_token_ids"),
                "the token sampled in place of the first rejected draft differs from it (standard rejection "
                "sampling; skipped under synthetic/block/fly methods)",
                (("v1/worker/gpu/spec_decode/rejection_sampler_utils.py", 616, "target_argmax"),
                 ("v1/worker/gpu/spec_decode/rejection_sampler_utils.py", 732, "target_argmax"),
                 ("v1/worker/gpu/spec_decode/rejection_sampler_utils.py", 958, "rejected_draft_token"),
                 ("config/speculative.py", 83, "RejectionSampleMethod"))),
    DerivedRule("verify_greedy", "verify.num_accepted", ("target.top1_token", "target.input_ids",
                                                          "verify.num_draft_tokens"),
                "engine only: the longest prefix of drafts equal to the target's argmax is accepted",
                (("v1/worker/gpu/spec_decode/rejection_sampler_utils.py", 616, "target_argmax"),)),
)
"""Rules derived, not trusted (``docs/checks-and-faults.md``, "Derived rules")."""

TRUSTED_VIEWS: dict[str, str] = {
    "target.prefill_len": "the prompt length vLLM stored at add_requests; nothing recorded derives it",
    "target.num_draft_tokens": "the scheduler's drafts per request; bounded by q - 1 (verify_consistent)",
    "draft_k.draft_tokens": "the draft model's argmax; only fed back (drafts_fed_back) and verified",
}
"""Views still taken as given, and why (listed beside the derived rules)."""
