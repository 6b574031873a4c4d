"""The order of reads and writes a candidate fix must respect, in three vLLM 0.33.0 paths.

Each ``ORDERS`` entry is the sequence of buffer accesses of one path, every access anchored to
the vLLM line that makes it (``VllmRef``; a test reads the installed package). ``check_order``
replays the sequence, with a candidate fix spliced in, and reports every read that finds the
buffer holding something else than it needs, and every copy that reads and writes one buffer:

* ``piecewise_draft_prefill``: MTP's draft prefill under PIECEWISE graphs, whose replay reads the
  speculator's own ``input_ids`` / ``positions`` (docs/findings/piecewise-draft-prefill.md);
* ``full_draft_prefill``: a FULL draft-prefill replay, then an eager draft decode in the same
  ``propose`` (docs/findings/full-draft-prefill-state.md);
* ``dspark_dummy_run``: a DSpark dummy run with attention after real steps
  (docs/findings/dspark-dummy-run-stale-block-tables.md).

PCP=2: the PIECEWISE finding's first candidate fix, writing the local rows into the speculator's
buffers in ``prepare_draft_prefill``, breaks two reads; the copy inside ``_run_model`` none::

    >>> [p.split(":")[0] for p in check_order("piecewise_draft_prefill", "write_in_prepare_draft_prefill")]
    ['prepare_draft_prefill', '_prefill']
    >>> check_order("piecewise_draft_prefill", "copy_in_run_model")
    []
"""

from __future__ import annotations

from dataclasses import dataclass

from pcpviz.teaching.review import VllmRef

__all__ = ["Access", "CandidateFix", "ORDERS", "CANDIDATE_FIXES", "check_order"]

_AR = "v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py"
_PCP = "v1/worker/gpu/pcp_manager.py"
_DF = "v1/worker/gpu/spec_decode/dflash/speculator.py"


@dataclass(frozen=True)
class Access:
    """``op``: ``write`` (``buffer`` then holds ``value``), ``read`` (needs ``value``), ``copy``
    (reads ``source``, which must hold ``needs``, and writes ``value`` into ``buffer``), ``skip``
    (a write the path does not make: ``buffer`` keeps what it holds)."""

    what: str  # the call that makes it
    op: str
    buffer: str
    value: str
    ref: VllmRef | None = None  # None: an access a candidate fix adds
    source: str = ""
    needs: str = ""


@dataclass(frozen=True)
class CandidateFix:
    """Splice ``accesses`` in ``after`` (or ``instead of``) the access whose ``what`` is ``at``."""

    at: str
    accesses: tuple[Access, ...]
    replace: bool = False


_IDS, _POS = "global shifted ids", "global positions"
_SPEC_IDS, _SPEC_POS = "speculator.input_ids", "speculator.positions"
ORDERS: dict[str, tuple[Access, ...]] = {
    "piecewise_draft_prefill": (
        Access("prepare_prefill_inputs", "write", _SPEC_IDS, _IDS, VllmRef(_AR, 226, "prepare_prefill_inputs(")),
        Access("prepare_prefill_inputs (positions)", "write", _SPEC_POS, _POS,
               VllmRef(_AR, 226, "prepare_prefill_inputs(")),
        Access("prepare_draft_prefill", "copy", "local.input_ids", "rank-local ids",
               VllmRef(_PCP, 857, "torch.index_select("),
               source=_SPEC_IDS, needs=_IDS),
        Access("_prefill", "read", _SPEC_POS, _POS,
               VllmRef(_AR, 452, "positions = self.input_buffers.positions[last_token_indices]")),
        Access("_run_model (the PIECEWISE replay reads the captured ids)", "read", _SPEC_IDS, "rank-local ids",
               VllmRef(_AR, 416, "input_ids=input_buffers.input_ids[:num_tokens],")),
        Access("_run_model (the PIECEWISE replay reads the captured positions)", "read", _SPEC_POS,
               "rank-local positions", VllmRef(_AR, 417, "positions=input_buffers.positions[:num_tokens],")),
        Access("_prefill (draft positions)", "write", _SPEC_POS, "draft positions",
               VllmRef(_AR, 489, "self.input_buffers.positions[:num_reqs] = positions")),
        Access("prepare_decode_inputs", "read", _SPEC_POS, "draft positions",
               VllmRef(_AR, 312, "prepare_decode_inputs(")),
    ),
    "full_draft_prefill": (
        Access("prepare_draft_prefill", "write", "pcp.draft_prefill_batch", "this step's rank-local batch",
               VllmRef(_PCP, 863, "self.draft_prefill_batch = local_batch")),
        Access("run_fullgraph (no Python runs: restore_draft_prefill's clear is not replayed)", "skip",
               "pcp.draft_prefill_batch", "",
               VllmRef(_AR, 280, "self.prefill_cudagraph_manager.run_fullgraph(prefill_batch_desc)")),
        Access("get_draft_input_buffers (an eager draft decode)", "read", "pcp.draft_prefill_batch", "None",
               VllmRef(_PCP, 843, "batch = self.draft_prefill_batch")),
        Access("prepare_draft_prefill (next propose)", "write", "pcp.draft_prefill_batch", "None",
               VllmRef(_PCP, 851, "self.draft_prefill_batch = None")),
    ),
    "dspark_dummy_run": (
        Access("gather_block_tables (the last real propose)", "write", "input_block_tables", "live requests' rows",
               VllmRef(_DF, 505, "self.block_tables.gather_block_tables(")),
        Access("PCPManager.get_dummy_block_tables", "write", "pcp.local_block_tables", "zeros",
               VllmRef(_PCP, 768, "block_table[:num_reqs].zero_() for block_table in self._local_block_tables")),
        Access("propose(dummy_run=True): no gather", "skip", "input_block_tables", "",
               VllmRef(_DF, 504, "if self.pcp_manager is not None and not dummy_run:")),
        Access("prepare_dflash_inputs", "read", "input_block_tables", "zeros",
               VllmRef(_DF, 531, "self.block_tables.input_block_tables[gid],")),
    ),
}

CANDIDATE_FIXES: dict[str, tuple[str, CandidateFix]] = {
    "write_in_prepare_draft_prefill": ("piecewise_draft_prefill", CandidateFix("prepare_draft_prefill", (
        Access("prepare_draft_prefill", "copy", _SPEC_IDS, "rank-local ids", source=_SPEC_IDS, needs=_IDS),
        Access("prepare_draft_prefill (positions)", "write", _SPEC_POS, "rank-local positions")), replace=True)),
    "copy_in_run_model": ("piecewise_draft_prefill", CandidateFix("_prefill", (
        Access("_run_model: copy the local rows", "copy", _SPEC_IDS, "rank-local ids", source="local.input_ids",
               needs="rank-local ids"),
        Access("_run_model: copy the local positions", "write", _SPEC_POS, "rank-local positions")))),
    "clear_after_replay": ("full_draft_prefill", CandidateFix(
        "run_fullgraph (no Python runs: restore_draft_prefill's clear is not replayed)", (
        Access("propose: draft_prefill_batch = None after the replay", "write", "pcp.draft_prefill_batch", "None"),))),
    "eager_prefill_under_pcp": ("full_draft_prefill", CandidateFix(
        "run_fullgraph (no Python runs: restore_draft_prefill's clear is not replayed)", (
        Access("_prefill -> restore_draft_prefill (eager)", "write", "pcp.draft_prefill_batch", "None",
               VllmRef(_PCP, 879, "self.draft_prefill_batch = None")),), replace=True)),
    "zero_input_block_tables": ("dspark_dummy_run", CandidateFix("PCPManager.get_dummy_block_tables", (
        Access("BlockTables.get_dummy_block_tables, also under PCP", "write", "input_block_tables", "zeros",
               VllmRef("v1/worker/gpu/block_table.py", 224, "block_table[:num_rows].zero_()")),))),
    "gather_in_dummy_runs": ("dspark_dummy_run", CandidateFix("propose(dummy_run=True): no gather", (
        Access("gather_block_tables(dummy idx_mapping = arange: live request slots)", "write", "input_block_tables",
               "live requests' rows"),), replace=True)),
}


def _spliced(order: str, fix: str | None) -> tuple[Access, ...]:
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; known: {', '.join(ORDERS)}")
    seq = ORDERS[order]
    if fix is None:
        return seq
    if fix not in CANDIDATE_FIXES or CANDIDATE_FIXES[fix][0] != order:
        raise ValueError(f"unknown fix {fix!r} for {order!r}; known: "
                         f"{', '.join(k for k, (o, _) in CANDIDATE_FIXES.items() if o == order)}")
    f = CANDIDATE_FIXES[fix][1]
    at = next(i for i, a in enumerate(seq) if a.what == f.at)
    return seq[:at] + f.accesses + seq[at + 1:] if f.replace else seq[:at + 1] + f.accesses + seq[at + 1:]


def check_order(order: str, fix: str | None = None) -> list[str]:
    """One line per problem: ``"<what>: <buffer> holds <value>, needs <value>"``, or a copy that
    reads and writes one buffer. ``[]``: every read finds what it needs."""
    held: dict[str, str] = {}
    problems = []
    for a in _spliced(order, fix):
        if a.op == "copy":
            if a.source == a.buffer:
                problems.append(f"{a.what}: the copy reads and writes {a.buffer} (an index_select onto its own input)")
            elif held.get(a.source) != a.needs:
                problems.append(f"{a.what}: {a.source} holds {held.get(a.source)}, needs {a.needs}")
            held[a.buffer] = a.value
        elif a.op == "write":
            held[a.buffer] = a.value
        elif a.op == "read" and held.get(a.buffer) != a.value:
            problems.append(f"{a.what}: {a.buffer} holds {held.get(a.buffer)}, needs {a.value}")
    return problems
