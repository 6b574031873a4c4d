"""Issue 35: copy plans (``pcpviz.vllm.recording.copyplan``). A hook's byte views are kept
across steps; these tests hold that a reused plan still copies each step's values, that what
is not a view of the hook's memory is copied afresh, and that a plan does not keep a transient
tensor's memory alive for long."""

from __future__ import annotations

import gc

import numpy as np
import torch

from pcpviz.vllm.recording.copyplan import PlanCache
from pcpviz.vllm.recording.host import StepPack
from pcpviz.vllm.recording.ring import DeviceRing


def _step(pack: StepPack, views: dict) -> dict:
    phase: dict = {}
    pack.put(phase, views)
    return pack.stage({"p": phase}).resolve()["p"]


def test_a_reused_plan_copies_the_values_of_each_step():
    pack = StepPack(DeviceRing(1 << 14))
    ids = torch.zeros(64, dtype=torch.int32)  # a persistent buffer: the hook slices it every step
    table = torch.zeros(8, 16, dtype=torch.int32)
    for step in range(5):
        ids[:3] = torch.tensor([step, step + 1, step + 2])
        table[0, :2] = step * 10
        out = _step(pack, {"input_ids": ids[:3], "row": table[:1], "col": table[:, 1]})  # col: strided
        ids.fill_(-1)  # vLLM overwrites its buffers after the hook
        table.fill_(-1)
        assert out["input_ids"].tolist() == [step, step + 1, step + 2]
        assert out["row"][0, :3].tolist() == [step * 10, step * 10, 0]
        assert out["col"].tolist() == [step * 10] + [0] * 7
        table.zero_()
    stats = pack.plans.stats()
    assert stats["misses"] == 1 and stats["hits"] == 4  # one plan, built once


def test_same_address_other_shape_or_dtype_is_another_plan():
    pack = StepPack(DeviceRing(1 << 14))
    buf = torch.arange(16, dtype=torch.int64)
    assert _step(pack, {"a": buf[:4]})["a"].tolist() == [0, 1, 2, 3]
    assert _step(pack, {"a": buf[:6]})["a"].tolist() == [0, 1, 2, 3, 4, 5]  # more tokens this step
    assert _step(pack, {"a": buf[:2].view(torch.int32)})["a"].tolist() == [0, 0, 1, 0]
    assert _step(pack, {"a": buf[:4].view(2, 2).t()})["a"].tolist() == [[0, 2], [1, 3]]  # reshape copies
    buf[:4] = 9
    assert _step(pack, {"a": buf[:4].view(2, 2).t()})["a"].tolist() == [[9, 9], [9, 9]]
    assert pack.plans.stats()["misses"] == 4


def test_a_plan_of_a_transient_tensor_is_swept_and_its_memory_freed():
    cache = PlanCache()
    persistent = torch.arange(32, dtype=torch.int32)
    pack = StepPack(DeviceRing(1 << 14))
    pack.plans = cache
    transient = torch.arange(4096, dtype=torch.int64) * 3
    ref_ptr = transient.data_ptr()
    out = _step(pack, {"t": transient[:2], "p": persistent[:2]})
    assert out["t"].tolist() == [0, 3] and len(cache.plans) == 1
    del transient
    gc.collect()
    _step(pack, {"p": persistent[:2]})
    assert cache.sweep() == 1  # the transient's plan held its memory alone
    assert len(cache.plans) == 1 and next(iter(cache.plans))[0][0] == persistent.data_ptr()
    assert all(b.untyped_storage().data_ptr() != ref_ptr for p in cache.plans.values() for b in p.flat)


def test_the_cache_is_bounded():
    cache = PlanCache(max_plans=3)
    bufs = [torch.zeros(4) for _ in range(5)]
    pack = StepPack(DeviceRing(1 << 14))
    pack.plans = cache
    for b in bufs:
        _step(pack, {"x": b})
    assert len(cache.plans) == 3
    assert [sig[0][0] for sig in cache.plans] == [b.data_ptr() for b in bufs[2:]]  # least recently used out


def test_a_dropped_step_leaves_the_plan_right():
    pack = StepPack(DeviceRing(64))
    buf = torch.arange(32, dtype=torch.int64)  # 256 bytes: never fits the 64-byte ring
    phase: dict = {}
    pack.put(phase, {"a": buf})
    assert pack.stage({"p": phase}) is None and pack.ring.overflow_steps == 1
    assert _step(pack, {"a": buf[:4]})["a"].tolist() == [0, 1, 2, 3]
    assert np.array_equal(_step(pack, {"a": buf[:4]})["a"], np.arange(4))
