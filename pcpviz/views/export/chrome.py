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

import io
import json
import math
import os
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import numpy as np

from pcpviz.analysis.parallel import default_workers, windowed_map
from pcpviz.trace.schema import causal_phase_key
from pcpviz.trace.outputs import atomic_output, check_output
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
    """Length of ``rec[view]`` (None when not recorded or 0-d)."""
    return _length(rec.get(view))


def _length(value: np.ndarray | None) -> int | None:
    if value is None:
        return None
    a = np.asarray(value)
    return int(a.shape[0]) if a.ndim else None


_I64 = 1 << 63
_SMALL = 64
"""Arrays up to this long are counted in Python: cheaper than a NumPy call for a step's dozen values."""


def _small_ints(a: np.ndarray) -> list | None:
    """A short 1-d array of booleans or integers (each exact in int64) as a list; else None."""
    kind = a.dtype.kind
    if a.ndim == 1 and a.shape[0] <= _SMALL and (kind in "bi" or kind == "u" and a.dtype.itemsize < 8):
        return a.tolist()
    return None


def _sum(x: Any, *, as_int64: bool = False) -> int:
    """``int(np.asarray(x).sum())`` (of ``np.asarray(x, dtype=np.int64)`` with ``as_int64``), in
    Python for a short integer array: NumPy's int64 sum wraps around, so it equals the exact sum
    whenever that fits int64; otherwise (and for any other array) NumPy's.

    >>> _sum(np.array([3, 4], dtype=np.int32)), _sum(np.array([True, False, True])), _sum(2.5)
    (7, 2, 2)
    """
    a = np.asarray(x)
    got = _small_ints(a)
    if got is not None:
        total = sum(got)
        if -_I64 <= total < _I64:
            return total
    return int((np.asarray(a, dtype=np.int64) if as_int64 else a).sum())


def _target_args(args: dict[str, Any], rank: int, rec) -> None:
    get = rec.get
    scheduled = get("num_scheduled_tokens")
    r = _length(scheduled) or _len(rec, "req_ids")
    if r is not None:
        args["num_reqs"] = r
    if scheduled is not None:
        args["global_tokens"] = _sum(scheduled)
    prn = get("per_rank_num_tokens")
    if prn is not None and rank < np.asarray(prn).shape[0]:
        args["local_tokens"] = int(prn[rank])
    p = _len(rec, "local_positions") or _len(rec, "local_input_ids")
    if p is not None:
        args["padded_tokens"] = p
    seq_lens = get("local_seq_lens")
    if seq_lens is not None:
        args["local_segments"] = _length(seq_lens)
    prefilling = get("is_prefilling")
    if prefilling is not None:
        a = np.asarray(prefilling)
        flags = _small_ints(a)
        if flags is not None:  # booleans or integers: truthy is non-zero
            args["prefill_reqs"], args["decode_reqs"] = len(flags) - flags.count(0), flags.count(0)
        else:
            pf = a.astype(bool)
            args["prefill_reqs"], args["decode_reqs"] = int(pf.sum()), int((~pf).sum())


def _verify_args(args: dict[str, Any], rec) -> None:
    get = rec.get
    sampled = get("num_sampled")
    r = _length(sampled) or _len(rec, "req_ids")
    if r is not None:
        args["num_reqs"] = r
    drafts = get("num_draft_tokens")
    if drafts is not None:
        nd = np.asarray(drafts)
        small = _small_ints(nd)
        if small is not None:
            args["num_drafts"] = sum(1 for v in small if v > 0)
        else:
            args["num_drafts"] = int((np.asarray(nd, dtype=np.int64) > 0).sum())
        args["num_draft_tokens"] = _sum(nd, as_int64=True)
    accepted = get("num_accepted")
    if accepted is not None:
        args["num_accepted_tokens"] = _sum(accepted, as_int64=True)
    if sampled is not None:
        args["num_sampled_tokens"] = _sum(sampled, as_int64=True)


def _args(step: int, rank: int, phase: str, rec, target) -> dict[str, Any]:
    """Token counts of one phase, for the event's ``args``."""
    args: dict[str, Any] = {"step": step, "rank": rank, "phase": phase}
    k = draft_index(phase)
    if phase == "target":
        _target_args(args, rank, rec)
    elif k is not None:
        view = rec.get("view")
        if view is not None:
            args["view"] = str(np.asarray(view).reshape(-1)[0])
        rows = _len(rec, "draft_input_ids") or _len(rec, "draft_positions")
        if rows is not None:
            args["rows"] = rows
        prn = target.get("per_rank_num_tokens") if k == 0 and target is not None else None
        if prn is not None:
            prn = np.asarray(prn)
            if rank < prn.shape[0]:
                args["local_tokens"] = int(prn[rank])
        r = _len(rec, "draft_tokens")
        if r is not None:
            args["num_reqs"] = r
    elif phase == "verify":
        _verify_args(args, rec)
    collectives = rec.get("collectives")
    if collectives is not None:  # the CPU replay's record of vLLM's calls on the PCP group, in order
        calls = [str(x) for x in np.asarray(collectives).reshape(-1)]
        args["collectives"], args["collective_calls"] = len(calls), calls
    return args


def _times(rec) -> tuple[float, float] | None:
    """(t_start_us, t_end_us) of a record, or None when not recorded, not numbers or not finite."""
    if "t_start_us" not in rec or "t_end_us" not in rec:
        return None
    try:
        t = (_num(rec["t_start_us"]), _num(rec["t_end_us"]))
    except (IndexError, ValueError, TypeError):  # empty, or not a number
        return None
    return t if math.isfinite(t[0]) and math.isfinite(t[1]) else None


def _args_or_note(step: int, rank: int, phase: str, rec, target) -> dict[str, Any]:
    """``_args``; for a record whose views are malformed (wrong shape or dtype: a producer's bug
    the checks report), the step and rank with a note instead of a traceback."""
    try:
        return _args(step, rank, phase, rec, target)
    except TraceError:
        raise
    except (IndexError, ValueError, TypeError, KeyError) as exc:
        return {"step": step, "rank": rank, "malformed": f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"}


class _Unrecorded(Exception):
    """A record without finite ``t_start_us``/``t_end_us``: the export falls back to synthetic."""


@dataclass(frozen=True)
class _Plan:
    """What the events need before any record is decoded (from the index alone)."""

    lanes: tuple[str, ...]
    tid: dict[str, int]
    start: dict[int, int]  # step -> its start on the synthetic timeline (us)


def _plan(trace: Trace) -> _Plan:
    """Lanes (``step``, ``dummy`` when recorded, target, verify, draft_0..) and each step's start
    on the synthetic timeline: steps back to back, each as long as its busiest rank's phases."""
    max_k, has_dummy, per_step, seen = 0, False, {}, set()
    for rank in trace.ranks:
        for step in trace.rank_steps(rank):
            phases = tuple(trace.phases(step, rank))
            if phases not in seen:  # the steps of a trace repeat a few phase lists
                seen.add(phases)
                for phase in phases:
                    k = draft_index(phase)
                    max_k = max(max_k, k + 1) if k is not None else max_k
                    has_dummy |= phase == "dummy"
            n = len(phases)
            if per_step.get(step, -1) < n:
                per_step[step] = n
    start, t = {}, 0
    for s in sorted(per_step):
        start[s] = t
        t += per_step[s] * SYNTHETIC_PHASE_US + _STEP_GAP_US
    lanes = tuple(_lane_order(max_k, has_dummy))
    return _Plan(lanes, {name: i for i, name in enumerate(lanes)}, start)


@functools.lru_cache(maxsize=1024)
def _causal(phases: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(phases, key=causal_phase_key))


_CAT = json.dumps(EVENT_CATEGORY)


@functools.lru_cache(maxsize=4096)
def _str_json(s: str) -> str:
    return json.dumps(s)


def _json(v: Any) -> str:
    """``json.dumps(v, allow_nan=False)``, with no call of the encoder for an int or a finite float
    (the events' times and counts) and a remembered text for a string: the same text, and the
    same ValueError for a float that is not finite.

    >>> _json(3), _json(2.5), _json("a"), _json([1, "b"])
    ('3', '2.5', '"a"', '[1, "b"]')
    """
    t = type(v)
    if t is int:
        return int.__repr__(v)
    if t is float and math.isfinite(v):
        return float.__repr__(v)
    if t is str:
        return _str_json(v)
    return json.dumps(v, allow_nan=False)


def _args_json(args: dict[str, Any]) -> str:
    """``json.dumps(args)`` of an event's ``args`` (``_json`` per value).

    >>> _args_json({"step": 3, "phase": "target", "calls": ["a"]})
    '{"step": 3, "phase": "target", "calls": ["a"]}'
    """
    return "{" + ", ".join([_str_json(k) + (f": {v}" if type(v) is int else ": " + _json(v))
                            for k, v in args.items()]) + "}"


def _span_json(step: int, phase: str | None, rank: int, *, tid: int, t0: Any, dur: Any, args: dict[str, Any]) -> str:
    """A complete event's JSON, as ``json.dumps`` writes its dict: ``{"ph": "X", "cat": "pcpviz",
    "name": "step 3 target", "pid": 0, "tid": 1, "ts": 0, "dur": 100, "args": {...}}``
    (``phase`` None: the step's own span, ``"name": "step 3"``)."""
    name = f"step {step}" if phase is None else f"step {step} {_str_json(phase)[1:-1]}"
    return (f'{{"ph": "X", "cat": {_CAT}, "name": "{name}", "pid": {rank}, "tid": {tid}, "ts": {_json(t0)}, '
            f'"dur": {_json(dur)}, "args": {_args_json(args)}}}')


def _step_events(trace: Trace, step: int, rank: int, plan: _Plan, *, synthetic: bool) -> list[str]:
    """One (step, rank)'s events as JSON texts: a span per phase (causal order), the accepted-draft
    counter at its verify, then the step's span (the phases' extent, with the step's counts).
    Raises ``_Unrecorded`` when recorded times are wanted and a phase has none."""
    phases = _causal(tuple(trace.phases(step, rank)))
    target = trace.lazy_record(step, rank, "target").views if "target" in phases else None
    events: list[str] = []
    span, extra, tid = None, {}, plan.tid
    for i, phase in enumerate(phases):  # only the views counted are decoded
        rec = target if phase == "target" else trace.lazy_record(step, rank, phase).views
        if synthetic:
            t0 = plan.start[step] + i * SYNTHETIC_PHASE_US
            t1 = t0 + SYNTHETIC_PHASE_US
        else:
            t = _times(rec)
            if t is None:
                raise _Unrecorded
            t0, t1 = t
        dur = max(t1 - t0, 0)
        a = _args_or_note(step, rank, phase, rec, target)
        events.append(_span_json(step, phase, rank, tid=tid.get(phase, len(plan.lanes)), t0=t0, dur=dur, args=a))
        span = [t0, t0 + dur] if span is None else [min(span[0], t0), max(span[1], t0 + dur)]
        if phase == "target":
            extra.update({k: a[k] for k in ("num_reqs", "global_tokens", "local_tokens", "padded_tokens") if k in a})
        elif phase == "verify":
            extra.update({k: a[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens") if k in a})
            if "num_accepted_tokens" in a:
                events.append(f'{{"ph": "C", "name": "accepted draft tokens", "pid": {rank}, "tid": {tid["verify"]}, '
                              f'"ts": {_json(t0 + dur)}, "args": {{"accepted": {_json(a["num_accepted_tokens"])}, '
                              f'"drafted": {_json(a.get("num_draft_tokens", 0))}}}}}')
    if span is not None:
        events.append(_span_json(step, None, rank, tid=tid["step"], t0=span[0], dur=span[1] - span[0],
                                 args={"step": step, **extra}))
    return events


CHUNK_STEPS = 1000
"""Steps of one rank whose events are built (and serialized) together."""
WINDOW_CHUNKS = 8
"""Chunks a forked worker builds at a time: memory is bounded by this many chunks' text per worker
(about 10 MB on a PCP=2 K=1 trace), whatever the trace's length."""


def _chunks(trace: Trace) -> list[tuple[int, tuple[int, ...]]]:
    return [(r, tuple(steps[i:i + CHUNK_STEPS])) for r in trace.ranks
            for steps in [list(trace.rank_steps(r))] for i in range(0, len(steps), CHUNK_STEPS)]


def _event_texts(trace: Trace, plan: _Plan, *, synthetic: bool, ranks: list[int]) -> Iterator[str]:
    """Each chunk's events as JSON text, comma-separated, for every chunk of ``ranks``, rank by
    rank and in step order; built in forked processes on a long trace (``windowed_map``)."""
    chunks = [c for c in _chunks(trace) if c[0] in ranks]

    def text(i: int) -> str:
        rank, steps = chunks[i]
        return ", ".join([e for s in steps for e in _step_events(trace, s, rank, plan, synthetic=synthetic)])

    workers = default_workers(sum(len(c[1]) for c in chunks))
    return windowed_map(text, len(chunks), workers=workers, window=WINDOW_CHUNKS)


def _timestamps(trace: Trace) -> bool:
    """Whether the trace's first recorded step has times on every phase (a cheap guess; the
    export falls back to the synthetic timeline when a later one has none)."""
    for rank in trace.ranks:
        for step in trace.rank_steps(rank)[:1]:
            return all(_times(trace.record(step, rank, ph)) is not None for ph in trace.phases(step, rank))
    return False


def chrome_trace(trace: Trace | str | os.PathLike, *, rank: int | None = None) -> dict[str, Any]:
    """The Chrome trace of every rank (merged), or of one ``rank`` with its ``distributedInfo``,
    as a dict (in memory: ``export_chrome`` streams a long trace to its file instead)."""
    trace = trace if isinstance(trace, Trace) else open_trace(trace)
    out: list[io.StringIO] = []

    def emit(synthetic: bool) -> None:
        out[:] = [io.StringIO()]
        _write(trace, out[0], only=rank, plan=plan, synthetic=synthetic)

    plan = _plan(trace)
    _emit_with_fallback(trace, emit)
    return json.loads(out[0].getvalue())


def _emit_with_fallback(trace: Trace, emit: Callable[[bool], None]) -> None:
    """``emit(synthetic)`` on recorded times when the first step has them, again on the
    synthetic timeline when a later phase has none (``_Unrecorded``)."""
    if not _timestamps(trace):
        emit(True)
        return
    try:
        emit(False)
    except _Unrecorded:  # a later phase has no times: every event on the synthetic timeline
        emit(True)


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


def _head(trace: Trace, plan: _Plan, *, synthetic: bool, only: int | None) -> dict[str, Any]:
    """The document without its events (``traceEvents`` is last: HTA reads the metadata, with
    ``distributedInfo``, only up to it)."""
    meta = trace.run_meta
    world = meta.pcp if meta.pcp is not None else len(trace.ranks)
    ranks = trace.ranks if only is None else [only]
    doc: dict[str, Any] = {"schemaVersion": 1}
    if only is not None:
        info: dict[str, Any] = {"rank": int(only), "world_size": world}
        if meta.backend is not None:
            info["backend"] = meta.backend
        doc["distributedInfo"] = info
    doc.update({
        "displayTimeUnit": "ms",
        "otherData": {"pcpviz": {
            "source": str(trace.path),
            "producer": meta.recorded_value("producer"),
            "pcp": meta.pcp,
            "num_speculative_tokens": meta.num_speculative_tokens,
            "ranks": list(ranks),
            "timestamps": "synthetic" if synthetic else "recorded",
            "timestamps_note": (f"synthetic: the trace has no t_start_us/t_end_us on every phase; "
                                f"phases are laid out sequentially, {SYNTHETIC_PHASE_US} us each, "
                                "ranks aligned per step; durations are not measured" if synthetic else
                                "t_start_us/t_end_us recorded by the producer"),
            "lanes": list(plan.lanes),
        }},
    })
    return doc


def _write(trace: Trace, fh: IO[str], *, only: int | None, plan: _Plan, synthetic: bool) -> None:
    """Stream the document to ``fh``: its head, the metadata events, then every chunk's events.
    Raises ``_Unrecorded`` (recorded times wanted, a phase without them)."""
    if only is not None and only not in trace.ranks:
        raise ValueError(f"no rank {only} in {trace.path} (ranks: {trace.ranks})")
    ranks = list(trace.ranks if only is None else [only])
    head = json.dumps(_head(trace, plan, synthetic=synthetic, only=only), allow_nan=False)
    fh.write(head[:-1] + ', "traceEvents": [')
    fh.write(", ".join(json.dumps(e) for e in _metadata_events(ranks, plan.tid)))
    for text in _event_texts(trace, plan, synthetic=synthetic, ranks=ranks):
        if text:
            fh.write(", " + text)
    fh.write("]}")


def export_chrome(trace: Trace | str | os.PathLike, out: str | os.PathLike, *,
                  merged: bool | None = None) -> list[Path]:
    """Write the Chrome trace; returns the files written. Streamed: memory does not grow with
    the steps (``CHUNK_STEPS``), and a long trace's events are built in forked processes.

    ``merged`` defaults to ``str(out).endswith(".json")``: one file with every rank.
    Otherwise ``out`` is a directory (created) that receives ``rank<r>.json`` per rank.
    """
    trace = trace if isinstance(trace, Trace) else open_trace(trace)
    out = Path(out)
    if merged is None:
        merged = out.suffix.lower() == ".json" and not out.is_dir()
    if merged:
        check_output(out)  # a device, FIFO or socket is refused before any work
        if out.parent and not out.parent.exists():
            out.parent.mkdir(parents=True)
        targets = [(out, None)]
    else:
        if out.exists() and not out.is_dir():
            raise ValueError(f"{out}: exists and is not a directory (use a .json name for one merged file)")
        out.mkdir(parents=True, exist_ok=True)
        targets = [(out / f"rank{rank}.json", rank) for rank in trace.ranks]
    plan = _plan(trace)
    _emit_with_fallback(trace, lambda synthetic: _write_all(trace, targets, plan, synthetic=synthetic))
    return [path for path, _ in targets]


def _write_all(trace: Trace, targets: list, plan: _Plan, *, synthetic: bool) -> None:
    # Default separators on purpose: HTA finds a file's rank with the regex '"rank":\s+(\d+)'
    # (a space after the colon), reading line by line, so distributedInfo comes first.
    for path, rank in targets:
        with atomic_output(path) as fh:
            _write(trace, fh, only=rank, plan=plan, synthetic=synthetic)
