"""What has been run end to end, and what has not: the honest answer to the review's "no e2e test".

``COVERAGE`` has one row per configuration the review or 0.33.0 raises, with where it ran:
``"GPU"`` (real vLLM on GPUs: the shipped traces, whose ``run.json`` must match ``meta``),
``"CPU"`` (vLLM's own code on CPU: the replay, the oracle; or the pcpviz engine), or
``"not run"`` (then no shipped real-vLLM trace may match ``meta``). A test reads ``data/traces``
to keep both true. ``coverage_markdown()`` renders it for notebook 06.

    >>> [c.key for c in COVERAGE if c.status == "not run"][:2]
    ['dcp', 'dspark']
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pcpviz.trace.meta_model import RunMeta, decode_meta

__all__ = ["Coverage", "COVERAGE", "coverage_markdown", "meta_matches", "vllm_trace_metas"]

_MTP_GPU = (("producer", ("vllm-plugin",)), ("pcp", (2,)), ("speculative_method", ("mtp",)))


@dataclass(frozen=True)
class Coverage:
    key: str
    what: str
    status: str  # "GPU", "CPU", "not run"
    traces: tuple[str, ...] = ()  # data/traces names (GPU rows)
    meta: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # run.json key -> allowed values
    note: str = ""


COVERAGE: tuple[Coverage, ...] = (
    Coverage("mtp-eager", "MTP, tiny model, PCP = 2, K = 1/2/3, eager (2 x H200)", "GPU",
             ("vllm-h200x2-pcp2-mtp1", "vllm-h200x2-pcp2-mtp2", "vllm-h200x2-pcp2-mtp3",
              "vllm-h200x2-pcp2-mtp2-chunked", "vllm-serve-h200x2-pcp2-mtp2"),
             _MTP_GPU + (("cudagraph_mode", ("NONE",)),), "the acceptance of the fixed code, on the tiny model"),
    Coverage("mtp-piecewise", "MTP, PIECEWISE CUDA graphs (2 x H200)", "GPU", ("vllm-h200x2-pcp2-mtp2-piecewise",),
             _MTP_GPU + (("cudagraph_mode", ("PIECEWISE",)),),
             "acceptance collapses: docs/findings/piecewise-draft-prefill.md"),
    Coverage("engine-gpu", "the pcpviz engine at PCP = 2 on GPUs (NCCL)", "GPU", ("h200x2-nccl-pcp2-mtp2",),
             (("producer", ("pcpviz-engine",)), ("pcp", (2,)))),
    Coverage("full-graphs", "FULL_AND_PIECEWISE (vLLM's default), PCP = 1, recorded (1 x H200)", "GPU",
             ("vllm-h200x1-pcp1-mtp2-full",),
             (("producer", ("vllm-plugin",)), ("cudagraph_mode", ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"))),
             "the FULL-replayed draft phases carry their views (fwd_source graph_capture); PCP = 2 under FULL "
             "graphs not run on GPUs: vLLM's dispatch with stand-in graphs on CPU, "
             "docs/findings/full-draft-prefill-state.md"),
    Coverage("dcp", "DCP > 1 (replicated decodes) on GPUs", "not run", (),
             (("producer", ("vllm-plugin",)), ("dcp", (2, 4, 8))),
             "vLLM 0.33.0 allows it for sparse MLA only; the replay forces replicated decodes at DCP = 1"),
    Coverage("dspark", "DSpark on GPUs", "not run", (),
             (("producer", ("vllm-plugin",)), ("speculative_method", ("dspark",))),
             "the CPU replay runs DSparkSpeculator with a stand-in model (scenario dspark)"),
    Coverage("pcp-gt-2", "PCP > 2 with real vLLM", "not run", (),
             (("producer", ("vllm-plugin",)), ("pcp", (3, 4, 8))), "the CPU replay and the engine run PCP = 3 and 4"),
    Coverage("real-model", "a full-size model (DeepSeek-V3 / V3.2)", "not run", (), (),
             "only the tiny model (pcpviz-tiny-dsv3) ran on GPUs"),
    Coverage("moe-sparse-mla", "an MoE model with sparse MLA (GLM-5 / DeepSeek-V3.2 class): the MoE's PCP "
             "all-gather and reduce-scatter, the indexer's fold, share_mtp_topk_indices off", "not run", (), (),
             "every model here is dense (dense MLP, dense MLA, no indexer): read from the source only "
             "(docs/vllm-0.33-pcp-mtp.md); the cost model prices the MoE traffic on request (moe_gather)"),
    Coverage("cpu-vllm", "vLLM's own PCP + MTP / DSpark classes on CPU (layout, gathers, propose, dummy runs, "
             "graph dispatch)", "CPU", (), (), "stand-in models; tests/vllm/"),
)


def meta_matches(meta: RunMeta, spec: tuple[tuple[str, tuple[Any, ...]], ...]) -> bool:
    """Every ``(key, allowed)`` of ``spec`` holds in ``meta`` (what run.json records for ``key``
    is one of ``allowed``; None where it records nothing)."""
    return all(meta.recorded_value(k) in allowed for k, allowed in spec)


def vllm_trace_metas(root: str | Path) -> dict[str, RunMeta]:
    """``{trace name: its run.json, decoded}`` of every trace directory under ``root``."""
    out = {}
    for d in sorted(Path(root).iterdir()) if Path(root).is_dir() else []:
        try:
            doc = json.loads((d / "run.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            out[d.name] = decode_meta(doc)[0]
    return out


def coverage_markdown(rows: tuple[Coverage, ...] = COVERAGE) -> str:
    lines = ["| configuration | where it ran | evidence / note |", "|---|---|---|"]
    for c in rows:
        ev = ", ".join(f"`{t}`" for t in c.traces)
        lines.append(f"| {c.what} | {c.status} | {'; '.join(x for x in (ev, c.note) if x) or '—'} |")
    return "\n".join(lines)
