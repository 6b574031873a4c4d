"""What the vLLM plugin costs a deployment: recording off / on / flight recorder, side by side in
one process, one GPU (real vLLM 0.33.0, the shipped model, MTP K=2, CUDA graphs).

    source /root/pcpviz-gpu/env.sh      # after tools/gpu/install.py (docs/gpu.md)
    python3 benchmarks/bench_plugin_overhead.py --out data/bench/plugin_overhead_h200x1.json

One ``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the engine core and the
worker run here and ``pcpviz.vllm.recording.set_mode`` switches them), ``cudagraph_mode``
FULL_AND_PIECEWISE, prefix caching off. Four workloads, each timed as one ``generate`` call per
mode on the same prompts (another set each repeat), the modes interleaved (rotated each
repeat), ``--repeats`` times; the figure is the median:

* ``decode_b1`` / ``decode_b32``: 1 / 32 prompts of 256 tokens, 128 / 64 new tokens each;
* ``prefill_b1`` / ``prefill_b32``: 1 prompt of 8,192 tokens / 32 of 1,024, one new token each.

Modes: ``off`` (the plugin's wrappers removed: vLLM as without it), ``record`` (every step to the
rank file), ``flight`` (the last 64 steps in host memory, nothing written). Also reported: trace
bytes and ring bytes per step for each workload, and the same for batch 64 with 32k-token contexts
(64 prompts of 32,000 tokens, 400 new tokens each, so that all 64 decode together once the last
is prefilled), measured, next to the formula, with this process's resident memory after an
unrecorded run, a recorded one and a flight-recorded one.

Where the time goes, per workload and mode: ``hook_us_per_step`` (inside the hooks, vLLM's thread),
``hook_us_per_step_by_hook`` (the same by hook, outermost calls), ``step_thread_cpu_s`` (vLLM's
thread's CPU time per run: the hooks plus the wrappers around them; the wall time beyond it is
waiting, for the GPU or for the GIL) and ``sender_us_per_step`` (the sink's sender thread, CPU and
wall, per step sent: its CPU time holds the GIL that vLLM's thread needs).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "data" / "models" / "pcpviz-tiny-dsv3")
MODES = ("off", "record", "flight")
HELD = "flight-held"
"""A diagnostic mode (``--held``): the flight recorder's hooks as in ``flight``, its staged steps held
back from the sink's sender until the run ends, so the sender does nothing while vLLM runs. Its time
against ``flight``'s is what the sender thread costs vLLM's steps (its CPU time holds the GIL)."""
WORKLOADS = {  # name: (prompts, prompt tokens, new tokens)
    "decode_b1": (1, 256, 128),
    "decode_b32": (32, 256, 64),
    "prefill_b1": (1, 8192, 1),
    "prefill_b32": (32, 1024, 1),
}
LONG = (64, 32000, 400)  # batch 64, 32k-token contexts: enough new tokens that all 64 decode together


def _ids(n_prompts: int, length: int, salt: int) -> list[list[int]]:
    """Distinct token-id prompts from the held-out text (no two share a prefix: no cache hits)."""
    sys.path.insert(0, str(ROOT))
    from pcpviz.engine.tokenizer import encode

    text = json.loads((ROOT / "data" / "bench" / "prompts.json").read_text())["long"]
    ids = encode(text)
    while len(ids) < length + 7919 * (n_prompts + 2):
        ids = ids + ids[1:]
    return [ids[(i + salt) * 7919 % 9973:][:length] for i in range(n_prompts)]


def _rank_file(trace: Path) -> Path:
    return trace / "rank0.arrow"


def _host_mib() -> dict:
    """This process's resident memory now and at its peak (MiB), from /proc."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: round(int(fields[k].split()[0]) / 1024) for k in ("VmRSS", "VmHWM") if k in fields}


def _decode_step_bytes(trace: Path) -> dict:
    """The recorded payload of the trace's full-batch decode steps (no request prefilling, the
    most requests seen in one step): steps, requests, median and largest bytes a step."""
    import numpy as np

    import pcpviz.trace as pt

    t = pt.open(trace)
    rank = t.ranks[0]
    rows = []
    for step in t.rank_steps(rank):
        if not t.has(step, rank, "target"):
            continue
        tgt = t.record(step, rank, "target")
        if "is_prefilling" not in tgt or np.asarray(tgt["is_prefilling"]).any():
            continue
        nbytes = sum(np.asarray(t.record(step, rank, ph)[v]).nbytes for ph in t.phases(step, rank)
                     for v in t.record(step, rank, ph))
        rows.append((len(np.asarray(tgt["is_prefilling"])), nbytes))
    most = max((r for r, _ in rows), default=0)
    full = sorted(b for r, b in rows if r == most)
    return {"steps": len(full), "requests": most, "median_bytes": full[len(full) // 2] if full else None,
            "max_bytes": full[-1] if full else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--mode", default="FULL_AND_PIECEWISE", help="cudagraph_mode")
    ap.add_argument("--no-long", action="store_true", help="skip the batch-64 32k-context measurement")
    ap.add_argument("--long-only", action="store_true", help="only the batch-64 32k-context measurement")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--held", action="store_true", help=f"also time the diagnostic mode {HELD!r} (module doc)")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pcpviz-overhead-"))
    trace = work / "trace"
    os.environ.update(PCPVIZ_TRACE_DIR=str(trace), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_V2_MODEL_RUNNER="1")
    from vllm import LLM, SamplingParams

    from pcpviz.trace.flight import FlightConfig
    from pcpviz.vllm import recording
    from pcpviz.vllm.recording.backlog import backlog_bytes

    kwargs = dict(model=MODEL, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                  compilation_config={"cudagraph_mode": a.mode}, gpu_memory_utilization=0.3,
                  disable_custom_all_reduce=True, enable_prefix_caching=False, max_num_batched_tokens=16384,
                  max_num_seqs=64, max_model_len=32768, seed=0)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    flight = FlightConfig(steps=64, signal=None)
    session = recording.current_session()
    rec = next(iter(session.recorders.values()))

    def run(prompts: list[list[int]], new: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t

    def sizes(mode: str, fn) -> dict:
        """Bytes per recorded step of ``fn()`` in ``mode`` (rank file growth, ring bytes), from the
        sink's ``stats()`` (the writer process's, or this process's writer)."""
        recording.set_mode(mode, flight=flight)
        steps0 = rec.steps_written
        size0 = rec.sink.stats().get("bytes_written", 0)
        fn()
        recording.set_mode(mode, flight=flight)  # drains what is in flight
        steps = rec.steps_written - steps0
        st = rec.sink.stats()
        if mode == "record":
            return {"steps": steps, "trace_bytes_per_step": round((st["bytes_written"] - size0) / max(steps, 1))}
        ring_steps = st.get("ring_step_bytes", [])
        kept = ring_steps[-min(steps, len(ring_steps)):] if steps else []
        return {"steps": steps, "ring_bytes_per_step": round(sum(kept) / max(len(kept), 1)),
                "ring_bytes": st.get("ring_bytes", 0), "ring_steps": len(ring_steps)}

    args = sys.argv[1:] if argv is None else argv
    res: dict = {"command": "python3 benchmarks/bench_plugin_overhead.py " + " ".join(args),
                 "writer": getattr(rec.sink, "kind", "?"), "llm_kwargs": kwargs, "startup_s": round(startup, 1),
                 "repeats": a.repeats,
                 "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("VLLM_", "PCPVIZ_"))},
                 "flight": flight.to_meta(), "workloads": {}}
    modes = MODES + ((HELD,) if a.held else ())
    for name in ([] if a.long_only else a.workloads):
        n, length, new = WORKLOADS[name]
        # The same prompts for every mode of a repeat (prefix caching is off: no run reuses
        # another's KV), so each mode does the same steps; another prompt each repeat.
        prompts = [_ids(n, length, salt) for salt in range(a.repeats + 3)]
        recording.set_mode("off")
        run(prompts[-1], new)  # warm-up
        times: dict[str, list[float]] = {m: [] for m in modes}
        cpu: dict[str, list[float]] = {m: [] for m in modes}  # vLLM's thread (this one: in-process engine)
        hook_us: dict[str, list[float]] = {m: [] for m in modes if m != "off"}
        by_hook: dict[str, dict[str, int]] = {m: {} for m in modes if m != "off"}
        sender = {m: [0, 0, 0] for m in modes if m != "off"}  # CPU ns, wall ns, steps of the sink's sender thread
        gc_runs: dict[str, list[dict]] = {m: [] for m in modes}  # the collector's pauses in each run (``GcClock``)
        prev, snap = None, _sender(rec)
        for r in range(a.repeats):
            for m in modes[r % len(modes):] + modes[: r % len(modes)]:  # rotated: no mode always first
                recording.set_mode("flight" if m == HELD else m, flight=flight)  # drains the previous run's steps
                snap = _attribute(sender, prev, snap, _sender(rec))
                secs0, steps0, hooks0 = rec.seconds, rec.steps_written, rec.hook_times()
                c = time.thread_time()
                gc0 = GC.snapshot()
                with _held(rec, m == HELD):
                    times[m].append(run(prompts[r], new))
                cpu[m].append(time.thread_time() - c)
                gc_runs[m].append(GC.since(gc0))
                prev = m
                if m != "off":  # host time inside the hooks on vLLM's thread, per recorded step
                    steps = max(rec.steps_written - steps0, 1)
                    hook_us[m].append((rec.seconds - secs0) / steps * 1e6)
                    for k, v in rec.hook_times().items():
                        by_hook[m][k] = by_hook[m].get(k, 0) + (v - hooks0.get(k, 0))
                    by_hook[m]["_steps"] = by_hook[m].get("_steps", 0) + steps
        recording.set_mode("off")
        _attribute(sender, prev, snap, _sender(rec))
        med = {m: statistics.median(v) for m, v in times.items()}
        ratios = {m: [t / o for t, o in zip(times[m], times["off"])] for m in modes if m != "off"}
        entry = {"prompts": n, "prompt_tokens": length, "new_tokens": new,
                 "seconds": {m: [round(x, 5) for x in v] for m, v in times.items()},
                 "median_s": {m: round(v, 5) for m, v in med.items()},
                 "min_max_s": {m: [round(min(v), 5), round(max(v), 5)] for m, v in times.items()},
                 "record_over_off": round(med["record"] / med["off"], 4),
                 "flight_over_off": round(med["flight"] / med["off"], 4),
                 **({"held_over_off": round(med[HELD] / med["off"], 4)} if a.held else {}),
                 "ratio_per_repeat_min_max": {m: [round(min(v), 4), round(max(v), 4)] for m, v in ratios.items()},
                 "hook_us_per_step": {m: {"median": round(statistics.median(v), 1), "min": round(min(v), 1),
                                          "max": round(max(v), 1)} for m, v in hook_us.items()},
                 "step_thread_cpu_s": {m: {"median": round(statistics.median(v), 5), "min": round(min(v), 5),
                                           "max": round(max(v), 5)} for m, v in cpu.items()},
                 "hook_us_per_step_by_hook": {m: _per_step(v) for m, v in by_hook.items()},
                 "gc_per_run": {m: GcClock.median(v) for m, v in gc_runs.items()},
                 "sender_us_per_step": {m: {"cpu": round(v[0] / max(v[2], 1) / 1e3, 1),
                                            "wall": round(v[1] / max(v[2], 1) / 1e3, 1), "steps": v[2]}
                                        for m, v in sender.items()}}
        entry.update(sizes("record", lambda: run(prompts[0], new)))
        entry.update(sizes("flight", lambda: run(prompts[0], new)))
        res["workloads"][name] = entry
        print(name, json.dumps({k: entry[k] for k in ("median_s", "min_max_s", "record_over_off", "flight_over_off",
                                                      "hook_us_per_step", "step_thread_cpu_s", "gc_per_run",
                                                      "sender_us_per_step")}), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))
    if not a.no_long:
        n, length, new = LONG
        long_prompts = _ids(n, length, 3)
        t = time.perf_counter()
        rss0 = _host_mib()
        recording.set_mode("off")
        off_s = run(_ids(n, length, 7), new)
        rss_off = _host_mib()
        took: dict[str, float] = {}
        rec_long = sizes("record", lambda: took.setdefault("record", run(long_prompts, new)))
        rss1 = _host_mib()
        fl_long = sizes("flight", lambda: took.setdefault("flight", run(_ids(n, length, 5), new)))
        res["b64_ctx32k"] = {"prompts": n, "prompt_tokens": length, "new_tokens": new, "record": rec_long,
                             "flight": fl_long, "seconds": round(time.perf_counter() - t, 1),
                             "decode_steps": _decode_step_bytes(trace),
                             "run_seconds": {"off": round(off_s, 2), **{m: round(v, 2) for m, v in took.items()}},
                             "backlog_mb": backlog_bytes() / 1e6,
                             "host_mib": {"before": rss0, "after_off": rss_off, "after_record": rss1,
                                          "after_flight": _host_mib()}}
        print("b64_ctx32k", json.dumps(res["b64_ctx32k"]), flush=True)
    recording.set_mode("off")
    res["recorder"] = {"disabled_reason": rec.disabled_reason, "device_ring": rec.pack.ring.stats()}
    res["formula"] = ("decode step, R requests of context C, block size 16, K=2 (FULL_AND_PIECEWISE: draft "
                      "decodes replayed, their block tables not recorded): ~ R * 4 bytes * C/16 * 2 block tables "
                      "(target global, draft_0) + ~150 bytes * R of per-request views + ~6 kB fixed")
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("workloads",)})[:2000], flush=True)
    return 0


class GcClock:
    """The garbage collector's pauses in this process (``gc.callbacks``): collections by generation
    and the milliseconds they took. The hooks allocate Python objects on vLLM's thread; the young
    collections those allocations trigger scan every object not frozen (vLLM freezes its start-up
    heap, ``v1/engine/core.py:243``), and a collection's pause lands on whichever code allocated."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.ns = [0, 0, 0]
        self._t0 = 0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
            return
        g = info.get("generation", 0)
        self.counts[g] += 1
        self.ns[g] += time.perf_counter_ns() - self._t0

    def snapshot(self) -> tuple[list[int], list[int]]:
        return list(self.counts), list(self.ns)

    def since(self, snap: tuple[list[int], list[int]]) -> dict:
        counts, ns = snap
        return {"collections": [a - b for a, b in zip(self.counts, counts)],
                "ms": round(sum(self.ns) / 1e6 - sum(ns) / 1e6, 3)}

    @staticmethod
    def median(runs: list[dict]) -> dict:
        return {"collections": [statistics.median(r["collections"][g] for r in runs) for g in range(3)],
                "ms": {"median": statistics.median(r["ms"] for r in runs), "min": min(r["ms"] for r in runs),
                       "max": max(r["ms"] for r in runs)}} if runs else {}


GC = GcClock()


@contextlib.contextmanager
def _held(rec, on: bool):
    """``HELD``: the staged steps go to the sink only when the block ends (see ``HELD``)."""
    if not on:
        yield
        return
    sink, kept = rec.sink, []
    submit = sink.submit
    sink.submit = lambda step, staged: kept.append((step, staged))
    try:
        yield
    finally:
        sink.submit = submit
        for step, staged in kept:
            submit(step, staged)


def _sender(rec) -> list[int]:
    """The sink's sender thread's counters (CPU ns, wall ns, steps; zeros for a sink without one)."""
    return list(getattr(rec.sink, "sender_ns", (0, 0, 0)))


def _attribute(acc: dict, mode: str | None, before: list[int], now: list[int]) -> list[int]:
    """Add the sender's work since ``before`` to ``mode``'s (the steps of the run just drained)."""
    if mode in acc:
        for i in range(3):
            acc[mode][i] += now[i] - before[i]
    return now


def _per_step(ns_by_hook: dict[str, int]) -> dict[str, float]:
    """Microseconds per recorded step of each hook, largest first."""
    steps = max(ns_by_hook.get("_steps", 0), 1)
    return dict(sorted(((k, round(v / steps / 1e3, 1)) for k, v in ns_by_hook.items() if k != "_steps"),
                       key=lambda kv: -kv[1]))


if __name__ == "__main__":
    sys.exit(main())
