"""Time ``pcpviz check`` (and diff / Chrome export) on a long-prompt PCP trace.

    .venv/bin/python benchmarks/bench_checks.py                 # 32k prompt, PCP=4, K=3
    .venv/bin/python benchmarks/bench_checks.py --prompt-len 131072 --chunk 16384 --pcp 8

The trace is synthetic (``pcpviz.synthetic.long_prompt_run``): one long prompt chunked over a
few steps next to short requests, then tens of decode steps with MTP drafts and rejections,
every view built with the pcpviz reference layout/blocks code. Prints one line per timing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pcpviz.analysis.checks import run_checks  # noqa: E402
from pcpviz.analysis.diff import diff_traces  # noqa: E402
from pcpviz.views.export.chrome import export_chrome  # noqa: E402
from pcpviz.synthetic import long_prompt_run  # noqa: E402
from pcpviz.trace import open as open_trace  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pcp", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32_768)
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (chunk size)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--mtp", type=int, default=3, help="num_speculative_tokens K")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    run = long_prompt_run(pcp=args.pcp, prompt_len=args.prompt_len, chunk=args.chunk,
                          max_new_tokens=args.max_new_tokens, num_speculative_tokens=args.mtp)
    t_gen = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="pcpviz-bench-") as tmp:
        path = run.write(Path(tmp) / "trace")
        size = sum(f.stat().st_size for f in path.iterdir())
        trace = open_trace(path)
        tokens = sum(int(per_rank[0]["target"]["num_scheduled_tokens"].sum()) for _, per_rank in run.steps)
        print(f"trace: pcp={args.pcp} K={args.mtp} prompt={args.prompt_len} chunk={args.chunk}: "
              f"{len(trace.steps)} steps, {len(trace.ranks)} ranks, {tokens} scheduled tokens, "
              f"{size / 2**20:.1f} MiB on disk (generated in {t_gen:.2f} s)")
        best = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            report = run_checks(open_trace(path))  # open + every check on every (step, rank)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        if not report.ok:
            print(report.format())
            return 1
        n = sum(r.evaluated for r in report.results.values())
        print(f"pcpviz check: {best:.3f} s (best of {args.repeat}; open + {len(report.results)} checks, "
              f"{n} (check, step, rank) evaluations; all pass)")
        t0 = time.perf_counter()
        diff = diff_traces(path, path)
        print(f"pcpviz diff (trace vs itself): {time.perf_counter() - t0:.3f} s, same={diff.same}, "
              f"{diff.views_compared} views compared")
        t0 = time.perf_counter()
        files = export_chrome(path, Path(tmp) / "chrome")
        print(f"pcpviz export --chrome: {time.perf_counter() - t0:.3f} s, {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
