"""A torch.profiler profile of one rank's engine loop (``pcpviz.run(..., profile_dir=DIR)``).

Every step after the first is profiled (the first carries the one-time costs: Triton JIT,
allocator growth, library handles). The engine's phases (``pcpviz.engine.phase_timer``) appear as
labelled ranges ``phase:<name>``, so the operator table and the timeline line up with
``RunResult.phases``. Written when the loop ends, per rank ``r``::

    DIR/profile_rank<r>.txt    operators by device time (CPU time on a CPU run), top 60
    DIR/profile_rank<r>.json   Chrome trace: open it in https://ui.perfetto.dev

A run with one step leaves a table that says so and no trace.
"""

from __future__ import annotations

import os

__all__ = ["StepProfiler"]


class StepProfiler:
    """``before_step(i)`` at the top of every step; ``close()`` once the loop is over."""

    def __init__(self, out_dir: str, rank: int, device_type: str) -> None:
        self.out_dir = out_dir
        self.rank = rank
        self.device_type = device_type
        self._prof = None
        self._steps = 0

    def before_step(self, index: int) -> None:
        if index == 1 and self._prof is None:  # from the second step on
            import torch.profiler as tp

            acts = [tp.ProfilerActivity.CPU]
            if self.device_type == "cuda":
                acts.append(tp.ProfilerActivity.CUDA)
            self._prof = tp.profile(activities=acts, record_shapes=True)
            self._prof.__enter__()
        if self._prof is not None:
            self._steps += 1

    def close(self) -> None:
        """Stop profiling and write the table and the trace (nothing raised: a profile is a
        by-product, a failure to write it is one line on stderr)."""
        import sys

        path = os.path.join(self.out_dir, f"profile_rank{self.rank}")
        try:
            if self._prof is None:
                with open(path + ".txt", "w") as f:
                    f.write("one step only: nothing profiled (the first step is left out)\n")
                return
            self._prof.__exit__(None, None, None)
            key = "device_time_total" if self.device_type == "cuda" else "cpu_time_total"
            table = self._prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=70)
            with open(path + ".txt", "w") as f:
                f.write(f"rank {self.rank}: {self._steps} steps profiled (the first step left out), "
                        f"sorted by {key}\n{table}\n")
            self._prof.export_chrome_trace(path + ".json")
        except Exception as exc:  # noqa: BLE001 - see the docstring
            print(f"pcpviz: rank {self.rank}: profile not written to {path}.*: {' '.join(str(exc).split())}",
                  file=sys.stderr, flush=True)
        finally:
            self._prof = None
