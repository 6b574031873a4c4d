"""How long ``pcpviz run`` takes when the engine has almost nothing to do: the launcher's checks,
the rank processes' start (Python, torch, the model), gloo's rendezvous and the trace's finish.
A tiny run (PCP=2, K=1, one 6-character prompt, 2 new tokens) spends ~0.1 s in the engine; the
rest is this start, paid by every run (and by every engine run in the test suite).

    python benchmarks/bench_engine_start.py --repeats 5 --baseline /tmp/base --json data/bench/engine_start_cpu.json

``--baseline ROOT`` runs another checkout the same way, interleaved with this one (old, new, old,
new, ...), so both see the same machine; the table gives the median and min-max wall seconds of
each and their ratio. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["run", "--pcp", "2", "--mtp", "1", "--prompt", "def f(", "--max-new-tokens", "2", "--quiet", "--overwrite"]


def once(root: Path, trace: Path) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "kernels")]))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-P", "-m", "pcpviz.cli", *ARGS, "--trace", str(trace)], env=env,
                       cwd=root, capture_output=True, text=True, timeout=600)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"bench_engine_start: the run in {root} failed: {r.stderr.strip()[-300:]}")
    return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout, run interleaved")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    roots = {"new": ROOT} | ({"old": a.baseline.resolve()} if a.baseline else {})
    times: dict[str, list[float]] = {k: [] for k in roots}
    with tempfile.TemporaryDirectory() as tmp:
        once(ROOT, Path(tmp) / "warm")  # the page cache, once
        for _ in range(a.repeats):
            for name, root in sorted(roots.items(), reverse=True):  # old first, then new
                times[name].append(once(root, Path(tmp) / name))
    rows = {k: {"median_s": round(statistics.median(v), 2), "min_s": round(min(v), 2), "max_s": round(max(v), 2),
                "runs_s": [round(x, 2) for x in v]} for k, v in times.items()}
    for k, r in rows.items():
        print(f"{k:4s} median {r['median_s']:.2f} s  [{r['min_s']:.2f}-{r['max_s']:.2f}]  over {a.repeats} runs")
    if "old" in rows:
        ratios = [o / n for o, n in zip(times["old"], times["new"])]
        rows["old_over_new"] = {"median": round(statistics.median(ratios), 2), "min": round(min(ratios), 2),
                                "max": round(max(ratios), 2)}
        print(f"old / new: median {rows['old_over_new']['median']:.2f}x "
              f"[{rows['old_over_new']['min']:.2f}-{rows['old_over_new']['max']:.2f}] (per interleaved pair)")
    if a.json:
        doc = {"command": "python " + " ".join(["benchmarks/bench_engine_start.py", *(argv or sys.argv[1:])]),
               "pcpviz_args": ARGS, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
               "load_before": round(os.getloadavg()[0], 2), **rows}
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
