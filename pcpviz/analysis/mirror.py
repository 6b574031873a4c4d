"""Hold pcpviz's own data path against a recorded trace: the same scheduled batch in, the same
views out.

    from pcpviz.analysis.mirror import mirror
    report = mirror(pcpviz.trace.open("data/traces/vllm-h200x2-pcp2-mtp2"))
    report.ok, report.compared, report.first      # True, 54, None

For every (step, rank) with a ``target`` phase, ``mirror`` rebuilds the global batch that was
scheduled (``req_ids``, ``num_scheduled_tokens``, ``num_computed_tokens``, ``positions``,
``input_ids``, ``prefill_len``, ``is_prefilling``), runs what the engine runs on it
(``pcpviz.reference.layout.plan_layout`` / ``partition_batch``, ``pcpviz.reference.blocks``) and compares each result
with the view the trace recorded. On a real vLLM trace this is the engine's mirror of vLLM
0.33.0 checked on batches vLLM itself scheduled, with no GPU.

The views, with PCP=2, one prefill ``p13`` and a decode ``d4`` (P = 12 rows a rank)::

    padded_gather_idx, hidden_restore_idx, kv_write_mask     the layout          int64[N*P], int64[T]
    local_positions, local_input_ids                         rank-local batch    int64[P]
    local_seq_lens, local_query_start_loc, local_is_prefilling                   [R_local(+1)]
    block_table_local                                        rows of the table   int32[G, R_local, W]
    slot_mapping_global, slot_mapping_gathered               slots               int64[G, T], [G, N*P]
    slot_mapping_draft (draft_k, k >= 1, replicated)         draft-decode slots  int64[G, R]

The rank-local row count P is the recorded one (vLLM pads it to a CUDA-graph size under
``PIECEWISE``). Views are compared over what both sides hold: a recorded block-table row may be
wider than the columns the batch uses; the extra entries are not compared (``pcpviz check`` owns
the padding rules).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from pcpviz.reference.batch import GlobalBatch
from pcpviz.reference.blocks import compute_slot_mappings, gather_block_table_rows, gathered_slot_mapping
from pcpviz.reference.layout import partition_batch, plan_layout

__all__ = ["mirror", "MirrorReport", "Mismatch"]


@dataclass(frozen=True)
class Mismatch:
    """The first entry where pcpviz and the trace differ."""

    step: int
    rank: int
    phase: str
    view: str
    index: tuple[int, ...]
    expected: int  # pcpviz
    actual: int  # the trace

    def __str__(self) -> str:
        return (f"step {self.step}, rank {self.rank}, {self.phase}.{self.view}{list(self.index)}: "
                f"pcpviz computes {self.expected}, the trace holds {self.actual}")


@dataclass(frozen=True)
class MirrorReport:
    compared: int  # (step, rank) pairs recomputed
    views: int  # views compared in all
    mismatches: tuple[Mismatch, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def first(self) -> Mismatch | None:
        return self.mismatches[0] if self.mismatches else None


def _compare(step: int, rank: int, phase: str, view: str, ours: np.ndarray, theirs: np.ndarray | None,
             ) -> Iterator[Mismatch]:
    if theirs is None:
        return
    a, b = np.asarray(ours), np.asarray(theirs)
    if a.ndim != b.ndim:
        b = b.reshape(a.shape) if b.size == a.size else b
    if a.ndim != b.ndim:
        yield Mismatch(step, rank, phase, view, (), a.ndim, b.ndim)
        return
    common = tuple(slice(0, min(x, y)) for x, y in zip(a.shape, b.shape))
    if any(x > y for x, y in zip(a.shape, b.shape)):  # the trace holds less than a batch needs
        axis = next(i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x > y)
        yield Mismatch(step, rank, phase, view, (axis,), a.shape[axis], b.shape[axis])
        return
    diff = np.argwhere(a[common].astype(np.int64) != b[common].astype(np.int64))
    if diff.size:
        idx = tuple(int(i) for i in diff[0])
        yield Mismatch(step, rank, phase, view, idx, int(a[idx]), int(b[idx]))


def _global_batch(rec) -> GlobalBatch:
    return GlobalBatch(
        req_ids=tuple(str(x) for x in rec["req_ids"]),
        idx_mapping=np.arange(len(rec["req_ids"]), dtype=np.int64),  # rows of block_table_global
        num_scheduled_tokens=rec["num_scheduled_tokens"].astype(np.int64),
        num_computed_tokens=rec["num_computed_tokens"].astype(np.int64),
        positions=rec["positions"].astype(np.int64),
        input_ids=rec["input_ids"].astype(np.int64),
        prefill_len=rec["prefill_len"].astype(np.int64),
        is_prefilling=rec["is_prefilling"].astype(bool),
    )


def mirror(trace, *, stop_at_first: bool = False) -> MirrorReport:
    """Recompute every (step, rank)'s layout, rank-local batch, block-table rows and slot mappings
    from the recorded global batch with pcpviz's code and compare them with the trace.

    Raises ValueError on the engine's own DCP (run.json ``dcp_group`` "pcp"): its KV is sharded by
    ``pcpviz.reference.dcp``, a data path the mirror does not model (the DCP checks hold it)."""
    meta = trace.run_meta
    if meta.dcp_group:
        raise ValueError(f"mirror: {trace.path}: DCP {meta.recorded_value('dcp')} sharded over the "
                         f"{meta.dcp_group} group is not modelled here; pcpviz check's dcp_* checks "
                         "hold its slots and lengths")
    n = int(meta.pcp)
    sizes = list(meta.block_sizes or [meta.block_size])
    shard = meta.shard_decode_requests if meta.shard_decode_requests is not None else n > 1
    dcp = meta.dcp
    mismatches: list[Mismatch] = []
    compared = views = 0
    for step in trace.steps:
        for rank in trace.ranks:
            if not trace.has(step, rank, "target"):
                continue  # a dummy run
            rec = trace.record(step, rank, "target")
            if "warmup" in rec:
                continue
            batch = _global_batch(rec)
            # P as recorded: vLLM pads the rank-local batch to a CUDA-graph size (PIECEWISE / FULL)
            padded = int(rec["padded_gather_idx"].shape[0]) // n if "padded_gather_idx" in rec else None
            lay = plan_layout(batch.num_scheduled_tokens, batch.is_prefilling, n, shard_decode_requests=shard,
                              dcp_world_size=dcp, padded_num_tokens=padded)
            local = partition_batch(batch, rank, n, layout=lay)
            nr = local.num_reqs
            tables = rec["block_table_global"]  # int32[G, R, W]: each request's row, batch order
            glob = compute_slot_mappings(list(tables), sizes, batch.idx_mapping,
                                         query_start_loc=batch.query_start_loc, positions=batch.positions)
            pairs = [
                ("padded_gather_idx", lay.padded_gather_idx), ("hidden_restore_idx", lay.hidden_restore_idx),
                ("kv_write_mask", lay.kv_write_mask), ("local_positions", local.positions),
                ("local_input_ids", local.input_ids), ("local_seq_lens", local.seq_lens[:nr]),
                ("local_query_start_loc", local.query_start_loc[: nr + 1]),
                ("local_is_prefilling", local.is_prefilling[:nr]),
                ("block_table_local", np.stack([gather_block_table_rows(t, local.global_req_idx, nr)
                                                for t in tables])),
                ("slot_mapping_global", glob), ("slot_mapping_gathered", gathered_slot_mapping(glob, lay)),
            ]
            for view, ours in pairs:
                if view in rec:
                    views += 1
                    mismatches.extend(_compare(step, rank, "target", view, ours, rec[view]))
            for phase in trace.phases(step, rank):
                if not phase.startswith("draft_") or phase == "draft_0":
                    continue
                d = trace.record(step, rank, phase)
                if "slot_mapping_draft" not in d or "draft_positions" not in d:
                    continue
                want = compute_slot_mappings(list(tables), sizes, batch.idx_mapping,
                                             query_start_loc=np.arange(batch.num_reqs + 1),
                                             positions=d["draft_positions"])
                views += 1
                mismatches.extend(_compare(step, rank, phase, "slot_mapping_draft", want, d["slot_mapping_draft"]))
            compared += 1
            if stop_at_first and mismatches:
                return MirrorReport(compared, views, tuple(mismatches))
    return MirrorReport(compared, views, tuple(mismatches))
