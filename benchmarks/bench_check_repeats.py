"""``check``, ``explain --no-rerun`` and the exports on one trace, this checkout against another, interleaved.

    python benchmarks/bench_scale.py --scenario steps --steps 10000 --keep /tmp/scale --only check
    python benchmarks/bench_check_repeats.py /tmp/scale/steps --baseline <checkout> --repeats 5 \\
        --out data/bench/scale_cpu_bulk_rules_10k_x5.json

Each run is ``PYTHONPATH=<tree>:<tree>/kernels python -m pcpviz.cli check --json TRACE`` (or
``explain --no-rerun --json TRACE``; ``diff --json TRACE OTHER`` with ``--only diff --diff-with
OTHER``) in its own process; old and new alternate, the order swapped
every repeat. Wall seconds, CPU seconds (user + system of the command and its workers) and peak
RSS (the largest of the command and its workers) per run, and their median and min-max. A
benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"check": ["check", "--json"], "explain --no-rerun": ["explain", "--no-rerun", "--json"],
            "export --html": ["export", "--html", "/tmp/pcpviz-bench-repeats.html"],
            "export --chrome": ["export", "--chrome", "/tmp/pcpviz-bench-repeats.json"],
            "diff": ["diff", "--json"]}
"""``diff`` compares the trace with ``--diff-with`` (a copy of it, or another run)."""


def _run(root: Path, args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{root}:{root / 'kernels'}")
    load = os.getloadavg()[0]  # the machine is shared: how busy it was as the run began
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "pcpviz.cli", *args], env=env, cwd=root,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)  # the command's own rusage, its reaped workers' included
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime
    return {"wall": round(wall, 2), "cpu": round(cpu, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024),
            "exit": p.returncode, "load_before": round(load, 2)}


def _spread(runs: list[dict]) -> dict:
    w, c, m = [r["wall"] for r in runs], [r["cpu"] for r in runs], [r["peak_rss_mib"] for r in runs]
    return {"wall_median": statistics.median(w), "wall_min_max": [min(w), max(w)],
            "cpu_median": statistics.median(c), "cpu_min_max": [min(c), max(c)], "peak_rss_mib_max": max(m),
            "exits": sorted({r["exit"] for r in runs})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--baseline", type=Path, required=True, help="the other checkout")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", nargs="+", choices=list(COMMANDS), default=[c for c in COMMANDS if c != "diff"],
                    help="these commands only")
    ap.add_argument("--diff-with", type=Path, help="the run ``diff`` compares the trace with (``--only diff``)")
    a = ap.parse_args(argv)
    if "diff" in a.only and a.diff_with is None:
        ap.error("--only diff needs --diff-with")
    other = [] if a.diff_with is None else [str(a.diff_with.resolve())]
    trees = [("base", a.baseline.resolve()), ("new", ROOT)]
    runs: dict[str, list[dict]] = {}
    for rep in range(a.repeats):
        for name, args in ((n, COMMANDS[n]) for n in a.only):
            for which, root in (trees if rep % 2 == 0 else trees[::-1]):
                r = runs.setdefault(f"{name} | {which}", [])
                r.append(_run(root, [*args, str(a.trace.resolve()), *(other if name == "diff" else [])]))
                print(rep, name, which, r[-1], flush=True)
    out = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "trace": str(a.trace),
           "runs": runs, "summary": {k: _spread(v) for k, v in runs.items()}}
    print(json.dumps(out["summary"], indent=1))
    if a.out:
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
