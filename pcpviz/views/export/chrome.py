"""Chrome trace (Trace Event Format) export, for Perfetto and Holistic Trace Analysis.

``pcpviz export TRACE --chrome OUT``:

* ``OUT`` ending in ``.json``: one merged file, every rank a process (``pid`` = rank);
* otherwise ``OUT`` is a directory that receives ``rank<r>.json`` per rank, each with a
  top-level ``distributedInfo: {"rank": r, "world_size": N}`` so HTA's
  ``TraceAnalysis(trace_dir=OUT)`` can load it (HTA reads *every* ``.json`` file of the
  directory, so nothing else is written there).

Events: one complete event (``ph: "X"``) per (step, rank, phase), named ``step 3 target``,
``step 3 draft_1``, ..., in a lane (``tid``) per phase — ``step`` (the whole step),
``target``, ``verify``, ``draft_0`` .. ``draft_{K-1}`` — with token counts in ``args``, and
a ``C`` counter of accepted draft tokens per step. Timestamps are the producer's recorded
``t_start_us``/``t_end_us`` 0-d views when every phase has them; otherwise a synthetic
sequential timeline (``SYNTHETIC_PHASE_US`` per phase, steps back to back, ranks aligned),
which ``otherData.pcpviz.timestamps`` says.

Layout of one rank's lanes (synthetic timestamps, K=2)::

    tid 0 step      [------------- step 0 ---------------][------------- step 1 ...
    tid 1 target    [target]                             [target]
    tid 2 verify            [verify]                             [verify]
    tid 3 draft_0                   [draft_0]                            ...
    tid 4 draft_1                            [draft_1]

Phases are in causal order (target, verify, then the drafter's propose: draft_0 ..
draft_{K-1}), as vLLM's ``sample_tokens`` runs them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from pcpviz.trace.schema import causal_phase_key
from pcpviz.views.export.atomic import atomic_output
from pcpviz.trace import Trace, TraceError, draft_index
from pcpviz.trace import open as open_trace

__all__ = ["chrome_trace", "export_chrome", "SYNTHETIC_PHASE_US", "EVENT_CATEGORY"]

SYNTHETIC_PHASE_US = 100
"""Duration of each phase on the synthetic timeline (µs)."""
EVENT_CATEGORY = "pcpviz"
"""``cat`` of every phase event."""
_STEP_GAP_US = 20


def _lane_order(max_k: int, has_dummy: bool) -> list[str]:
    lanes = ["step"] + (["dummy"] if has_dummy else []) + ["target", "verify"]
    lanes += [f"draft_{k}" for k in range(max_k)]
    return lanes


def _num(x: Any) -> int | float:
    v = float(np.asarray(x).reshape(-1)[0])
    return int(v) if v.is_integer() else v


def _len(rec, view) -> int | None:
    return int(np.asarray(rec[view]).shape[0]) if view in rec and np.asarray(rec[view]).ndim else None


def _args(step: int, rank: int, phase: str, rec, target) -> dict[str, Any]:
    """Token counts of one phase, for the event's ``args``."""
    args: dict[str, Any] = {"step": step, "rank": rank, "phase": phase}
    if phase == "target":
        r = _len(rec, "num_scheduled_tokens") or _len(rec, "req_ids")
        if r is not None:
            args["num_reqs"] = r
        if "num_scheduled_tokens" in rec:
            args["global_tokens"] = int(np.asarray(rec["num_scheduled_tokens"]).sum())
        if "per_rank_num_tokens" in rec and rank < np.asarray(rec["per_rank_num_tokens"]).shape[0]:
            args["local_tokens"] = int(rec["per_rank_num_tokens"][rank])
        p = _len(rec, "local_positions") or _len(rec, "local_input_ids")
        if p is not None:
            args["padded_tokens"] = p
        if "local_seq_lens" in rec:
            args["local_segments"] = _len(rec, "local_seq_lens")
        if "is_prefilling" in rec:
            pf = np.asarray(rec["is_prefilling"]).astype(bool)
            args["prefill_reqs"], args["decode_reqs"] = int(pf.sum()), int((~pf).sum())
    elif draft_index(phase) is not None:
        if "view" in rec:
            args["view"] = str(np.asarray(rec["view"]).reshape(-1)[0])
        rows = _len(rec, "draft_input_ids") or _len(rec, "draft_positions")
        if rows is not None:
            args["rows"] = rows
        if draft_index(phase) == 0 and target is not None and "per_rank_num_tokens" in target:
            prn = np.asarray(target["per_rank_num_tokens"])
            if rank < prn.shape[0]:
                args["local_tokens"] = int(prn[rank])
        r = _len(rec, "draft_tokens")
        if r is not None:
            args["num_reqs"] = r
    elif phase == "verify":
        r = _len(rec, "num_sampled") or _len(rec, "req_ids")
        if r is not None:
            args["num_reqs"] = r
        if "num_draft_tokens" in rec:
            nd = np.asarray(rec["num_draft_tokens"], dtype=np.int64)
            args["num_drafts"], args["num_draft_tokens"] = int((nd > 0).sum()), int(nd.sum())
        if "num_accepted" in rec:
            args["num_accepted_tokens"] = int(np.asarray(rec["num_accepted"], dtype=np.int64).sum())
        if "num_sampled" in rec:
            args["num_sampled_tokens"] = int(np.asarray(rec["num_sampled"], dtype=np.int64).sum())
    return args


def _times(rec) -> tuple[float, float] | None:
    """(t_start_us, t_end_us) of a record, or None when not recorded, not numbers or not finite."""
    if "t_start_us" not in rec or "t_end_us" not in rec:
        return None
    try:
        t = (_num(rec["t_start_us"]), _num(rec["t_end_us"]))
    except (IndexError, ValueError, TypeError):  # empty, or not a number
        return None
    return t if all(np.isfinite(t)) else None


def _args_or_note(step: int, rank: int, phase: str, rec, target) -> dict[str, Any]:
    """``_args``; for a record whose views are malformed (wrong shape or dtype: a producer's bug
    the checks report), the step and rank with a note instead of a traceback."""
    try:
        return _args(step, rank, phase, rec, target)
    except TraceError:
        raise
    except (IndexError, ValueError, TypeError, KeyError) as exc:
        return {"step": step, "rank": rank, "malformed": f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"}


def _collect(trace: Trace) -> tuple[list[dict], bool, int, bool]:
    """One entry per (rank, step, phase) with recorded times (or None) and args."""
    items = []
    recorded = True
    max_k = 0
    has_dummy = False
    for rank in trace.ranks:
        for step in trace.rank_steps(rank):
            phases = sorted(trace.phases(step, rank), key=causal_phase_key)
            target = trace.record(step, rank, "target") if "target" in phases else None
            for phase in phases:
                rec = trace.record(step, rank, phase)
                k = draft_index(phase)
                if k is not None:
                    max_k = max(max_k, k + 1)
                has_dummy |= phase == "dummy"
                t = _times(rec)
                recorded &= t is not None
                items.append({"rank": rank, "step": step, "phase": phase, "t": t,
                              "args": _args_or_note(step, rank, phase, rec, target)})
    return items, recorded and bool(items), max_k, has_dummy


def chrome_trace(trace: Trace | str | os.PathLike, *, rank: int | None = None) -> dict[str, Any]:
    """The Chrome trace of every rank (merged), or of one ``rank`` with its ``distributedInfo``."""
    trace = trace if isinstance(trace, Trace) else open_trace(trace)
    return _build(trace, *_collect(trace), only=rank)


def _synthetic_times(items: list[dict]) -> None:
    """Give every item ``t``: steps back to back, phases sequential, ranks aligned (a trace
    without recorded timestamps)."""
    counts: dict[tuple[int, int], int] = {}
    for it in items:
        counts[(it["step"], it["rank"])] = counts.get((it["step"], it["rank"]), 0) + 1
    per_step: dict[int, int] = {}
    for (s, _), c in counts.items():
        per_step[s] = max(per_step.get(s, 0), c)
    steps = sorted(per_step)
    start, t = {}, 0
    for s in steps:
        start[s] = t
        t += per_step[s] * SYNTHETIC_PHASE_US + _STEP_GAP_US
    counters: dict[tuple[int, int], int] = {}
    for it in items:
        key = (it["rank"], it["step"])
        i = counters.get(key, 0)
        counters[key] = i + 1
        t0 = start[it["step"]] + i * SYNTHETIC_PHASE_US
        it["t"] = (t0, t0 + SYNTHETIC_PHASE_US)


def _metadata_events(ranks: list[int], tid: dict[str, int]) -> list[dict[str, Any]]:
    """Process (rank) and thread (lane) names and sort order."""
    events: list[dict[str, Any]] = []
    for r in ranks:
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "ts": 0,
                       "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "ts": 0,
                       "args": {"sort_index": r}})
        for name, i in tid.items():
            events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": i, "ts": 0,
                           "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": i, "ts": 0,
                           "args": {"sort_index": i}})
    return events


def _phase_events(items: list[dict], ranks: list[int], tid: dict[str, int], num_lanes: int) -> list[dict[str, Any]]:
    """One span per phase, one per step (the phases' extent, with the step's counts) and the
    accepted-draft counter at each verify."""
    events: list[dict[str, Any]] = []
    spans: dict[tuple[int, int], list] = {}
    for it in items:
        if it["rank"] not in ranks:
            continue
        t0, t1 = it["t"]
        dur = max(t1 - t0, 0)
        events.append({"ph": "X", "cat": EVENT_CATEGORY, "name": f"step {it['step']} {it['phase']}",
                       "pid": it["rank"], "tid": tid.get(it["phase"], num_lanes), "ts": t0, "dur": dur,
                       "args": it["args"]})
        span = spans.setdefault((it["rank"], it["step"]), [t0, t0 + dur, {}])
        span[0], span[1] = min(span[0], t0), max(span[1], t0 + dur)
        a = it["args"]
        if it["phase"] == "target":
            span[2].update({k: a[k] for k in ("num_reqs", "global_tokens", "local_tokens", "padded_tokens")
                            if k in a})
        if it["phase"] == "verify":
            span[2].update({k: a[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
                            if k in a})
            if "num_accepted_tokens" in a:
                events.append({"ph": "C", "name": "accepted draft tokens", "pid": it["rank"],
                               "tid": tid["verify"], "ts": t0 + dur,
                               "args": {"accepted": a["num_accepted_tokens"],
                                        "drafted": a.get("num_draft_tokens", 0)}})
    for (r, step), (t0, t1, extra) in sorted(spans.items()):
        events.append({"ph": "X", "cat": EVENT_CATEGORY, "name": f"step {step}", "pid": r,
                       "tid": tid["step"], "ts": t0, "dur": t1 - t0, "args": {"step": step, **extra}})
    return events


def _build(trace: Trace, items: list[dict], recorded: bool, max_k: int, has_dummy: bool,
           only: int | None) -> dict[str, Any]:
    lanes = _lane_order(max_k, has_dummy)
    tid = {name: i for i, name in enumerate(lanes)}
    world = trace.meta.get("pcp")
    world = int(world) if isinstance(world, int) and not isinstance(world, bool) else len(trace.ranks)
    ranks = trace.ranks if only is None else [only]
    if only is not None and only not in trace.ranks:
        raise ValueError(f"no rank {only} in {trace.path} (ranks: {trace.ranks})")
    if not recorded:
        _synthetic_times(items)
    events = _metadata_events(ranks, tid) + _phase_events(items, ranks, tid, len(lanes))
    meta = trace.meta
    # Key order matters: HTA reads the metadata (distributedInfo) only up to "traceEvents".
    doc: dict[str, Any] = {"schemaVersion": 1}
    if only is not None:
        info: dict[str, Any] = {"rank": int(only), "world_size": world}
        if isinstance(meta.get("backend"), str):
            info["backend"] = meta["backend"]
        doc["distributedInfo"] = info
    doc.update({
        "displayTimeUnit": "ms",
        "otherData": {"pcpviz": {
            "source": str(trace.path),
            "producer": meta.get("producer"),
            "pcp": meta.get("pcp"),
            "num_speculative_tokens": meta.get("num_speculative_tokens"),
            "ranks": list(ranks),
            "timestamps": "recorded" if recorded else "synthetic",
            "timestamps_note": ("t_start_us/t_end_us recorded by the producer" if recorded else
                                f"synthetic: the trace has no t_start_us/t_end_us on every phase; "
                                f"phases are laid out sequentially, {SYNTHETIC_PHASE_US} us each, "
                                "ranks aligned per step; durations are not measured"),
            "lanes": lanes,
        }},
        "traceEvents": events,
    })
    return doc


def export_chrome(trace: Trace | str | os.PathLike, out: str | os.PathLike, *,
                  merged: bool | None = None) -> list[Path]:
    """Write the Chrome trace; returns the files written.

    ``merged`` defaults to ``str(out).endswith(".json")``: one file with every rank.
    Otherwise ``out`` is a directory (created) that receives ``rank<r>.json`` per rank.
    """
    trace = trace if isinstance(trace, Trace) else open_trace(trace)
    out = Path(out)
    if merged is None:
        merged = out.suffix.lower() == ".json" and not out.is_dir()
    collected = _collect(trace)
    written = []
    if merged:
        if out.parent and not out.parent.exists():
            out.parent.mkdir(parents=True)
        _dump(_build(trace, *collected, only=None), out)
        written.append(out)
    else:
        if out.exists() and not out.is_dir():
            raise ValueError(f"{out}: exists and is not a directory (use a .json name for one merged file)")
        out.mkdir(parents=True, exist_ok=True)
        for rank in trace.ranks:
            path = out / f"rank{rank}.json"
            _dump(_build(trace, *collected, only=rank), path)
            written.append(path)
    return written


def _dump(doc: dict[str, Any], path: Path) -> None:
    with atomic_output(path) as fh:
        # Default separators on purpose: HTA finds a file's rank with the regex '"rank":\s+(\d+)'
        # (a space after the colon), reading line by line, so distributedInfo comes first.
        json.dump(doc, fh, allow_nan=False)
