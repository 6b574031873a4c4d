"""Claims the docs and notebooks make about vLLM 0.33.0 that a review found wrong once, as data.

Each ``Claim`` names the files that state it (``REVIEW_MAP``: the rendered review map), a phrase
each must contain (``says``, whitespace collapsed), phrases none may contain any more
(``not_says``: the wrong version), and the vLLM lines that show it (``VllmRef``; a test reads
the installed package). ``tests/teaching/test_claims.py``
holds every claim to the files and to vLLM, and runs the computation behind it where one exists.
The ten rows are issue 25's corrections; row 9, for example::

    >>> c = CLAIMS["row 9"]; c.says[0][0], c.vllm[-1].anchor
    ('notebooks/00_quickstart.ipynb', 'if slot_mapping.shape[0] <= local_num_tokens:')
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from pcpviz.teaching.review import VllmRef

__all__ = ["Claim", "CLAIMS", "REVIEW", "file_text", "normalized"]

_AR = "v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py"
_PCP = "v1/worker/gpu/pcp_manager.py"
_DOC = "docs/vllm-0.33-pcp-mtp.md"
_MOE = "model_executor/layers/fused_moe/runner/moe_runner.py"
REVIEW = "REVIEW_MAP"  # not a file: review.review_markdown(), where the review map's rows are read
_NB = {n: f"notebooks/{n}.ipynb" for n in ("00_quickstart", "01_pcp_layout", "02_block_tables_and_slot_mappings",
                                           "04_acceptance_regression", "06_design_review", "07_dspark")}


@dataclass(frozen=True)
class Claim:
    claim: str
    says: tuple[tuple[str, str], ...]  # (repo file, phrase it contains)
    not_says: tuple[tuple[str, str], ...]  # (repo file, phrase it no longer contains)
    vllm: tuple[VllmRef, ...]


CLAIMS: dict[str, Claim] = {
    "row 1": Claim(
        "a FULL draft-decode graph only maps the kernel block tables and replays; building the metadata "
        "once and updating it in place is the non-FULL path",
        ((_DOC, "only points each attention group's kernel block table at `input_block_tables`"),),
        ((_DOC, "Under a FULL graph `_fused_multi_step_decode` builds the draft attention metadata once"),),
        (VllmRef(_AR, 557, "if batch_desc.cg_mode == CUDAGraphMode.FULL:"),
         VllmRef(_AR, 560, "group.map_to_kernel_block_table("),
         VllmRef(_AR, 564, "self.decode_cudagraph_manager.run_fullgraph(batch_desc)"),
         VllmRef(_AR, 621, "self._update_draft_decode_metadata(attn_metadata, num_reqs)"))),
    "row 2": Claim(
        "supports_pcp() is never asserted for a draft layer, at any DCP size; DCP = 1 skips only the "
        "interleave / LSE asserts",
        ((_DOC, "`supports_pcp()` is **never asserted for a draft layer, at any DCP size**"),),
        ((_DOC, "layers are skipped when their DCP size is 1"),),
        (VllmRef("v1/worker/cp_utils.py", 32, "check_pcp = target_layer_names is None"),
         VllmRef("v1/worker/cp_utils.py", 34, "if pcp_size > 1 and check_pcp and get_attn_backend is not None:"),
         VllmRef("v1/worker/cp_utils.py", 43, "if not check_pcp and layer_impl.dcp_world_size == 1:"))),
    "row 3": Claim(
        "the draft-layer exemption holds for every DraftModelSpeculator, MTP included",
        ((REVIEW, "computed for every DraftModelSpeculator, MTP included"),
         (_NB["06_design_review"], "names for **every** `DraftModelSpeculator`, MTP included"),
         (_DOC, "**MTP included**")),
        ((REVIEW, "(a replicated drafter may use a non-PCP backend)"),),
        (VllmRef("v1/worker/gpu/model_runner.py", 677, "if isinstance(self.speculator, DraftModelSpeculator):"),
         VllmRef("v1/worker/gpu/model_runner.py", 683, "} - self.speculator.draft_attn_layer_names"))),
    "row 4": Claim(
        "writing the local rows into the speculator's buffers in prepare_draft_prefill breaks _prefill's "
        "later reads; the copy belongs inside _run_model",
        (("docs/findings/piecewise-draft-prefill.md", "**inside `_run_model`**"),),
        (("docs/findings/piecewise-draft-prefill.md", "`prepare_draft_prefill` could write there instead"),),
        (VllmRef(_AR, 452, "positions = self.input_buffers.positions[last_token_indices]"),
         VllmRef(_AR, 489, "self.input_buffers.positions[:num_reqs] = positions"),
         VllmRef(_PCP, 857, "torch.index_select("))),
    "row 5": Claim(
        "the missing end-to-end test is only partly made up: no DSpark on GPUs, no FULL modes, no DCP > 1",
        ((REVIEW, "no DSpark on GPUs, no FULL graph modes, no DCP > 1, no real model"),),
        ((REVIEW, "no end-to-end PCP + MTP/DSpark case | — | **yes**"),), ()),
    "row 6": Claim(
        "notebook 04 records eager, and warns against PIECEWISE and FULL_AND_PIECEWISE",
        ((_NB["04_acceptance_regression"], "--enforce-eager"),
         (_NB["04_acceptance_regression"], "**Not PIECEWISE, and not FULL_AND_PIECEWISE.**")),
        ((_NB["04_acceptance_regression"], "-cc.cudagraph_mode=PIECEWISE"),), ()),
    "row 7": Claim(
        "only the memory-profile dummy run has no KV gather; other dummy runs all-gather; an MoE model's "
        "expert gather runs in every dummy run (issue 36, W2)",
        ((_NB["06_design_review"], "Only the **memory-profile** run (`skip_attn`) has no KV gather"),
         (_DOC, "such a dummy run does all-gather"),
         (_DOC, "so it issues no KV gather. It is not free of collectives")),
        ((_NB["06_design_review"], "the profile run drafts globally with no collective"),
         (_NB["06_design_review"], "Only the **memory-profile** run (`skip_attn`) has no collective"),
         (_DOC, "so it issues no collective"),
         (_DOC, "the dummy step issues no PCP all-gather at all")),
        (VllmRef("model_executor/layers/attention/mla_attention.py", 794,
                 "if slot_mapping is None or (cache is not None and cache.dummy_batch):"),
         VllmRef(_PCP, 803, "return self._gathered_kv_slot_mappings[:, : num_tokens * self.pcp_world_size]"),
         VllmRef("v1/attention/ops/pcp.py", 40,
                 "pcp_group.all_gather(tensor.contiguous(), dim=0) for tensor in tensors"),
         VllmRef("v1/worker/gpu/model_runner.py", 1895, "is_padding=not is_profile,"),
         VllmRef(_PCP, 746, "is_padding=self.moe_is_padding("),
         VllmRef(_MOE, 828, "hidden_states = get_pcp_group().all_gather(hidden_states, dim=0)"),
         VllmRef(_MOE, 861, "hidden_states = get_pcp_group().reduce_scatter(hidden_states, dim=0)"))),
    "row 8": Claim(
        "a full KV replica per rank only with DCP = 1; with DCP > 1 other DCP ranks' slots are PAD",
        ((_NB["00_quickstart"], "with DCP = 1 each rank keeps a full KV replica"),
         (_NB["01_pcp_layout"], "With DCP = 1 (the default) every rank keeps a full replica of the KV cache")),
        ((_NB["00_quickstart"], "ranks, each rank keeps a full KV replica"),
         (_NB["01_pcp_layout"], "N ranks. Every rank keeps a full replica")),
        (VllmRef("v1/worker/gpu/block_table.py", 394,
                 "is_local = virtual_block_offsets // CP_INTERLEAVE % CP_SIZE == cp_rank"),
         VllmRef("v1/worker/gpu/block_table.py", 411, "slot_ids = tl.where(is_local, slot_ids, PAD_ID)"))),
    "row 9": Claim(
        "a draft decode's mapping is as long as the padded draft batch (PAD past R); it writes locally by "
        "slot_mapping.shape[0] <= local rows",
        ((_NB["00_quickstart"], "PAD past `R` up to the draft batch's padded token count"),
         (_NB["02_block_tables_and_slot_mappings"], "not because its length is R"),
         (_DOC, "padded to the draft batch's token count `batch_desc.num_tokens`")),
        ((_NB["02_block_tables_and_slot_mappings"], "its length R (not N*P) is how the attention layer knows"),
         (_DOC, "unexpanded** `[G, R]` mapping, so the attention layer writes locally")),
        (VllmRef(_AR, 515, "batch_desc.num_tokens,"),
         VllmRef("v1/worker/gpu/block_table.py", 365,
                 "tl.store(slot_mapping_ptr + offset, PAD_ID, mask=offset < max_num_tokens)"),
         VllmRef("v1/attention/ops/pcp.py", 29, "if slot_mapping.shape[0] <= local_num_tokens:"))),
    "row 10": Claim(
        "the drafter's layers take use_pcp from the copied config, its attention impls the PCP size from the "
        "process group; an MLA drafter is refused when tp % dcp != 0",
        ((_NB["07_dspark"], "every attention impl takes its `pcp_world_size` from the PCP **process group**"),
         (_NB["07_dspark"], "`tp % dcp != 0` is refused")),
        ((_NB["07_dspark"], "an MLA drafter with DCP = PCP larger than TP is refused"),
         (_NB["07_dspark"], "`use_pcp=False` in the drafter's attention and indexer")),
        (VllmRef("v1/attention/backend.py", 867, "self.pcp_world_size = get_pcp_group().world_size"),
         VllmRef("model_executor/layers/attention/mla_attention.py", 615,
                 "self.use_pcp = parallel_config.prefill_context_parallel_size > 1"),
         VllmRef("config/parallel.py", 599, "if tp % dcp != 0:"))),
}


def file_text(root: Path, rel: str) -> str:
    """The text of ``rel`` under ``root``; for a notebook its cells' sources joined; for ``REVIEW``
    the rendered review map."""
    if rel == REVIEW:
        from pcpviz.teaching.review import review_markdown

        return review_markdown()
    path = root / rel
    if path.suffix == ".ipynb":
        return "\n".join("".join(c["source"]) for c in json.loads(path.read_text(encoding="utf-8"))["cells"])
    return path.read_text(encoding="utf-8")


def normalized(text: str) -> str:
    """Whitespace runs collapsed to one space (a phrase may be wrapped anywhere)."""
    return re.sub(r"\s+", " ", text)
