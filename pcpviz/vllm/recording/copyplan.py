"""Copy plans: the byte views a hook's tensors are copied through, made once and kept across steps.

A hook hands ``StepPack`` the same memory every step: slices of vLLM's persistent buffers
(``input_ids[:t]``, ``block_tables[0][:r]``, the slot mappings), new Python objects over the same
addresses. Copying them into the device ring takes one ``torch.cat`` of their bytes, and seeing a
tensor as bytes takes ``reshape(-1)``, ``is_contiguous`` and ``view(uint8)``: three dispatches a
tensor, about 40 tensors a decode step. A ``CopyPlan`` keeps those byte views, keyed by what
decides the bytes a view reads: address, dtype, shape and strides of every tensor of the call
(``signature``). A later call with the same signature reuses them: one dictionary lookup and the
``cat``.

Why a hit is always right: the plan's views hold their storage, so while the plan lives no other
tensor can be given that address; a tensor with the same address, dtype, shape and strides reads
the very bytes the plan's view reads. Views that are not contiguous (a strided column) are
copied afresh every time (``bytes_now``): their bytes are a copy, not a view.

What a plan keeps alive: the storages of its tensors. vLLM's persistent buffers live anyway; a
tensor the hook saw once (a transient output) would be held by its plan, so ``PlanCache`` keeps
at most ``MAX_PLANS`` plans (least recently used out first) and, every ``SWEEP_EVERY`` stagings,
drops the plans that alone hold a storage (its use count is the plan's own references).

Batch-1 decode, PCP=1, K=2: ``on_global_batch`` hands 8 tensors (``idx_mapping[:1]``,
``query_start_loc[:2]``, ``positions[:3]`` ...); the first step builds the plan (24 dispatches),
every later step looks it up (8 ``data_ptr``/``shape``/``stride`` reads) and runs one ``cat``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

__all__ = ["CopyPlan", "PlanCache", "DTYPES", "MAX_PLANS", "SWEEP_EVERY", "signature"]

DTYPES = {torch.int64: "<i8", torch.int32: "<i4", torch.int16: "<i2", torch.int8: "|i1", torch.uint8: "|u1",
          torch.bool: "|b1", torch.float32: "<f4", torch.float16: "<f2", torch.float64: "<f8",
          torch.bfloat16: "bf16"}
"""The dtypes a hook's tensor can be copied as bytes, and their names in ``pcpviz.trace.packed``."""

MAX_PLANS = 64
SWEEP_EVERY = 32


def signature(tensors: list[torch.Tensor]) -> tuple:
    """What decides the bytes each tensor reads: ``(address, dtype, shape, strides)`` per tensor."""
    return tuple((t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors)


def _bytes(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``t`` as ``uint8[numel * itemsize]`` and whether that is a view of ``t``'s memory (not a copy)."""
    b = t.reshape(-1)
    view = b.is_contiguous()
    if not view:  # a strided column or an expanded view: reshape kept its strides
        b = b.contiguous()
    if b.dtype is not torch.uint8:
        b = b.view(torch.uint8)
    return b, view and b.data_ptr() == t.data_ptr() if t.numel() else view


class CopyPlan:
    """The byte views of one hook call's tensors (``flat``), what the trace says of each
    (``meta``: ``(dtype name, shape, nbytes)``), their total size, and which of them must be
    copied afresh each time (``fresh_bytes``: indices of views that are copies)."""

    __slots__ = ("flat", "meta", "total", "fresh_bytes")

    def __init__(self, flat: list[torch.Tensor], meta: list[tuple], fresh_bytes: tuple[int, ...]) -> None:
        self.flat, self.meta, self.fresh_bytes = flat, meta, fresh_bytes
        self.total = sum(m[2] for m in meta)

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> CopyPlan:
        flat, meta, fresh = [], [], []
        for i, t in enumerate(tensors):
            b, is_view = _bytes(t)
            flat.append(b)
            meta.append((DTYPES[t.dtype], tuple(t.shape), b.shape[0]))
            if not is_view:
                fresh.append(i)
        return cls(flat, meta, tuple(fresh))

    def bytes_now(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The byte views with the copied ones taken again from ``tensors`` (their values now)."""
        flat = list(self.flat)
        for i in self.fresh_bytes:
            flat[i] = _bytes(tensors[i])[0]
        return flat


def _use_count(t: torch.Tensor) -> int | None:
    """How many tensors hold ``t``'s storage (None where this torch cannot say)."""
    try:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1  # less the temporary storage object
    except Exception:  # noqa: BLE001 - a private API: without it the cache is bounded by MAX_PLANS only
        return None


class PlanCache:
    """Plans by signature, least recently used first out past ``max_plans``."""

    def __init__(self, max_plans: int = MAX_PLANS) -> None:
        self.max_plans = max_plans
        self.plans: OrderedDict[tuple, CopyPlan] = OrderedDict()
        self.hits = self.misses = self.swept = 0
        self._stagings = 0

    def get(self, tensors: list[torch.Tensor]) -> tuple[tuple, CopyPlan | None]:
        """``(signature, plan or None)``."""
        sig = signature(tensors)
        plan = self.plans.get(sig)
        if plan is None:
            self.misses += 1
        else:
            self.hits += 1
            self.plans.move_to_end(sig)
        return sig, plan

    def put(self, sig: tuple, plan: CopyPlan) -> None:
        self.plans[sig] = plan
        while len(self.plans) > self.max_plans:
            self.plans.popitem(last=False)

    def staged(self) -> None:
        """A step was staged: every ``SWEEP_EVERY`` stagings, drop the plans that alone hold a storage."""
        self._stagings += 1
        if self._stagings % SWEEP_EVERY == 0:
            self.sweep()

    def sweep(self) -> int:
        """Drop every plan holding a storage nothing else holds; how many were dropped."""
        ours: dict[int, int] = {}
        for plan in self.plans.values():
            for i, b in enumerate(plan.flat):
                if i not in plan.fresh_bytes:
                    key = b.untyped_storage().data_ptr()
                    ours[key] = ours.get(key, 0) + 1
        dead = []
        for sig, plan in self.plans.items():
            for i, b in enumerate(plan.flat):
                if i in plan.fresh_bytes:
                    continue
                n = _use_count(b)
                if n is not None and n <= ours[b.untyped_storage().data_ptr()]:
                    dead.append(sig)
                    break
        for sig in dead:
            del self.plans[sig]
        self.swept += len(dead)
        return len(dead)

    def stats(self) -> dict[str, Any]:
        return {"plans": len(self.plans), "hits": self.hits, "misses": self.misses, "swept": self.swept}
