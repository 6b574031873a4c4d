"""A hook call's views planned once and recorded again with one copy: FULL CUDA-graph replays first.

A draft forward that vLLM replays as a FULL graph reads the same buffers, by address, every time
that graph (one size ``n``) is replayed: the speculator's input ids, positions and sequence
lengths, its block tables, the hidden-state rows, the tensors the graph was captured with. So its
phase is the same list of byte views and the same entries every step; only the bytes change. The
first replay of a shape builds the phase as every other hook does (``host.StepPack.put``) and, at
the same time, a ``ReplayPlan``: the byte views of the buffers in copy order, and the phase's
entries with their device places written relative to the copy (``("p", offset, dtype, shape)``).
Every later replay of that shape is, on vLLM's step thread:

* one ``torch.cat`` of the kept byte views (and the few ``dynamic`` tensors vLLM allocates anew
  each step, e.g. the batch's ``idx_mapping``) into the device ring;
* ``phase.update(plan.entries)``: the entries as they are (immutable tuples, shared by every
  step that uses the plan).

Nothing rewrites the ``"p"`` entries: the drain (off the step thread) lists where each hit landed
in the step (``staged.StagedStep.placed``: phase, views, offset) and the writer reads them there
(``pcpviz.trace.packed.resolve``), so the shared entries cross to the writer process unchanged.
The PCP=1 target hooks and verify go the same way (``RankRecorder.planned_put``: their batch's
persistent buffers by address, the tensors vLLM makes each step handed anew).

When a plan is right: the hook's caller keys it by everything its views depend on besides the
bytes (the graph's manager and size, the draft step, the batch's request count, the addresses of
the buffers that are not fixed for the run), and a plan is only made when every view of the phase
is a copy of device memory or a constant (no tensor computed by the hook, ``host.Fresh``).
A dynamic tensor of another shape or dtype than at planning misses (the slow path runs).

Batch-1 decode, PCP=1, K=2, ``draft_1`` replayed at ``n = 1``: the plan holds 11 byte views
(ids, positions, sequence lengths, block-table rows and ``num_blocks``, the slot mapping, hidden
rows twice, the captured ids and positions) and one dynamic tensor (``idx_mapping[:1]``); a hit
is one ``cat`` of 12 tensors and one dict update.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ReplayPlan", "PlanBook", "template_entries", "MAX_PLANS"]

MAX_PLANS = 256  # shapes kept per recorder (vLLM captures a few dozen graph sizes)


class ReplayPlan:
    """One replayed phase's copy: ``sources`` (kept uint8 views; None where a dynamic tensor fills
    in), ``metas`` (dtype name, shape, nbytes) per source, ``dynamic_at`` (position in the copy,
    index in the dynamic tensors handed to each replay), ``total`` bytes, ``entries`` (view ->
    entry, device entries ``("p", offset in the copy, dtype, shape)``)."""

    __slots__ = ("sources", "metas", "dynamic_at", "total", "entries")

    def __init__(self, sources: list, metas: list, dynamic_at: list[tuple[int, int]], entries: dict[str, Any]) -> None:
        self.sources, self.metas, self.dynamic_at, self.entries = sources, metas, dynamic_at, entries
        self.total = sum(m[2] for m in metas)


class PlanBook:
    """The plans of one recorder, by key, at most ``MAX_PLANS`` (the oldest out first)."""

    def __init__(self, max_plans: int = MAX_PLANS) -> None:
        self.plans: dict[tuple, ReplayPlan] = {}
        self.max_plans = max_plans
        self.hits = self.misses = self.unplannable = 0

    def get(self, key: tuple) -> ReplayPlan | None:
        plan = self.plans.get(key)
        if plan is None:
            self.misses += 1
        else:
            self.hits += 1
        return plan

    def add(self, key: tuple, plan: ReplayPlan) -> None:
        if len(self.plans) >= self.max_plans:
            self.plans.pop(next(iter(self.plans)))
        self.plans[key] = plan

    def stats(self) -> dict[str, int]:
        return {"plans": len(self.plans), "hits": self.hits, "misses": self.misses,
                "unplannable": self.unplannable}


def _rewrite(entry: Any, leaf: Any, memo: dict[int, list]) -> Any:
    """``entry`` with ``leaf`` applied to every entry that is not a ``("d", fn, args, index)``, the
    args of one computation rewritten once (``memo``: id(args) -> new args) so they stay shared."""
    if isinstance(entry, tuple) and entry and entry[0] == "d":
        args = entry[2]
        new = memo.get(id(args))
        if new is None:
            new = memo[id(args)] = [_rewrite(a, leaf, memo) for a in args]
        return ("d", entry[1], new, entry[3])
    return leaf(entry)


def template_entries(entries: dict[str, Any], places: dict[int, tuple]) -> dict[str, Any] | None:
    """``entries`` with every slot (by id, ``places``: id(slot) -> (offset, dtype, shape)) written
    as ``("p", offset, dtype, shape)``; None when a place is in none of them (a view put into another
    phase: a plan would copy its bytes and lose its entry). Arguments shared by several
    ``("d", ...)`` entries stay shared (one host computation)."""
    memo: dict[int, list] = {}
    used: set[int] = set()

    def slot(e: Any) -> Any:
        p = places.get(id(e))
        if p is None:
            return e
        used.add(id(e))
        return ("p", *p)

    out = {k: _rewrite(v, slot, memo) for k, v in entries.items()}
    return out if len(used) == len(places) else None
