"""Synthetic, self-consistent PCP + MTP traces, built with the pcpviz reference.

No model runs here: token ids come from a seeded hash, and whether a draft is
"accepted" is decided by a seeded coin per (request, position, draft step). Every
*structural* view, though, is produced by the same reference code the checks
compare against — ``pcpviz.reference.layout.plan_layout`` / ``partition_batch`` for the
DualChunkSwap layout and local batch, ``pcpviz.reference.blocks`` for block tables and slot
mappings — and the step semantics follow vLLM 0.33.0 (``docs/vllm-0.33-pcp-mtp.md``):

* positions start at the GPU cursor; the CPU cursor (``num_computed_tokens``) runs
  ahead by the previous step's rejected drafts;
* a decode row is ``[last sampled token] + K drafts``; greedy-style verification
  accepts a prefix of the drafts and samples ``accepted + 1`` tokens; a partial
  prefill chunk samples nothing; the cursor advances by ``q - num_rejected``;
* ``draft_0`` runs on the rank-local rows with the target's gathered slot mapping;
  ``draft_k`` (k >= 1) is replicated: global rows, positions ``positions[last] + k``,
  an unexpanded slot mapping of length R.

Used by the tests (``tests/helpers/tracegen.py`` re-exports it) and by
``benchmarks/bench_checks.py``. ``faults=`` injects known bugs *consistently* (the
rest of the step is computed from the faulty value, as a real producer would): the faults of
``pcpviz.faults`` whose producers include ``SYNTHETIC``, each read at one switch in this package::

    run = generate([RequestSpec("a", 40, 6), RequestSpec("b", 9, 4)], pcp=2,
                   num_speculative_tokens=3, block_size=4, max_num_batched_tokens=24)
    run.write(tmp / "trace")            # a run directory pcpviz.trace.open() reads
    run.views(2, 1, "draft_1")          # the mutable {view: array} dict of one phase

The modules, in the order a step is built: ``settings`` (``RequestSpec``, the checked settings,
the seeded token and draft oracle), ``simulation`` (``generate``: the scheduler, the block
allocator, the request state), ``step`` (one step on the global batch: layout, slot mappings,
verification, drafts), ``phases`` (what each rank records), ``run`` (``SyntheticRun``).
"""

from pcpviz.synthetic.run import SyntheticRun
from pcpviz.synthetic.settings import RequestSpec
from pcpviz.synthetic.simulation import generate, long_prompt_run

__all__ = ["RequestSpec", "SyntheticRun", "generate", "long_prompt_run"]
