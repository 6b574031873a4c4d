"""Deterministic per-step counts of the recorder's work on the step thread: the stand-in step of
``bench_recorder_host.py`` with no vLLM work (batch 1 and 32, PCP=1 and rank 0 of PCP=2), recording on,
20 steps counted after 5 warm ones: aten
ops dispatched on the step thread (``TorchDispatchMode``, thread-local: the writer's are not counted)
and Python calls into pcpviz (``sys.setprofile``). Unlike wall time, robust to a loaded machine.

    PYTHONPATH=TREE python benchmarks/count_recorder_ops.py      # TREE: the checkout whose recorder is counted
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import pathlib
import sys
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.c: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.c[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def main() -> int:
    root = os.environ.get("PYTHONPATH", str(pathlib.Path(__file__).resolve().parents[1])).split(os.pathsep)[0]
    spec = importlib.util.spec_from_file_location("bench_recorder_host", root + "/benchmarks/bench_recorder_host.py")
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    from pcpviz.vllm import cpu_patches

    cpu_patches.apply_cpu_patches()
    from pcpviz.vllm import recording

    out = {}
    for r, pcp in ((1, 1), (32, 1), (1, 2), (32, 2)):
        st = b.Stage(r, 256, pcp)
        s = recording.TraceSession(pathlib.Path(tempfile.mkdtemp()) / "t", producer="bench", meta={"pcp": pcp},
                                   strict=False)
        rec = s.recorder_for_rank(0, pcp)
        x = torch.zeros(8)
        for _ in range(5):
            x = b.step(rec, st, x, 0, on=True)
        rec.sink.drain()
        calls = [0]

        def prof(frame, event, arg, calls=calls):
            if event == "call" and "pcpviz" in frame.f_code.co_filename:
                calls[0] += 1

        n = 20
        with Count() as cm:
            sys.setprofile(prof)
            for _ in range(n):
                x = b.step(rec, st, x, 0, on=True)
            sys.setprofile(None)
        rec.sink.drain()
        s.close()
        out[f"batch{r}" + (f"_pcp{pcp}" if pcp > 1 else "")] = {"aten_ops_per_step": round(sum(cm.c.values()) / n, 1),
                            "pcpviz_python_calls_per_step": round(calls[0] / n, 1),
                            "top_ops": {k: round(v / n, 1) for k, v in cm.c.most_common(8)}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
