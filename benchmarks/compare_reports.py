"""Byte-compare ``pcpviz check --json`` and ``pcpviz explain --json --no-rerun`` of this checkout
against another (``--baseline``, e.g. ``../main``) on trace directories: the outputs must be
equal but for the lines giving run times (``"seconds":``). A check, not a benchmark: exit 1 when
any output differs (the first differing lines are printed).

    .venv/bin/python benchmarks/compare_reports.py --baseline ../main data/traces/* /tmp/traces/*
    .venv/bin/python benchmarks/compare_reports.py --html --baseline ../main data/traces/*   # export --html

``--html`` compares ``pcpviz export --html`` instead: the exit code, and the page data
(``pcpviz.views.export.html.embedded_data``, unpacked) of the two pages; it says whether the
files are byte-identical too.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = (("check", "--json"), ("explain", "--json", "--no-rerun"))


def run(checkout: Path, cmd: tuple[str, ...], trace: Path) -> tuple[int, list[str]]:
    """(exit code, stdout lines but the run-time ones) of ``pcpviz CMD TRACE`` in ``checkout``."""
    env = dict(os.environ, PYTHONPATH=f"{checkout}:{checkout / 'kernels'}")
    p = subprocess.run([sys.executable, "-m", "pcpviz.cli", *cmd, str(trace)], env=env, cwd=checkout,
                       capture_output=True, text=True, timeout=1800)
    return p.returncode, [ln for ln in p.stdout.splitlines() if '"seconds":' not in ln]


def export_html(checkout: Path, trace: Path, out: Path) -> int:
    """Exit code of ``pcpviz export TRACE --html OUT`` in ``checkout``."""
    env = dict(os.environ, PYTHONPATH=f"{checkout}:{checkout / 'kernels'}")
    return subprocess.run([sys.executable, "-m", "pcpviz.cli", "export", str(trace), "--html", str(out)], env=env,
                          cwd=checkout, capture_output=True, text=True, timeout=1800).returncode


def compare_html(baseline: Path, traces: list[Path]) -> int:
    """Differing ``export --html`` pages (exit code or page data) of the traces, one line each."""
    from pcpviz.views.export.html import embedded_data  # noqa: PLC0415 - this checkout's reader

    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for trace in traces:
            if not (trace / "run.json").is_file():
                continue
            a, b = Path(tmp) / "old.html", Path(tmp) / "new.html"
            codes = export_html(baseline, trace, a), export_html(ROOT, trace, b)
            pages = [embedded_data(p.read_text(encoding="utf-8")) if p.is_file() else None for p in (a, b)]
            same = codes[0] == codes[1] and pages[0] == pages[1]
            ident = a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()
            bad += not same
            print(f"{'same' if same else 'DIFFERS'}  export --html  exit {codes[1]}  "
                  f"{'byte-identical' if ident else 'bytes differ'}  {trace}")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="the other checkout")
    ap.add_argument("--html", action="store_true", help="compare export --html (page data) instead")
    ap.add_argument("traces", nargs="+", type=Path)
    args = ap.parse_args(argv)
    if args.html:
        return 1 if compare_html(args.baseline.resolve(), args.traces) else 0
    bad = 0
    for trace in args.traces:
        if not (trace / "run.json").is_file():
            continue
        for cmd in COMMANDS:
            old, new = run(args.baseline.resolve(), cmd, trace), run(ROOT, cmd, trace)
            same = old == new
            bad += not same
            print(f"{'same' if same else 'DIFFERS'}  {' '.join(cmd):28s} exit {new[0]}  {trace}")
            if not same:
                diff = [(i, a, b) for i, (a, b) in enumerate(zip(old[1], new[1])) if a != b][:3]
                print(f"    exit {old[0]} vs {new[0]}, {len(old[1])} vs {len(new[1])} lines; first: {diff}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
