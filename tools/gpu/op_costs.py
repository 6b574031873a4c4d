"""What one host-side operation of the recorder's hooks costs on this machine: microseconds on the
calling thread (median of ``--repeats`` timings of ``--calls`` calls each), on the GPU and on the CPU.

    python3 tools/gpu/op_costs.py --out $OUT/op_costs.json

The recorder's hooks (``pcpviz.vllm.recording``) are a few dozen tensor operations and Python
around them; on the GPU host a step's hooks cost about three times what the CPU stand-in
(``benchmarks/bench_recorder_host.py``) measures. This table says which operations make the
difference: a kernel launch (``cat``, ``copy_``), a view (``x[:r]``, ``reshape``, ``view``), an
attribute that asks the driver or the allocator (``untyped_storage``), an event, a graph replay.
Needs torch only (no vLLM).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def _time(fn, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean µs per call of ``calls`` calls."""
    out = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter_ns() - t) / calls / 1e3)
    return round(statistics.median(out), 3)


def cases(dev: str) -> dict:
    """name -> a no-argument call."""
    x = torch.arange(1 << 16, dtype=torch.int32, device=dev)
    y = torch.arange(1 << 16, dtype=torch.int64, device=dev)
    ring = torch.empty(1 << 24, dtype=torch.uint8, device=dev)
    small = [x[: 8 * (i + 1)].view(torch.uint8) for i in range(12)]
    four, total4 = small[:4], sum(s.numel() for s in small[:4])
    total12 = sum(s.numel() for s in small)
    out4, out12 = ring[:total4], ring[:total12]
    dst = ring[:32]
    src = y[:4].view(torch.uint8)
    host = np.arange(64, dtype=np.int32)
    ids = [f"req-{i}" for i in range(32)]
    c = {
        "python: empty function call": lambda: None,
        "python: dict get + tuple of 4": lambda: {}.get((1, 2, 3, 4)),
        "slice x[:8]": lambda: x[:8],
        "reshape(-1) of a slice": lambda: x[:8].reshape(-1),
        "view(uint8) of a slice": lambda: x[:8].view(torch.uint8),
        "data_ptr()": lambda: x.data_ptr(),
        "shape + stride()": lambda: (x.shape, x.stride()),
        "is_contiguous()": lambda: x.is_contiguous(),
        "untyped_storage().nbytes()": lambda: x.untyped_storage().nbytes(),
        "get_device()": lambda: x.get_device(),
        "detach()": lambda: x.detach(),
        "copy_ 32 bytes": lambda: dst.copy_(src),
        "cat 4 small, out=": lambda: torch.cat(four, out=out4),
        "cat 12 small, out=": lambda: torch.cat(small, out=out12),
        "torch.empty 64 B": lambda: torch.empty(64, dtype=torch.uint8, device=dev),
        "np.asarray(int32[64], int64)": lambda: np.asarray(host, dtype=np.int64),
        "np.array(int scalar)": lambda: np.array(5, dtype=np.int64),
        "list(req_ids[32])": lambda: list(ids),
        "time.time_ns()": time.time_ns,
    }
    if dev == "cuda":
        c["cuda Event() + record()"] = lambda: torch.cuda.Event().record()
        ev = torch.cuda.Event()
        c["event.record() (reused)"] = lambda: ev.record()
        c["torch.cuda.current_stream()"] = torch.cuda.current_stream
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.cat(small, out=out12)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            torch.cat(small, out=out12)
        c["CUDAGraph.replay() of one cat"] = g.replay
    return c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    devs = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    res = {"command": "python3 tools/gpu/op_costs.py", "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "us_per_call": {}}
    for dev in devs:
        table = {}
        for name, fn in cases(dev).items():
            fn()
            table[name] = _time(fn, a.calls, a.repeats)
        if dev == "cuda":
            torch.cuda.synchronize()
        res["us_per_call"][dev] = table
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
