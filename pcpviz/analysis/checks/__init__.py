"""Invariants over a trace: ``run_checks(trace) -> CheckReport``.

Each check is a small named function over one (step, rank): it reads the views it needs
from that rank's phases (and, for the cross-step and cross-rank checks, the previous step
or the other ranks), and either passes, is *skipped* because an input view was not
recorded (``"no <view>"``), or reports a violation: step, rank, phase, view, the first
differing index, expected and actual (short windows around that index). The names are
stable — tests, the fault registry (``pcpviz.faults``) and users rely on
them; ``CHECKS`` maps each name to its one-line meaning.

The rules are vLLM 0.33.0's (``docs/vllm-0.33-pcp-mtp.md#invariants``). A PCP=2 step that
passes everything, drawn (K=2, block_size 4; rank 0 shown)::

    global      d0: positions 20..22 (1 + 2 drafts)   p1: fresh prefill 0..8        T = 12
    layout      plan_layout([3, 9], [F, T], 2) == the recorded segments/maps/mask
    gathered    slot_mapping_gathered[:, j] == slot_mapping_global[:, padded_gather_idx[j]]
                where kv_write_mask[j], PAD elsewhere; non-PAD slots unique, == global's
    local       local_positions[:n] == positions[padded_gather_idx[r*P : r*P+n]]
    sampling    sampled_logits_rows == logits_indices (global rows), sampled_from == "global"
    draft_0     rank_local: the target's local rows, gathered slot mapping ([G, N*P])
    draft_1     replicated: block_table_draft == block_table_global, slot mapping [G, R]
                == slots of the global rows at draft_positions == positions[last] + 1
    verify      identical on every rank; the next step starts each request at
                first position + q - num_rejected

Everything is vectorised NumPy over one step's arrays; ``benchmarks/bench_checks.py``
times a 32k-token PCP=4 trace.

The package: ``report`` (Violation, CheckResult, CheckReport), ``context`` (what a check sees,
and the ``@check`` registry), the checks by group (``layout_checks``: target layout, KV writes,
rank-local batch, sampling; ``draft_checks``: draft_0 and draft_k; ``handoff_checks``: the
hidden-state hand-offs (fingerprints) and target outputs across ranks; ``step_checks``: verify,
the next step, ranks, positions; ``graph_checks``: the CUDA-graph replay ledger; ``dcp_checks``: the KV
sharded over DCP ranks) and ``runner`` (``run_checks``; ``CHECK_MODULES`` fixes the
order). The comparison helpers are ``pcpviz.analysis.compare`` (shared with ``pcpviz.analysis.diff``). Adding a
check: a function decorated ``@check(name, description)`` in the module of its group; beside it,
optionally, its bulk rule (``@bulk_rule(name)``: on which (step, rank) of a block of steps it
surely passes, from the views as columns) or skip rule (``@bulk_skip``), ``columns``.
"""

from pcpviz.analysis.compare import first_difference, short_repr

from .report import FAIL, PASS, SKIPPED, CheckReport, CheckResult, Violation
from .context import StepFold
from .runner import CHECK_MODULES, CHECKS, run_checks

ENGINE_VIEW_CHECKS = frozenset({"hidden_restored", "hidden_handoffs", "target_outputs_agree", "verify_greedy",
                                "forward_consumed_prepared", "cursor_rolls_back_rejections",
                                "collectives_match_vllm"})
"""Checks of views only some producers record (fingerprints: the engine and the vLLM plugin, not
older traces; top1_token: the engine alone; fwd_*: the vLLM plugin and the CPU replay;
verify.num_computed_after: traces recorded since it was added; collectives: the CPU replay and the engine): skipped
where a view is missing, naming it."""

DCP_CHECKS = frozenset({"dcp_kv_sharding", "dcp_local_lens", "dcp_partial_combined"})
"""Checks of a DCP > 1 run (``dcp_checks``): skipped, saying so, where run.json's ``dcp`` is 1."""

__all__ = [
    "DCP_CHECKS", "ENGINE_VIEW_CHECKS", "CHECKS", "PASS", "FAIL", "SKIPPED", "Violation", "CheckResult", "CheckReport", "run_checks",
    "first_difference", "short_repr", "CHECK_MODULES", "StepFold",
]
