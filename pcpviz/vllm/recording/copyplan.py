"""Byte views of the hooks' tensors, made once and kept across steps.

A hook hands ``StepPack`` mostly the same memory every step: slices of vLLM's persistent buffers
(``input_ids[:t]``, ``block_tables[0][:r]``, the slot mappings), new Python objects over the same
addresses. Copying them into the device ring takes one ``torch.cat`` of their bytes, and seeing a
tensor as bytes takes ``reshape(-1)``, ``is_contiguous`` and ``view(uint8)``: three dispatches a
tensor, about 40 tensors a decode step. ``PlanCache`` keeps each tensor's byte view, keyed by what
decides the bytes a view reads: address, dtype, shape and strides. A later tensor with the same
key costs one dictionary lookup. One key per tensor, not per hook call: a call that hands one
new tensor (a sampler output, allocated each step) beside persistent ones misses only that one
(on one H200 a whole-call key missed in 6 of the 7 copies of a decode step).

Why a hit is always right: a kept view holds its storage, so while it is kept no other tensor
can be given that address; a tensor with the same address, dtype, shape and strides reads the
very bytes the kept view reads. A tensor whose bytes are a copy (a strided column, a reshape that
had to copy) is never kept: it is made contiguous afresh every time.

What the cache holds alive: the storages of its views. vLLM's persistent buffers live anyway; a
tensor the hook saw once (a transient output) would be held by its view, so the cache keeps no
view of a storage over ``MAX_ENTRY_BYTES``, at most ``MAX_VIEWS`` views and ``MAX_HELD_BYTES``
of storage (least recently used out first) and, every ``SWEEP_EVERY`` stagings, drops the views
that alone hold a storage (its use count is the cache's own references).

Batch-1 decode, PCP=1, K=2: ``on_global_batch`` hands 8 tensors (``idx_mapping[:1]``,
``query_start_loc[:2]``, ``positions[:3]`` ...); the first step makes their byte views (24
dispatches), every later step finds them (8 key lookups) and runs one ``cat``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

__all__ = ["PlanCache", "BYTE_DTYPES", "MAX_VIEWS", "MAX_HELD_BYTES", "MAX_ENTRY_BYTES", "SWEEP_EVERY", "fresh_bytes"]

BYTE_DTYPES = {torch.int64: "<i8", torch.int32: "<i4", torch.int16: "<i2", torch.int8: "|i1", torch.uint8: "|u1",
          torch.bool: "|b1", torch.float32: "<f4", torch.float16: "<f2", torch.float64: "<f8",
          torch.bfloat16: "bf16"}
"""The dtypes a hook's tensor can be copied as bytes, and their names in ``pcpviz.trace.packed``."""

MAX_VIEWS = 512
MAX_HELD_BYTES = 16 << 20
MAX_ENTRY_BYTES = 4 << 20
SWEEP_EVERY = 32


def _bytes(t: torch.Tensor) -> tuple[torch.Tensor, tuple, bool]:
    """``t`` as ``uint8[numel * itemsize]``, its meta ``(dtype name, shape, nbytes)`` and whether
    the bytes are a view of ``t``'s memory (not a copy)."""
    # A 1-D contiguous tensor is its own flat view: ``reshape`` is skipped (on one H200's host a
    # ``reshape`` of a CUDA tensor costs ~6 us, as much as the ``cat`` that copies it; tools/gpu/op_costs.py).
    b = t if t.dim() == 1 else t.reshape(-1)
    view = b.is_contiguous()
    if not view:  # a strided column or an expanded view: reshape kept its strides
        b = b.contiguous()
    if b.dtype is not torch.uint8:
        b = b.view(torch.uint8)
    meta = (BYTE_DTYPES[t.dtype], tuple(t.shape), b.shape[0])
    return b, meta, view and b.data_ptr() == t.data_ptr() if t.numel() else view


def fresh_bytes(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """``t`` as bytes and its meta, nothing kept (a tensor the hook computed this step)."""
    return _bytes(t)[:2]


def _use_count(t: torch.Tensor) -> int | None:
    """How many tensors hold ``t``'s storage (None where this torch cannot say)."""
    try:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1  # less the temporary storage object
    except Exception:  # noqa: BLE001 - a private API: without it the cache is bounded by its limits only
        return None


class PlanCache:
    """Byte views by tensor signature, least recently used first out past ``max_views`` or
    ``max_bytes`` of storage held (a storage larger than ``max_entry_bytes`` is never held)."""

    def __init__(self, max_views: int = MAX_VIEWS, *, max_bytes: int = MAX_HELD_BYTES,
                 max_entry_bytes: int = MAX_ENTRY_BYTES) -> None:
        self.max_views, self.max_bytes, self.max_entry_bytes = max_views, max_bytes, max_entry_bytes
        self.views: OrderedDict[tuple, tuple[torch.Tensor, tuple, int]] = OrderedDict()  # sig -> (bytes, meta, held)
        self.held = 0  # storage bytes the kept views hold
        self.hits = self.misses = self.swept = 0
        self._stagings = 0

    def bytes_of(self, t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """``t`` as ``uint8[nbytes]`` (a kept view when ``t`` reads memory seen before) and its
        meta ``(dtype name, shape, nbytes)``."""
        sig = (t.data_ptr(), t.dtype, t.shape, t.stride())
        kept = self.views.get(sig)
        if kept is not None:
            self.hits += 1
            self.views.move_to_end(sig)
            return kept[0], kept[1]
        self.misses += 1
        b, meta, is_view = _bytes(t)
        if is_view:
            held = t.untyped_storage().nbytes()
            if held <= self.max_entry_bytes:
                self.views[sig] = (b, meta, held)
                self.held += held
                while len(self.views) > self.max_views or self.held > self.max_bytes:
                    self.held -= self.views.popitem(last=False)[1][2]
        return b, meta

    def peek(self, sig: tuple) -> tuple[torch.Tensor, tuple] | None:
        """The kept byte view and meta of the tensor signature ``sig`` (``(data_ptr, dtype, shape,
        strides)``), None if none is kept; nothing is added on a miss."""
        kept = self.views.get(sig)
        if kept is None:
            return None
        self.hits += 1
        return kept[0], kept[1]

    def staged(self) -> None:
        """A step was staged: every ``SWEEP_EVERY`` stagings, drop the views that alone hold a storage."""
        self._stagings += 1
        if self._stagings % SWEEP_EVERY == 0:
            self.sweep()

    def sweep(self) -> int:
        """Drop every kept view of a storage nothing else holds; how many were dropped."""
        ours: dict[int, int] = {}
        for b, _, _ in self.views.values():
            key = b.untyped_storage().data_ptr()
            ours[key] = ours.get(key, 0) + 1
        dead = []
        for sig, (b, _, _) in self.views.items():
            n = _use_count(b)
            if n is not None and n <= ours[b.untyped_storage().data_ptr()]:
                dead.append(sig)
        for sig in dead:
            self.held -= self.views.pop(sig)[2]
        self.swept += len(dead)
        return len(dead)

    def stats(self) -> dict[str, Any]:
        return {"views": len(self.views), "held_bytes": self.held, "hits": self.hits, "misses": self.misses,
                "swept": self.swept}
