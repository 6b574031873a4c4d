"""Parity between runs of the same prompts: real vLLM, the engine on GPU, the engine on CPU.

    python -m pcpviz.analysis.parity data/traces/vllm-h200x2-pcp2-mtp2 \\
        engine-gpu-fp32=runs/engine-gpu engine-cpu-fp32=runs/engine-cpu --json parity.json

The first trace is the reference. For each other run, one row per request and one summary:

* **tokens**: what each request generated (the verify phase's ``sampled_token_ids[:num_sampled]``,
  step by step), the index of the first token that differs from the reference, and its cause as far
  as the traces can tell. ``numerics`` means the same context gave a different greedy token: the
  logits were close and the runs differ in dtype or kernels. ``context`` means the contexts
  differed already. ``length`` means one run stopped earlier;
* **acceptance** per draft position (vLLM's definition, ``pcpviz.analysis.diff.acceptance``);
* **views**: ``pcpviz diff`` against the reference, i.e. the first differing (step, phase, view).
  When the two schedulers ran different batches, that is a scheduling view such as ``req_ids`` or
  ``num_scheduled_tokens``.

Requests are matched across runs by their prompts (``pcpviz.analysis.request_keys``), not by id.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from pcpviz.analysis.diff import acceptance, diff_traces
from pcpviz.analysis.request_keys import request_keys
from pcpviz.trace import open as open_trace
from pcpviz.trace.outputs import write_output

__all__ = ["generated_tokens", "RequestParity", "RunParity", "compare", "format_markdown"]


def generated_tokens(trace: Any) -> dict[str, list[int]]:
    """Tokens each request generated, in order, from rank 0's verify records."""
    out: dict[str, list[int]] = {}
    rank = trace.ranks[0]
    for step in trace.rank_steps(rank):
        if not trace.has(step, rank, "verify"):
            continue
        v = trace.record(step, rank, "verify")
        if "req_ids" not in v:
            continue
        sampled = np.atleast_2d(np.asarray(v["sampled_token_ids"], dtype=np.int64))
        ns = np.asarray(v["num_sampled"], dtype=np.int64)
        for i, rid in enumerate(np.asarray(v["req_ids"]).astype(str).tolist()):
            out.setdefault(rid, []).extend(sampled[i, : ns[i]].tolist())
    return out


@dataclass(frozen=True)
class RequestParity:
    request: int  # the request's index in the reference run (order of first appearance)
    num_tokens: tuple[int, int]  # (reference, this run)
    first_divergence: int | None  # index of the first differing generated token
    cause: str  # "identical", "numerics", "context", "length"


@dataclass(frozen=True)
class RunParity:
    name: str
    requests: tuple[RequestParity, ...]
    acceptance_per_position: tuple[float, ...]
    first_view_divergence: str  # pcpviz diff's first divergence ("" when none)
    divergent_views: int

    @property
    def identical_tokens(self) -> int:
        return sum(r.cause == "identical" for r in self.requests)


def _first_divergence(a: list[int], b: list[int], limit: int | None) -> tuple[int | None, str]:
    """Over the first ``limit`` tokens (the run's max_tokens; a run's last step may verify drafts
    past it, which vLLM's output then drops)."""
    a, b = a[:limit], b[:limit]
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i, "numerics"  # generated tokens before i agree: the same context
    if len(a) != len(b):
        return n, "length"
    return None, "identical"


def _max_tokens(trace: Any) -> int | None:
    n = trace.run_meta.max_tokens
    return int(n) if isinstance(n, int) else None


def compare(reference: Any, runs: dict[str, Any]) -> tuple[tuple[float, ...], list[RunParity]]:
    """Acceptance per position of the reference, and one ``RunParity`` per other run."""
    ref = open_trace(reference) if not hasattr(reference, "ranks") else reference
    ref_tokens = generated_tokens(ref)
    ref_keys = request_keys(ref)
    order = list(ref_keys)  # first appearance
    limit = _max_tokens(ref)
    out = []
    for name, t in runs.items():
        t = open_trace(t) if not hasattr(t, "ranks") else t
        toks, keys = generated_tokens(t), request_keys(t)
        by_key = {k: rid for rid, k in keys.items()}
        rows = []
        for i, rid in enumerate(order):
            other = by_key.get(ref_keys[rid])
            a, b = ref_tokens.get(rid, []), toks.get(other, []) if other is not None else []
            idx, cause = _first_divergence(a, b, limit) if other is not None else (0, "context")
            rows.append(RequestParity(i, (len(a), len(b)), idx, cause))
        d = diff_traces(ref, t)
        f = d.first
        first = "" if f is None else f"step {f.step} {f.phase}.{f.view}: {f.message}"
        out.append(RunParity(name, tuple(rows), tuple(acceptance(t).rate_per_position), first, d.num_divergent_views))
    return tuple(acceptance(ref).rate_per_position), out


def format_markdown(ref_name: str, ref_acceptance: tuple[float, ...], runs: list[RunParity]) -> str:
    acc = lambda a: " / ".join(f"{x:.2f}" for x in a)  # noqa: E731
    lines = ["| run | requests with identical tokens | first differing token (request: index) | "
             "acceptance per position | first differing view (pcpviz diff) |", "|---|---|---|---|---|",
             f"| {ref_name} (reference) | - | - | {acc(ref_acceptance)} | - |"]
    for r in runs:
        firsts = ", ".join(f"{q.request}: {q.first_divergence}" for q in r.requests if q.cause != "identical") or "none"
        lines.append(f"| {r.name} | {r.identical_tokens} of {len(r.requests)} | {firsts} | "
                     f"{acc(r.acceptance_per_position)} | {r.first_view_divergence or 'none'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pcpviz.analysis.parity", description=__doc__.split("\n\n")[0])
    ap.add_argument("reference", help="the reference trace (e.g. real vLLM)")
    ap.add_argument("runs", nargs="+", metavar="NAME=TRACE", help="other runs of the same prompts")
    ap.add_argument("--json", default=None, help="also write the comparison as JSON")
    a = ap.parse_args(argv)
    runs = {}
    for spec in a.runs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            ap.error(f"{spec!r}: expected NAME=TRACE")
        runs[name] = path
    try:
        ref_acc, rows = compare(a.reference, runs)
    except (OSError, ValueError) as exc:
        print(f"pcpviz parity: {exc}", file=sys.stderr)
        return 2
    print(format_markdown(a.reference, ref_acc, rows))
    if a.json:
        doc = {"reference": a.reference, "reference_acceptance_per_position": ref_acc,
               "runs": [{"name": r.name, "acceptance_per_position": r.acceptance_per_position,
                         "first_view_divergence": r.first_view_divergence, "divergent_views": r.divergent_views,
                         "requests": [q.__dict__ for q in r.requests]} for r in rows]}
        write_output(a.json, json.dumps(doc, indent=1), option="--json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
