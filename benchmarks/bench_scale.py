"""Time every trace command on traces at scale, with each command's peak memory (issue 20).

    .venv/bin/python benchmarks/bench_scale.py                       # all scenarios
    .venv/bin/python benchmarks/bench_scale.py --scenario steps --steps 20000
    .venv/bin/python benchmarks/bench_scale.py --scenario pcp64 --keep runs/bench-scale
    .venv/bin/python benchmarks/bench_scale.py --scenario long pcp64 --only check explain diff chrome \
        --baseline ../main --json data/bench/scale_cpu_vs_main.json   # against another checkout

Scenarios (synthetic traces, every view built by the pcpviz reference):

* ``steps``: 100,000 tiny steps (PCP=2, K=1, two decoding requests: the steps of one short
  synthetic run repeated with new step numbers); ``diff`` against a copy (no difference: its best
  case) and against the same steps with other draft tokens at every step (``diff, diverged``);
* ``pcp64``: PCP=64 x 40 steps;
* ``long``: one 1M-token prompt under PCP=8, K=3 (``long_prompt_run``), for ``check`` and
  ``explain --no-rerun``.

Each command runs as ``python -m pcpviz.cli ...`` in its own process; the table gives its wall
time and peak RSS (``wait4``), and ``--json`` (default ``data/bench/scale_cpu.json``) keeps it
with the command line and the machine's load. A command past ``--timeout`` is stopped and
reported as such. Targets (issue 20): 60 s and 2 GB per command on the 2-core development
machine; ``long``: 2 s (issue 26). A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


import numpy as np  # noqa: E402

import pcpviz.trace as pt  # noqa: E402
from pcpviz.synthetic import RequestSpec, generate, long_prompt_run  # noqa: E402


def tiny_steps(out: Path, steps: int, *, diverged: bool = False) -> Path:
    """``steps`` tiny steps: one short run's steps, repeated with new step numbers. ``diverged``: the
    same run with a drafter that proposes other tokens at every step (``draft_tokens`` and the
    draft's output hidden fingerprint one more on every rank): ``diff`` against it finds a
    difference at every step, where against a copy it finds none."""
    template = generate([RequestSpec("a", 6, 40), RequestSpec("b", 5, 40)], pcp=2, num_speculative_tokens=1,
                        block_size=16, seed=1)
    src = template.write(out.parent / (out.name + "-template"))
    t = pt.open(src)
    meta = {k: v for k, v in t.meta.items() if k not in (pt.schema.META_SCHEMA_KEY, "num_steps")}
    recs = {r: [{ph: dict(t.record(s, r, ph)) for ph in t.phases(s, r)} for s in t.rank_steps(r)]
            for r in t.ranks}
    if diverged:
        for phases in (p for per_rank in recs.values() for p in per_rank):
            for view in ("draft_tokens", "hidden_out_fp"):
                if view in phases.get("draft_0", {}):
                    phases["draft_0"][view] = np.asarray(phases["draft_0"][view]) + 1
    for r in t.ranks:
        with pt.TraceWriter(out, r, meta=meta if r == 0 else None) as w:
            for i in range(steps):
                w.write_step(i, recs[r][i % len(recs[r])])
    shutil.rmtree(src)
    return out


def pcp64(out: Path, steps: int = 40) -> Path:
    reqs = [RequestSpec(f"r{i}", 300 + 37 * i, 90, i % 3) for i in range(12)]
    run = generate(reqs, pcp=64, num_speculative_tokens=2, block_size=16, max_num_batched_tokens=2048,
                   max_num_reqs=16, seed=2)
    run.write(out)
    t = pt.open(out)
    if len(t.steps) > steps:  # keep the first `steps` steps
        keep = out.parent / (out.name + "-cut")
        meta = {k: v for k, v in t.meta.items() if k not in (pt.schema.META_SCHEMA_KEY, "num_steps")}
        for r in t.ranks:
            with pt.TraceWriter(keep, r, meta=meta if r == 0 else None) as w:
                for s in t.rank_steps(r)[:steps]:
                    w.write_step(s, {ph: dict(t.record(s, r, ph)) for ph in t.phases(s, r)})
        shutil.rmtree(out)
        keep.rename(out)
    return out


def long_prompt(out: Path) -> Path:
    run = long_prompt_run(pcp=8, prompt_len=1 << 20, chunk=1 << 18, max_new_tokens=16, num_speculative_tokens=3)
    return run.write(out)


def measure(argv: list[str], timeout: float, root: Path = ROOT) -> tuple[float, float, int | None, float]:
    """(wall seconds, peak RSS in MiB, exit code or None when stopped at ``timeout``, CPU
    seconds: user + system, the command's worker processes included) of ``python -m pcpviz.cli
    argv`` with the pcpviz of ``root``. On a shared machine the CPU seconds are the steadier
    figure: wall time grows with the other users' load, CPU time much less."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "kernels")]))
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "pcpviz.cli", *argv], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=env, cwd=root)  # -m imports from the cwd first
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            return (time.perf_counter() - t0, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status),
                    usage.ru_utime + usage.ru_stime)
        if time.perf_counter() - t0 > timeout:
            p.kill()
            _, status, usage = os.wait4(p.pid, 0)
            return time.perf_counter() - t0, usage.ru_maxrss / 1024, None, usage.ru_utime + usage.ru_stime
        time.sleep(0.05)


def commands(trace: Path, other: Path, work: Path, which: str) -> list[tuple[str, list[str]]]:
    out = [("check", ["check", str(trace)]), ("explain --no-rerun", ["explain", str(trace), "--no-rerun"])]
    if which != "long":
        out += [("diff", ["diff", str(other), str(trace)])]
        if which == "steps":  # a copy is diff's best case: also a run that differs at every step
            out += [("diff, diverged", ["diff", str(trace), str(work / "steps-diverged")])]
        out += [("export --chrome", ["export", str(trace), "--chrome", str(work / "c.json")]),
                ("export --html", ["export", str(trace), "--html", str(work / "r.html")])]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", nargs="+", choices=["steps", "pcp64", "long", "all"], default=["all"])
    ap.add_argument("--steps", type=int, default=100_000, help="steps of the 'steps' scenario")
    ap.add_argument("--keep", type=Path, default=None, help="write the traces here (kept)")
    ap.add_argument("--timeout", type=float, default=600.0, help="stop a command after this many seconds")
    ap.add_argument("--json", type=Path, default=ROOT / "data" / "bench" / "scale_cpu.json",
                    help="write the table here (JSON)")
    ap.add_argument("--only", nargs="+", default=None, metavar="CMD",
                    help="run only these commands (check, explain, diff, chrome, html)")
    ap.add_argument("--baseline", type=Path, default=None, metavar="ROOT",
                    help="also run each command with the pcpviz of this checkout (e.g. an older main), "
                         "right after this one's, under the same load: the ratio is the figure to read")
    args = ap.parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="pcpviz-bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    scenarios = ["long", "pcp64", "steps"] if "all" in args.scenario else args.scenario
    rows = []
    for sc in scenarios:
        t0 = time.perf_counter()
        trace = work / sc
        if not trace.exists():
            {"steps": lambda: tiny_steps(trace, args.steps), "pcp64": lambda: pcp64(trace),
             "long": lambda: long_prompt(trace)}[sc]()
        other = work / f"{sc}-copy"
        if not other.exists():
            shutil.copytree(trace, other)
        if sc == "steps" and not (work / "steps-diverged").exists():
            tiny_steps(work / "steps-diverged", args.steps, diverged=True)
        t = pt.open(trace)
        size = sum(f.stat().st_size for f in trace.iterdir()) / 2**20
        tokens = sum(int(np.asarray(t.record(s, t.ranks[0], "target")["positions"]).shape[0])
                     for s in t.rank_steps(t.ranks[0]) if t.has(s, t.ranks[0], "target"))
        shape = dict(steps=len(t.steps), ranks=len(t.ranks), tokens=tokens, mib=round(size, 1))
        del t
        print(f"{sc}: {shape} (generated in {time.perf_counter() - t0:.0f} s)", flush=True)
        for name, cmd in commands(trace, other, work, sc):
            if args.only and not any(word in name for word in args.only):
                continue
            load = os.getloadavg()[0]
            wall, rss, rc, cpu = measure(cmd, args.timeout)
            rows.append(dict(scenario=sc, **shape, command=f"pcpviz {name}", seconds=round(wall, 2),
                             cpu_seconds=round(cpu, 2), peak_rss_mib=round(rss), exit=rc, load_before=round(load, 2)))
            print(f"  {name:20s} {wall:8.1f} s {cpu:8.1f} CPU s {rss:8.0f} MiB  exit {rc}  (load {load:.1f})",
                  flush=True)
            if args.baseline is not None:
                bwall, brss, brc, bcpu = measure(cmd, args.timeout, args.baseline.resolve())
                rows[-1].update(baseline_seconds=round(bwall, 2), baseline_cpu_seconds=round(bcpu, 2),
                                baseline_peak_rss_mib=round(brss), baseline_exit=brc,
                                speedup=round(bwall / wall, 2) if brc is not None and rc is not None else None,
                                cpu_ratio=round(bcpu / cpu, 2) if brc is not None and rc is not None else None)
                print(f"  {'  baseline':20s} {bwall:8.1f} s {bcpu:8.1f} CPU s {brss:8.0f} MiB  exit {brc}",
                      flush=True)
    print("\n| scenario | steps | ranks | tokens | command | wall (s) | CPU (s) | peak RSS (MiB) | exit |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        wall = f"{r['seconds']:.1f}" if r["exit"] is not None else f"> {args.timeout:.0f} (stopped)"
        print(f"| {r['scenario']} | {r['steps']} | {r['ranks']} | {r['tokens']} | `{r['command']}` | {wall} | "
              f"{r['cpu_seconds']:.1f} | {r['peak_rss_mib']} | {r['exit']} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(
            command="python benchmarks/bench_scale.py " + " ".join(sys.argv[1:] if argv is None else argv),
            machine=f"{os.cpu_count()} CPUs (shared), {platform.platform()}", timeout_s=args.timeout,
            baseline=None if args.baseline is None else str(args.baseline),
            note="one run; wall time, CPU time (user + system, workers included) and peak RSS (wait4) of each "
                 "command in its own process", rows=rows),
            indent=1) + "\n")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
