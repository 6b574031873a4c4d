"""Workbench responsiveness on a long-prompt trace: time to open it, to build the Workbench, and
of one change of every control (issue 15: median control change <= 100 ms on a 128k-token,
PCP=8, K=3 trace on a 2-core CPU).

    .venv/bin/python benchmarks/bench_workbench.py [--prompt-len 131072] [--pcp 8] [--k 3]
        [--chunk 131072] [--repeats 15] [--out data/bench/workbench_cpu.json]

The trace is synthetic (``pcpviz.synthetic.long_prompt_run``: one long prompt — by default the
whole 131,072 tokens in one prefill step, 16,384 per rank — next to seven short requests, then
tens of decode steps with K=3 drafts) because running the engine on a 128k-token prompt at PCP=8
is too slow on CPU; every structural view is computed by the same reference code
(``pcpviz.reference.layout`` / ``pcpviz.reference.blocks``) the checks use. ``--chunk 8192`` chunks the prompt over
16 steps instead.

Every control of the Workbench is driven, one change at a time, ``--repeats`` times each:

* ``step (long prefill)`` / ``step (decode)`` — the step slider onto a step with more / at most
  2048 scheduled tokens (``step`` overall);
* ``phase`` — the phase toggle (target, draft_0 .. draft_{K-1}, verify: the draft step the
  block-table and slot-mapping panels show);
* ``rank`` — the rank dropdown;
* ``highlight`` — the request dropdown (a request, then none);
* ``jump`` — ``Workbench.set(step=, rank=, phase=)``, what a check's *jump* button does.

Each is timed on the Python side (building the figures and pushing them to the
``FigureWidget``s, which serialise the change for the front end) with ``time.perf_counter``,
twice: *warm* (the Workbench reuses figures it built before, as when a user drives it) and
*cold* (its figure cache emptied before every change, so every view a change affects is built
from the records). Prints and writes (``--out``) the median and p90 of each control, and the
median over all changes, for both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET_MS = 100.0


def make_trace(out: Path, *, prompt_len: int, pcp: int, k: int, chunk: int) -> Path:
    from pcpviz.synthetic import long_prompt_run  # noqa: PLC0415

    run = long_prompt_run(pcp=pcp, prompt_len=prompt_len, chunk=chunk, num_speculative_tokens=k)
    return run.write(out)


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]


def _stats(xs: list[float]) -> dict:
    return {"n": len(xs), "median_ms": round(1000 * statistics.median(xs), 1), "p90_ms": round(1000 * _p90(xs), 1),
            "min_ms": round(1000 * min(xs), 1), "max_ms": round(1000 * max(xs), 1)}


def drive(wb, trace, repeats: int, *, cold: bool = False) -> dict[str, list[float]]:
    """Seconds of each control change, by control. ``cold``: the Workbench's figure cache is
    emptied before each change (not timed), so every view the change affects is rebuilt."""
    steps = list(trace.steps)
    tokens = {s: int(trace.record(s, trace.ranks[0], "target")["num_scheduled_tokens"].sum()) for s in steps}
    big = [s for s in steps if tokens[s] > 2048]
    small = [s for s in steps if tokens[s] <= 2048]
    times: dict[str, list[float]] = {"step (long prefill)": [], "step (decode)": [], "phase": [], "rank": [],
                                     "highlight": [], "jump": []}

    def timed(kind: str, fn) -> None:
        if cold:
            wb.clear_cache()
        t0 = time.perf_counter()
        fn()
        times[kind].append(time.perf_counter() - t0)

    def move_step(s: int) -> None:
        if s == wb.step.value:
            return
        timed("step (long prefill)" if s in big else "step (decode)", lambda: setattr(wb.step, "value", s))

    for i in range(repeats):  # alternate a long prefill step and a decode step
        move_step(big[i % len(big)] if big else steps[(2 * i) % len(steps)])
        move_step(small[(5 * i + 1) % len(small)] if small else steps[-1])
    for s in (big[:1] or steps[:1]) + small[len(small) // 2:len(small) // 2 + 1]:  # controls on both kinds
        wb.set(step=s, rank=trace.ranks[0], highlight="")
        for i in range(repeats):
            opts = list(wb.phase.options)
            timed("phase", lambda: setattr(wb.phase, "value", opts[(opts.index(wb.phase.value) + 1) % len(opts)]))
        for i in range(repeats):
            ranks = trace.ranks
            timed("rank", lambda: setattr(wb.rank, "value", ranks[(ranks.index(wb.rank.value) + 1) % len(ranks)]))
        for i in range(repeats):
            timed("highlight", lambda: setattr(wb.highlight, "value", wb.req_ids[i % len(wb.req_ids)] if i % 2 == 0
                                               else ""))
    for i in range(repeats):
        s = steps[(7 * i + 3) % len(steps)]
        r = trace.ranks[(3 * i + 1) % len(trace.ranks)]
        phases = [p for p in trace.phases(s, r) if p != "dummy"]
        timed("jump", lambda: wb.set(step=s, rank=r, phase=phases[i % len(phases)]))
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=131_072)
    ap.add_argument("--pcp", type=int, default=8)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--chunk", type=int, default=None,
                    help="max_num_batched_tokens of the synthetic run (default: the whole prompt in one step)")
    ap.add_argument("--repeats", type=int, default=15, help="changes measured per control")
    ap.add_argument("--trace", type=Path, default=None, help="use this trace instead of generating one")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if min(args.prompt_len, args.pcp, args.repeats) < 1 or args.k < 0:
        print("bench_workbench: --prompt-len, --pcp and --repeats must be >= 1, --k >= 0", file=sys.stderr)
        return 2
    chunk = args.chunk or args.prompt_len

    with tempfile.TemporaryDirectory(prefix="pcpviz-bench-wb-") as tmp:
        path = args.trace
        gen_s = None
        if path is None:
            t0 = time.perf_counter()
            path = make_trace(Path(tmp) / "long", prompt_len=args.prompt_len, pcp=args.pcp, k=args.k, chunk=chunk)
            gen_s = time.perf_counter() - t0
        elif not Path(path).is_dir():
            print(f"bench_workbench: --trace {path}: not a trace directory", file=sys.stderr)
            return 2
        size = sum(f.stat().st_size for f in Path(path).iterdir())

        import pcpviz.trace as pt  # noqa: PLC0415
        t0 = time.perf_counter()
        trace = pt.open(path)
        open_s = time.perf_counter() - t0

        from pcpviz.views.widgets import Workbench  # noqa: PLC0415 (import time not counted below)
        t0 = time.perf_counter()
        wb = Workbench(pt.open(path))
        build_s = time.perf_counter() - t0

        steps = trace.steps
        r0 = trace.ranks[0]
        t_max = max(int(trace.record(s, r0, "target")["num_scheduled_tokens"].sum()) for s in steps)
        np_max = max(trace.record(s, r0, "target")["padded_gather_idx"].shape[0] for s in steps)
        w_max = max(trace.record(s, r0, "target")["block_table_global"].shape[-1] for s in steps)
        k = trace.run_meta.num_speculative_tokens
        print(f"trace: {path}")
        print(f"  PCP={len(trace.ranks)}, K={k}, {len(steps)} steps, {len(wb.req_ids)} requests, max T per step "
              f"{t_max}, max N*P {np_max}, block-table width {w_max}, {size / 2**20:.1f} MiB on disk"
              + (f" (generated in {gen_s:.2f} s)" if gen_s is not None else ""))
        print(f"open trace (pcpviz.trace.open):   {1000 * open_s:7.1f} ms")
        print(f"build Workbench (all 5 views):    {1000 * build_s:7.1f} ms"
              + (f"  (of which pcpviz.analysis.checks.run_checks {1000 * wb.check_seconds:.1f} ms)"
                 if wb.check_report is not None else "  (pcpviz.analysis.checks not available)"))

        results = {}
        for mode, cold in (("warm", False), ("cold", True)):
            times = drive(wb, trace, args.repeats, cold=cold)
            per = {name: _stats(v) for name, v in times.items() if v}
            per["step"] = _stats(times["step (long prefill)"] + times["step (decode)"])
            overall = _stats([x for v in times.values() for x in v])
            results[mode] = {"control_change": per, "overall": overall}
            print(f"one control change, {mode} ("
                  + ("figures built before are reused, as when a user drives the Workbench"
                     if not cold else "the figure cache emptied before each change: every affected view rebuilt")
                  + f"; Python side: build the figures, push them to the FigureWidgets; target median "
                    f"<= {TARGET_MS:.0f} ms):")
            for name, st in per.items():
                print(f"  {name:<22} median {st['median_ms']:7.1f} ms   p90 {st['p90_ms']:7.1f} ms   "
                      f"(min {st['min_ms']:.1f}, max {st['max_ms']:.1f}, n={st['n']})")
            print(f"  {'all changes':<22} median {overall['median_ms']:7.1f} ms   p90 {overall['p90_ms']:7.1f} ms   "
                  f"(n={overall['n']})  {'meets' if overall['median_ms'] <= TARGET_MS else 'MISSES'} the target")

        wb.set(step=max(steps, key=lambda s: int(trace.record(s, r0, "target")["num_scheduled_tokens"].sum())),
               rank=r0, highlight="")
        sizes = {n: len(json.dumps(f.to_plotly_json(), default=str)) for n, f in wb.figures.items()}
        print(f"figure JSON per view at the largest step {wb.step.value} (bytes): "
              + ", ".join(f"{n} {b / 1024:.0f} KiB" for n, b in sizes.items()))
        print(f"render counts: {dict(wb.render_counts)}")
        if args.out is not None:
            doc = {
                "benchmark": "benchmarks/bench_workbench.py",
                "command": "python benchmarks/bench_workbench.py "
                           + " ".join(argv if argv is not None else sys.argv[1:]),
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform(),
                            "load_average_1_5_15_min_at_end": [round(x, 2) for x in os.getloadavg()]},
                "trace": {"pcp": len(trace.ranks), "num_speculative_tokens": k, "steps": len(steps),
                          "requests": len(wb.req_ids), "prompt_len": args.prompt_len if args.trace is None else None,
                          "max_tokens_per_step": t_max, "max_gathered_rows": np_max, "block_table_width": w_max,
                          "bytes_on_disk": size},
                "open_trace_ms": round(1000 * open_s, 1),
                "build_workbench_ms": round(1000 * build_s, 1),
                "run_checks_ms": round(1000 * wb.check_seconds, 1) if wb.check_report is not None else None,
                **results,
                "target_median_ms": TARGET_MS,
                "meets_target": all(r["overall"]["median_ms"] <= TARGET_MS for r in results.values()),
                "figure_json_bytes_at_largest_step": sizes,
            }
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
