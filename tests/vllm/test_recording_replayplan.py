"""Issue 35: FULL-replayed draft phases recorded from a plan (``recording.replayplan``) hold exactly
the views the per-view path records, through vLLM 0.33.0's own classes on CPU (``pcpviz.vllm.replay``,
stand-in FULL graphs), at PCP=1 and PCP=2; and the plan's pieces on their own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

from pcpviz.vllm.recording import replayplan  # noqa: E402
from pcpviz.vllm.recording.host import Deferred, StepPack  # noqa: E402
from pcpviz.vllm.recording.ring import DeviceRing  # noqa: E402
from pcpviz.vllm.replay import replay  # noqa: E402

TIMES = {"t_start_us", "t_end_us"}
# The graph ledger's counts per phase differ between two identical PCP=2 replays, recorded the per-view
# way both times (the replay's ranks are threads and the ledger notes a replay under the phase some
# thread is in): not compared at PCP=2.
LEDGER_VIEWS = {"graph_replays", "graph_full_replays", "graph_inputs_moved"}


def _views(trace, skip: set = TIMES) -> dict:
    out = {}
    for step in trace.steps:
        for rank in trace.ranks:
            for ph in trace.phases(step, rank):
                rec = trace.record(step, rank, ph)
                out[(step, rank, ph)] = {v: np.asarray(rec[v]) for v in rec if v not in skip}
    return out


def _counting(monkeypatch) -> dict:
    seen = {"hits": 0, "plans": 0, "hit": set()}
    get, add = replayplan.PlanBook.get, replayplan.PlanBook.add

    def counted_get(self, key):
        plan = get(self, key)
        seen["hits"] += plan is not None
        if plan is not None and isinstance(key[0], str):
            seen["hit"].add(key[0])  # the hook's plans that were hit ("partition", "verify", ...)
        return plan

    def counted_add(self, key, plan):
        seen["plans"] += 1
        add(self, key, plan)

    monkeypatch.setattr(replayplan.PlanBook, "get", counted_get)
    monkeypatch.setattr(replayplan.PlanBook, "add", counted_add)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("pcp, scenario, mode, min_hits", [(1, "decode_only", "FULL_DECODE_ONLY", 4),
                                                           (1, "mixed", "FULL_DECODE_ONLY", 0),
                                                           (2, "mixed", "FULL_DECODE_ONLY", 0),
                                                           (2, "decode_only", "NONE", 4)])
def test_planned_full_replays_record_the_same_views_as_the_per_view_path(tmp_path, monkeypatch, pcp, scenario, mode,
                                                                          min_hits):
    """Every view of every step equal, timestamps aside. decode_only repeats its shapes (plans are
    hit: at PCP=2, eager, the PCP manager's partition and attention views); mixed changes shape every
    step (plans are made, the per-view path records). The PCP=2 decode_only replay under FULL graphs
    stops at a rank barrier with or without recording (not run)."""
    kw = dict(pcp=pcp, mtp=3, scenario=scenario, graph_mode=mode)
    seen = _counting(monkeypatch)
    planned = replay(trace_dir=tmp_path / "planned", **kw)
    assert seen["plans"] >= 1 and seen["hits"] >= min_hits, seen  # later replays of a shape came from its plan
    if pcp > 1 and min_hits:
        assert {"partition", "prepare_attn"} <= seen["hit"], seen  # the PCP manager's target views, planned
    with monkeypatch.context() as m:  # every hook view by view: no plan is ever found
        m.setattr(replayplan.PlanBook, "get", lambda self, key: None)
        plain = replay(trace_dir=tmp_path / "plain", **kw)
    skip = TIMES | (LEDGER_VIEWS if pcp > 1 else set())
    a, b = _views(planned.trace, skip), _views(plain.trace, skip)
    assert a.keys() == b.keys()
    full = 0
    for where, views in a.items():
        assert views.keys() == b[where].keys(), where
        for v, x in views.items():
            assert x.dtype == b[where][v].dtype and np.array_equal(x, b[where][v]), (where, v)
        full += str(views.get("graph_mode", "")) == "FULL"
    assert full >= 4 or mode == "NONE"


def _pack_with_plan(values: torch.Tensor, idx: torch.Tensor):
    pack = StepPack(DeviceRing(1 << 14))
    phase: dict = {}
    with pack.planning(phase, [idx]) as made:
        pack.put(phase, {"v": values[:3], "rows": Deferred("take_rows", [values, idx]),
                         "k": np.array(7, dtype=np.int64)})
    return pack, phase, made[0]


def test_a_plan_copies_the_bytes_of_each_step_and_its_dynamic_tensors():
    values = torch.arange(10, dtype=torch.int64)  # a persistent buffer, rewritten every step
    pack, phase, plan = _pack_with_plan(values, torch.tensor([2, 0], dtype=torch.int32))
    assert plan is not None and plan.dynamic_at and plan.total == 3 * 8 + 10 * 8 + 2 * 4
    first = pack.stage({"draft_1": phase}).resolve()["draft_1"]
    assert first["v"].tolist() == [0, 1, 2] and first["rows"].tolist() == [2, 0] and int(first["k"]) == 7
    for step in range(3):  # later steps: new bytes in the buffer, a new idx tensor each step
        values.copy_(torch.arange(10) * 10 + step)
        idx = torch.tensor([step, 9], dtype=torch.int32)
        ph: dict = {}
        assert pack.replay(plan, ph, [idx])
        values.fill_(-1)  # overwritten after the hook: the copy holds the hook's moment
        out = pack.stage({"draft_1": ph}).resolve()["draft_1"]
        assert out["v"].tolist() == [step, 10 + step, 20 + step]
        assert out["rows"].tolist() == [10 * step + step, 90 + step]
        assert ph["v"] is plan.entries["v"] and ph["v"][0] == "p"  # shared, never rewritten: placed says where
    assert plan.entries["v"][0] == "p"


def test_a_dynamic_tensor_of_another_shape_misses_and_a_later_put_wins():
    values = torch.arange(10, dtype=torch.int64)
    pack, _, plan = _pack_with_plan(values, torch.tensor([2, 0], dtype=torch.int32))
    pack.stage({"x": {}})
    ph: dict = {}
    assert not pack.replay(plan, ph, [torch.tensor([1, 2, 3], dtype=torch.int32)]) and ph == {}
    assert not pack.replay(plan, ph, [torch.tensor([1, 2], dtype=torch.int64)])
    assert pack.replay(plan, ph, [torch.tensor([1, 2], dtype=torch.int32)])
    pack.put(ph, {"v": torch.tensor([5], dtype=torch.int64)})  # the same view put again after the replay
    out = pack.stage({"p": ph}).resolve()["p"]
    assert out["v"].tolist() == [5] and out["rows"].tolist() == [1, 2]


def test_a_phase_with_a_tensor_computed_by_the_hook_is_not_planned():
    from pcpviz.vllm.recording.host import Fresh

    pack = StepPack(DeviceRing(1 << 12))
    phase: dict = {}
    with pack.planning(phase, []) as made:
        pack.put(phase, {"a": torch.arange(4), "f": Fresh(torch.ones(2))})
    assert made[0] is None and pack.book.unplannable == 1
    out = pack.stage({"p": phase}).resolve()["p"]  # recorded all the same
    assert out["a"].tolist() == [0, 1, 2, 3] and out["f"].tolist() == [1.0, 1.0]


def test_the_book_keeps_at_most_its_bound():
    book = replayplan.PlanBook(max_plans=2)
    for i in range(3):
        book.add((i,), replayplan.ReplayPlan([], [], [], {}))
    assert list(book.plans) == [(1,), (2,)] and book.get((0,)) is None and book.get((2,)) is not None


def test_dynamic_tensors_are_not_kept_past_their_step():
    """A tensor vLLM makes anew each step (an ``idx_mapping``, a sampler output) is copied through a
    byte view of that step only: replaying a plan for many steps leaves the kept views as they were
    after planning (the cache would otherwise hold every step's dead storage until its sweep), and
    two hooks handed the same tensor in one step share one view of it."""
    values = torch.arange(10, dtype=torch.int64)
    pack, phase, plan = _pack_with_plan(values, torch.tensor([2, 0], dtype=torch.int32))
    pack.stage({"draft_1": phase}).resolve()
    kept = pack.plans.stats()["views"]
    for step in range(40):
        idx = torch.tensor([step % 10, 9], dtype=torch.int32)
        a: dict = {}
        b: dict = {}
        assert pack.replay(plan, a, [idx]) and pack.replay(plan, b, [idx[:2]])
        assert len(pack.dynamic) == 1  # idx and idx[:2]: the same memory read the same way
        out = pack.stage({"a": a, "b": b}).resolve()
        assert out["a"]["rows"].tolist() == out["b"]["rows"].tolist() == [step % 10, 9]
        assert pack.dynamic == {}
    assert pack.plans.stats()["views"] <= kept  # never grows (the sweep may drop planning's own idx view)


def test_an_event_given_back_is_recorded_again_by_a_later_step():
    """The staged steps' CUDA events are pooled per device: a drained step's event is the next
    step's (``staged.take_event``), never another device's."""
    from pcpviz.vllm.recording import staged

    staged._EVENTS.clear()
    marker = object()
    staged._give_event(marker, 0)
    assert staged._EVENTS == {0: [marker]}
    assert staged.take_event(0) is marker and staged._EVENTS[0] == []
    staged._give_event(marker, 1)
    for _ in range(staged.MAX_POOLED_EVENTS + 3):
        staged._give_event(object(), 0)
    assert len(staged._EVENTS[0]) == staged.MAX_POOLED_EVENTS and staged._EVENTS[1] == [marker]
    staged._EVENTS.clear()
