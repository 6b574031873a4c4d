"""The traces under a directory, one summary row each (notebooks 00 and 05, ``data/traces``).

    from pcpviz.analysis.catalog import catalog, catalog_markdown
    rows = catalog("data/traces")      # [{"name": "vllm-h200x2-pcp2-mtp2", "producer": "vllm-plugin", ...}]
    print(catalog_markdown(rows))

A row: ``name``, ``producer`` (``vllm-plugin`` real vLLM, ``vllm-replay`` vLLM's classes on CPU,
``pcpviz-engine``), ``gpus``, ``pcp``, ``k``, ``cudagraph_mode``, ``steps``, ``acceptance`` per
draft position computed from the trace, ``vllm_acceptance`` (vLLM's own counter, when the
recording stored it) and ``status`` (``ok``, or the first problem ``pcpviz check`` would report
before running the checks: an unreadable directory, an incomplete trace).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pcpviz.analysis.diff import acceptance
from pcpviz.trace import open as open_trace
from pcpviz.trace.acceptance import vllm_acceptance_metric

__all__ = ["catalog", "catalog_markdown"]


def _row(path: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"name": path.name}
    try:
        trace = open_trace(path)
    except (OSError, ValueError) as exc:
        return {**row, "status": " ".join(str(exc).split())}
    meta = trace.run_meta
    acc = acceptance(trace)
    metric = vllm_acceptance_metric(meta.to_json())  # wherever in the document a recording stored it
    drafts = (meta.vllm_spec_decode_metrics or {}).get("num_drafts")
    row.update(producer=meta.recorded_value("producer"), gpus=len(meta.gpus) or meta.device or "cpu",
               pcp=meta.pcp, k=meta.num_speculative_tokens,
               cudagraph_mode=meta.cudagraph_mode or "-", steps=len(trace.steps),
               acceptance=[round(x, 2) for x in acc.rate_per_position],
               vllm_acceptance=[round(a / drafts, 2) for a in metric] if metric and drafts else None,
               status="ok")
    return row


def catalog(root: str | os.PathLike) -> list[dict[str, Any]]:
    """One row per trace directory under ``root`` (those holding a run.json), by name."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory")
    return [_row(p) for p in sorted(root.iterdir()) if (p / "run.json").is_file()]


def catalog_markdown(rows: list[dict[str, Any]]) -> str:
    cols = ("name", "producer", "gpus", "pcp", "k", "cudagraph_mode", "steps", "acceptance", "vllm_acceptance",
            "status")
    fmt = lambda v: "-" if v is None else (" / ".join(map(str, v)) if isinstance(v, list) else str(v))  # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows])
