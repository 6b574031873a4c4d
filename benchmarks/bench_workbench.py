"""Workbench responsiveness on a long-prompt trace (the design's "time of one widget update and
of opening a trace, on a long-prompt trace").

    .venv/bin/python benchmarks/bench_workbench.py [--prompt-len 32768] [--pcp 4] [--repeats 5]

The trace is synthetic (``pcpviz.synthetic.long_prompt_run``: one 32k-token prompt chunked over
a few steps next to short requests, then tens of decode steps with K=3 drafts, PCP=4) because
running the engine on a 32k-token prompt at PCP=4 is too slow on CPU; every structural view is
computed by the same reference code (``pcpviz.layout`` / ``pcpviz.blocks``) the checks use.
Prints, in one run: trace size, time to ``pcpviz.trace.open`` it, time to build the Workbench,
the median time of one control change (step slider moves over prefill and decode steps, phase
changes, rank changes, highlight changes) and the size of the figure JSON the front end gets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_trace(out: Path, prompt_len: int, pcp: int) -> Path:
    from pcpviz.synthetic import long_prompt_run  # noqa: PLC0415

    run = long_prompt_run(pcp=pcp, prompt_len=prompt_len)
    return run.write(out)


def _median_ms(xs: list[float]) -> str:
    return f"{1000 * statistics.median(xs):7.1f} ms (min {1000 * min(xs):.1f}, max {1000 * max(xs):.1f}, n={len(xs)})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=32_768)
    ap.add_argument("--pcp", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5, help="control changes measured per kind")
    ap.add_argument("--trace", type=Path, default=None, help="use this trace instead of generating one")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="pcpviz-bench-wb-") as tmp:
        path = args.trace
        if path is None:
            t0 = time.perf_counter()
            path = make_trace(Path(tmp) / "long", args.prompt_len, args.pcp)
            gen_s = time.perf_counter() - t0
        else:
            gen_s = float("nan")
        size = sum(f.stat().st_size for f in Path(path).iterdir())

        import pcpviz.trace as pt  # noqa: PLC0415
        t0 = time.perf_counter()
        trace = pt.open(path)
        open_s = time.perf_counter() - t0

        from pcpviz.widgets import Workbench  # noqa: PLC0415 (import time not counted below)
        t0 = time.perf_counter()
        wb = Workbench(pt.open(path))
        build_s = time.perf_counter() - t0

        steps = trace.steps
        first = trace.record(steps[0], 0, "target")
        t_max = max(int(trace.record(s, 0, "target")["num_scheduled_tokens"].sum()) for s in steps)
        np_max = max(trace.record(s, 0, "target")["padded_gather_idx"].shape[0] for s in steps)
        w_max = max(trace.record(s, 0, "target")["block_table_global"].shape[-1] for s in steps)
        print(f"trace: {path}")
        print(f"  PCP={len(trace.ranks)}, K={trace.meta.get('num_speculative_tokens')}, {len(steps)} steps, "
              f"{len(wb.req_ids)} requests, max T per step {t_max}, max N*P {np_max}, block-table width {w_max}, "
              f"{size / 2**20:.1f} MiB on disk (generated in {gen_s:.2f} s)")
        print(f"  first step: T={int(first['num_scheduled_tokens'].sum())}")
        print(f"open trace (pcpviz.trace.open):   {1000 * open_s:7.1f} ms")
        print(f"build Workbench (all 5 views):    {1000 * build_s:7.1f} ms"
              + (f"  (of which pcpviz.checks.run_checks {1000 * wb.check_seconds:.1f} ms)"
                 if wb.check_report is not None else "  (pcpviz.checks not available)"))

        # one control change each, cycling over steps with the long-prompt chunks and decodes
        big = [s for s in steps if int(trace.record(s, 0, "target")["num_scheduled_tokens"].sum()) > 2048]
        small = [s for s in steps if s not in big]
        seq = []
        for i in range(args.repeats):
            seq.append(big[i % len(big)] if big else steps[i % len(steps)])
            seq.append(small[(3 * i + 1) % len(small)] if small else steps[-1])
        times: dict[str, list[float]] = {"step (long-prompt chunk)": [], "step (decode)": [], "phase": [],
                                         "rank": [], "highlight": []}
        for s in seq:
            if s == wb.step.value:
                continue
            t0 = time.perf_counter()
            wb.step.value = s
            times["step (long-prompt chunk)" if s in big else "step (decode)"].append(time.perf_counter() - t0)
        wb.step.value = big[0] if big else steps[0]
        phases = list(wb.phase.options)
        for i in range(args.repeats):
            t0 = time.perf_counter()
            wb.phase.value = phases[(phases.index(wb.phase.value) + 1) % len(phases)]
            times["phase"].append(time.perf_counter() - t0)
        for i in range(args.repeats):
            t0 = time.perf_counter()
            wb.rank.value = trace.ranks[(trace.ranks.index(wb.rank.value) + 1) % len(trace.ranks)]
            times["rank"].append(time.perf_counter() - t0)
        for i in range(args.repeats):
            t0 = time.perf_counter()
            wb.highlight.value = wb.req_ids[i % len(wb.req_ids)] if i % 2 == 0 else ""
            times["highlight"].append(time.perf_counter() - t0)
        print("one control change (median; Python side: build figures + push to the FigureWidgets):")
        for k, v in times.items():
            if v:
                print(f"  {k:<26} {_median_ms(v)}")
        wb.set(step=big[0] if big else steps[0], rank=trace.ranks[0], highlight="")
        lanes = wb.figures["token_order"].data[0]
        tgt = trace.record(wb.step.value, wb.rank.value, "target")
        t_tok, np_rows = int(tgt["num_scheduled_tokens"].sum()), tgt["padded_gather_idx"].shape[0]
        print(f"aggregation at step {wb.step.value}: T={t_tok}, N*P={np_rows} -> token-order lanes drawn as "
              f"{len(lanes.z)} x {len(lanes.z[0])} run cells (per-token would be "
              f"{len(lanes.z)} x {max(t_tok, np_rows // len(trace.ranks))})")
        sizes = {n: len(json.dumps(f.to_plotly_json(), default=str)) for n, f in wb.figures.items()}
        print("figure JSON per view at a long-prompt step (bytes): "
              + ", ".join(f"{n} {b / 1024:.0f} KiB" for n, b in sizes.items()))
        print(f"render counts: {dict(wb.render_counts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
