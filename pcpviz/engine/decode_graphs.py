"""Decode steps replayed from CUDA graphs: buckets, padding, static buffers, capture.

vLLM captures FULL decode graphs per padded batch size; the engine does the same for its
decode steps (no prefill row). A step is *eligible* when every row is a decode of at most
``1 + K`` tokens and no fault is active. It is then padded to a ``DecodeShape``:

* ``num_reqs`` B, the smallest capture size >= R (1, 2, 4, 8, ... up to ``max_num_seqs``);
* ``local_reqs`` the rank-local rows (``ceil(B / N)``: vLLM gives each decode one owner rank),
  ``local_tokens`` P = ``local_reqs * (1 + K)`` (the layout's ``padded_num_tokens``);
* ``tokens`` the global rows sampled, ``B * (1 + K)``;
* ``max_seq_len`` L, the attention kernels' context bound: the next power of two >= the
  step's longest context + K (at least 256), so one graph serves many steps.

PCP=2, K=2, R=3 decodes at contexts 40, 41, 300::

    B = 4, local_reqs = 2, P = 6, tokens = 12, L = 512
    rank 0 rows: decodes 0 and 2 (6 tokens), rank 1: decode 1 (3 tokens) + 3 padding tokens
    padding rows: seq_len 0 (attention writes zeros), slot PAD (-1: no KV write), index 0

Every forward of an eligible step reads only ``StaticInputs`` views and writes only its
outputs, so the same code runs three ways (``GraphRunner.mode``):

* ``"capture"`` (CUDA): captured once per (phase, shape) into a ``torch.cuda.CUDAGraph``, then
  replayed; the PCP all-gathers (NCCL) are captured inside;
* ``"eager"``: the same padded buffers, executed directly (CPU tests; a GPU A/B reference);
* no runner (graphs off): today's unpadded eager path.

Tokens are the same in all three in float32 (tests/engine/test_engine_perf.py on CPU; on 2 x H200 at
PCP=1 with K=0 and K=2). In bfloat16 on one H200 they were not (graphs on vs off): the padded shapes
run other GEMM kernels, and greedy decoding follows the last-bit differences. By default the runner
is on for CUDA at PCP=1 only (``worker.graphs_by_default``):
the one PCP=2 run with captured graphs produced every token and then never returned.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext as _null
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from pcpviz.engine.inputs import aligned

__all__ = ["DecodeShape", "decode_shape", "capture_sizes", "StaticInputs", "GraphRunner", "eagerly"]

MIN_SEQ_BUCKET = 256


@dataclass(frozen=True)
class DecodeShape:
    num_reqs: int  # B: padded global requests
    local_reqs: int  # padded rank-local rows
    local_tokens: int  # P: padded rank-local tokens (the layout's padded_num_tokens)
    tokens: int  # padded global tokens sampled: B * (1 + K)
    max_seq_len: int  # L: the attention kernels' context bound for every forward of the step
    k: int


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes graphs are captured for: powers of two below ``max_num_seqs``, and it.

    >>> capture_sizes(12)
    (1, 2, 4, 8, 12)
    """
    sizes = [1 << i for i in range(max(max_num_seqs, 1).bit_length()) if 1 << i < max_num_seqs]
    return tuple(sizes) + (max_num_seqs,)


def decode_shape(num_scheduled_tokens: np.ndarray, is_prefilling: np.ndarray, max_seq_len: int, *,
                 pcp: int, k: int, max_num_seqs: int, shard_decode_requests: bool) -> DecodeShape | None:
    """The padded shape of an eligible step, None when the step is not a decode step
    (a prefill row, a row of more than ``1 + K`` tokens, or no row)."""
    q = np.asarray(num_scheduled_tokens)
    r = q.shape[0]
    if r == 0 or bool(np.any(is_prefilling)) or int(q.max()) > 1 + k or r > max_num_seqs:
        return None
    b = next(s for s in capture_sizes(max_num_seqs) if s >= r)
    local = -(-b // pcp) if shard_decode_requests and pcp > 1 else b
    need = max(int(max_seq_len) + k, MIN_SEQ_BUCKET)
    return DecodeShape(num_reqs=b, local_reqs=local, local_tokens=local * (1 + k), tokens=b * (1 + k),
                       max_seq_len=1 << (need - 1).bit_length(), k=k)


def pad(a: np.ndarray, n: int, fill: int = 0) -> np.ndarray:
    """``a`` padded along axis 0 to ``n`` rows with ``fill`` (int64[n, ...])."""
    a = np.asarray(a)
    out = np.full((n,) + a.shape[1:], fill, dtype=np.int64)
    out[: a.shape[0]] = a
    return out


class StaticInputs:
    """Persistent device tensors of fixed shapes (a graph's inputs), packed in one buffer per
    dtype, and a pinned staging copy of them; ``fill`` writes new values with one non-blocking
    copy per dtype. The views never move, so a captured graph reads whatever ``fill`` wrote."""

    def __init__(self, spec: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        sizes: dict[torch.dtype, int] = {}
        where = {}
        for name, (shape, dt) in spec.items():
            n = int(np.prod(shape, dtype=np.int64))
            where[name] = (dt, sizes.get(dt, 0), n, tuple(shape))
            sizes[dt] = sizes.get(dt, 0) + aligned(n)  # every view 16-element aligned (inputs.INPUT_ALIGN)
        self._dev = {dt: torch.zeros(n, dtype=dt, device=device) for dt, n in sizes.items()}
        self._host = {dt: torch.zeros(n, dtype=dt, pin_memory=self.cuda) for dt, n in sizes.items()}
        self._host_np = {dt: t.numpy() for dt, t in self._host.items()}
        self._where = where
        self.views = {name: self._dev[dt][off: off + n].view(shape) for name, (dt, off, n, shape) in where.items()}
        self._event = None

    def fill(self, arrays: dict[str, np.ndarray]) -> None:
        if self._event is not None:
            self._event.synchronize()  # the staging copy of the previous fill has left
        for name, a in arrays.items():
            dt, off, n, shape = self._where[name]
            if tuple(np.shape(a)) != shape:
                raise ValueError(f"static input {name}: shape {np.shape(a)}, captured {shape}")
            self._host_np[dt][off: off + n] = np.asarray(a).reshape(-1)
        for dt, dev in self._dev.items():
            dev.copy_(self._host[dt], non_blocking=self.cuda)
        if self.cuda:
            self._event = torch.cuda.Event()
            self._event.record()


def eagerly(graphs: GraphRunner | None, key) -> bool:
    """``Worker.run_forward(key, fn)`` runs ``fn``'s Python: no graph replay (whose collectives,
    for one, no Python sees)."""
    return graphs is None or key[1] is None or graphs.mode == "eager" or key in graphs.failed


class GraphRunner:
    """Static buffers and graphs per key (``(phase, DecodeShape)``)."""

    def __init__(self, mode: str, device: torch.device) -> None:
        if mode not in ("eager", "capture"):
            raise ValueError(f"graph mode must be 'eager' or 'capture', got {mode!r}")
        if mode == "capture" and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.mode = mode
        self.device = device
        self._inputs: dict[object, StaticInputs] = {}
        self._graphs: dict[object, tuple[object, object]] = {}
        self._pool = None
        self.timer = None  # a PhaseTimer: suspended while capturing, the capture timed as "capture"
        self.num_captures = 0
        self.num_replays = 0
        self.failed: dict[object, str] = {}  # key -> why its capture failed (then run directly)
        self.capture_s = 0.0  # wall time spent capturing (warm-up runs included)

    def inputs(self, key, spec: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> StaticInputs:
        s = self._inputs.get(key)
        if s is None:
            s = self._inputs[key] = StaticInputs(spec, self.device)
        return s

    def captured(self, key) -> bool:
        return key in self._graphs

    def run(self, key, fn: Callable[[], object]):
        """``fn()``'s outputs: run directly (eager), or replayed from the graph captured for
        ``key`` (captured on first use, after one warm-up run; the warm-up's effects, such as KV
        writes, are those of the replay that follows, so running both is harmless)."""
        if self.mode == "eager" or key in self.failed:
            return fn()
        entry = self._graphs.get(key)
        if entry is None:
            timer = self.timer
            with timer.phase("capture") if timer else _null():
                if timer:
                    timer.suspended = True
                t0 = time.perf_counter()
                try:
                    entry = self._graphs[key] = self._capture(fn)
                except Exception as e:  # noqa: BLE001 - this shape runs padded without a graph
                    line = " ".join(f"{type(e).__name__}: {e}".split())[:300]
                    self.failed[key] = line
                    print(f"pcpviz: CUDA graph capture of {key[0]} failed, running it without a graph "
                          f"({line})", file=sys.stderr, flush=True)
                    torch.cuda.synchronize()
                    return fn()
                finally:
                    self.capture_s += time.perf_counter() - t0
                    if timer:
                        timer.suspended = False
            self.num_captures += 1
        graph, out = entry
        graph.replay()
        self.num_replays += 1
        return out

    def release(self) -> None:
        """Reset every captured graph and drop the static buffers and the memory pool. Call it
        on every rank before the process group is destroyed: a live graph that captured NCCL
        collectives makes ``destroy_process_group`` hang in ``ncclCommDestroy``
        (pytorch/pytorch#115388; TransformerEngine resets its graphs for the same reason)."""
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._inputs.clear()
        self._pool = None

    def _capture(self, fn):  # pragma: no cover - CUDA only
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up: Triton compiles, cuBLAS and NCCL set up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the trace writer's thread may touch CUDA (events) during a capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = fn()
        return graph, out
