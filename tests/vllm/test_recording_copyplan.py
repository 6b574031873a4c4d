"""Issue 35: byte views kept across steps (``pcpviz.vllm.recording.copyplan``). These tests hold
that a kept view still copies each step's values, that what is not a view of the hook's memory
is copied afresh, and that the cache does not keep a transient tensor's memory alive for long."""

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
    assert stats["misses"] == 5 + 2 and stats["hits"] == 2 * 4  # the strided column is a copy: never kept


def test_a_new_tensor_beside_kept_ones_misses_alone():
    pack = StepPack(DeviceRing(1 << 14))
    ids = torch.arange(16, dtype=torch.int32)
    for step in range(4):
        sampled = torch.full((3,), step, dtype=torch.int64)  # a sampler output: new memory every step
        out = _step(pack, {"ids": ids[:4], "sampled": sampled})
        assert out["sampled"].tolist() == [step] * 3 and out["ids"].tolist() == [0, 1, 2, 3]
    assert pack.plans.stats()["hits"] >= 3  # ids[:4] found on every step after the first


def test_same_address_other_shape_or_dtype_is_another_plan():
    pack = StepPack(DeviceRing(1 << 14))
    buf = torch.arange(16, dtype=torch.int64)
    assert _step(pack, {"a": buf[:4]})["a"].tolist() == [0, 1, 2, 3]
    assert _step(pack, {"a": buf[:6]})["a"].tolist() == [0, 1, 2, 3, 4, 5]  # more tokens this step
    assert _step(pack, {"a": buf[:2].view(torch.int32)})["a"].tolist() == [0, 0, 1, 0]
    assert _step(pack, {"a": buf[:4].view(2, 2).t()})["a"].tolist() == [[0, 2], [1, 3]]  # reshape copies
    buf[:4] = 9
    assert _step(pack, {"a": buf[:4].view(2, 2).t()})["a"].tolist() == [[9, 9], [9, 9]]
    assert pack.plans.stats()["misses"] == 5  # the transposed view is a copy each time


def test_a_view_of_a_transient_tensor_is_swept_and_its_memory_freed():
    cache = PlanCache()
    persistent = torch.arange(32, dtype=torch.int32)
    pack = StepPack(DeviceRing(1 << 14))
    pack.plans = cache
    transient = torch.arange(4096, dtype=torch.int64) * 3
    ref_ptr = transient.data_ptr()
    out = _step(pack, {"t": transient[:2], "p": persistent[:2]})
    assert out["t"].tolist() == [0, 3] and len(cache.views) == 2
    del transient
    gc.collect()
    assert cache.sweep() == 1  # the transient's view held its memory alone
    assert [sig[0] for sig in cache.views] == [persistent.data_ptr()]
    assert cache.held == persistent.untyped_storage().nbytes()
    assert all(b.untyped_storage().data_ptr() != ref_ptr for b, _, _ in cache.views.values())


def test_a_large_storage_is_never_held():
    cache = PlanCache(max_entry_bytes=1024)
    pack = StepPack(DeviceRing(1 << 14))
    pack.plans = cache
    big = torch.zeros(4096, dtype=torch.int32)  # 16 kB of storage behind a 3-element slice
    assert _step(pack, {"x": big[:3]})["x"].tolist() == [0, 0, 0]
    assert len(cache.views) == 0 and cache.held == 0


def test_the_cache_is_bounded_in_views_and_bytes():
    cache = PlanCache(max_views=3)
    bufs = [torch.zeros(4) for _ in range(5)]
    pack = StepPack(DeviceRing(1 << 14))
    pack.plans = cache
    for b in bufs:
        _step(pack, {"x": b})
    assert [sig[0] for sig in cache.views] == [b.data_ptr() for b in bufs[2:]]  # least recently used out
    cache = PlanCache(max_bytes=40)
    pack.plans = cache
    for b in bufs:
        _step(pack, {"x": b})
    assert len(cache.views) == 2 and cache.held == 32  # 16 bytes of storage each


def test_a_dropped_step_leaves_the_plan_right():
    pack = StepPack(DeviceRing(64))
    buf = torch.arange(32, dtype=torch.int64)  # 256 bytes: never fits the 64-byte ring
    phase: dict = {}
    pack.put(phase, {"a": buf})
    assert pack.stage({"p": phase}) is None and pack.ring.overflow_steps == 1
    assert _step(pack, {"a": buf[:4]})["a"].tolist() == [0, 1, 2, 3]
    assert np.array_equal(_step(pack, {"a": buf[:4]})["a"], np.arange(4))
