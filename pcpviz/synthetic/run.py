"""``SyntheticRun``: a generated run held in memory, mutable, written as a trace on demand.

    run = generate([RequestSpec("a", 40, 6)], pcp=2, num_speculative_tokens=2)
    run.views(2, 1, "draft_1")["draft_positions"] += 1    # a targeted corruption
    run.write(tmp / "trace")                              # run.json + rank<r>.arrow
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from pcpviz.trace import TraceWriter
from pcpviz.trace.meta_model import RunMeta

__all__ = ["SyntheticRun"]


@dataclass
class SyntheticRun:
    """A generated run held in memory: ``meta`` (run.json) and, per step, per rank,
    ``{phase: {view: array}}``. Mutate views to build faulty traces, then ``write``."""

    meta: RunMeta  # run.json, encoded from the type (``RunMeta.build``)
    steps: list[tuple[int, list[dict[str, dict[str, np.ndarray]]]]]
    outputs: dict[str, list[int]]

    @property
    def step_ids(self) -> list[int]:
        return [s for s, _ in self.steps]

    @property
    def pcp(self) -> int:
        return int(self.meta.pcp)

    def views(self, step: int, rank: int, phase: str) -> dict[str, np.ndarray]:
        """The mutable views of one phase (KeyError if absent)."""
        for s, per_rank in self.steps:
            if s == step:
                return per_rank[rank][phase]
        raise KeyError(f"no step {step}")

    def phases(self, step: int, rank: int) -> dict[str, dict[str, np.ndarray]]:
        for s, per_rank in self.steps:
            if s == step:
                return per_rank[rank]
        raise KeyError(f"no step {step}")

    def write(self, run_dir: str | os.PathLike, *, ranks: Iterable[int] | None = None) -> Path:
        """Write a run directory (run.json + rank<r>.arrow) and return its path."""
        run_dir = Path(run_dir)
        ranks = range(self.pcp) if ranks is None else list(ranks)
        for i, rank in enumerate(ranks):
            with TraceWriter(run_dir, rank, meta=self.meta if i == 0 else None) as w:
                for step, per_rank in self.steps:
                    phases = {p: v for p, v in per_rank[rank].items() if v}
                    if phases:
                        w.write_step(step, phases)
        return run_dir
