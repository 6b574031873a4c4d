"""Diagnosis benchmark: realistic PCP + MTP bugs outside the fault catalogue, and harmless
refactors (``pcpviz.analysis.mutations``), each patched into a copy of the package, run on the CPU
engine at two settings, and judged by ``check``, ``diff BAD GOOD`` and ``explain BAD GOOD`` (the
unpatched package judges). Prints one row per (mutation, setting) and the totals against the
targets of issue 22: 0 confidently wrong causes, >= 90% first evidence at the bug's own phase
and view, >= 90% failing check, 0 CLEAN on a run that differs, 0 alarms on harmless refactors.

    PYTHONPATH=$PWD:$PWD/kernels python benchmarks/bench_diagnosis.py            # everything (~30 min on 2 cores)
    PYTHONPATH=$PWD:$PWD/kernels python benchmarks/bench_diagnosis.py --settings pcp2-k2 --only extra_accepted_draft
    PYTHONPATH=$PWD:$PWD/kernels python benchmarks/bench_diagnosis.py --part vllm   # vLLM's code, CPU replay

The named producer (``pcpviz.analysis.producers``: who wrote the first wrong value) is scored too: it
must be the patched function (the engine: the function of the patched file holding the patch;
vLLM: the function ``pcpviz.analysis.vllm_mutations`` replaced), and never a wrong one named "sure".

A bug a setting never exercises (its run equals the clean one: e.g. a partial-chunk bug without
chunked prefill) is listed as "not exercised" and left out of the rates.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pcpviz
from pcpviz.analysis.checks import run_checks
from pcpviz.analysis.diff import diff_traces
from pcpviz.analysis.explain import CLEAN, FAULT, explain
from pcpviz.analysis.mutations import MUTATIONS, Mutation, copy_package, run_planted
from pcpviz.analysis.producers import INSIDE, attribute_divergence, attribute_violation, patched_function
from pcpviz.analysis.vllm_mutations import VLLM_MUTATIONS, VllmMutation, planted
from pcpviz.trace import open as open_trace

ROOT = Path(__file__).resolve().parents[1]
A = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
     "class Stack:\n    def __init__(self):\n        self.items = []\n"]
C = ["while True:\n    line = ", "print(", "def area(r):\n    return 3.14 * ", "if __name__ == '__main__':\n    ",
     "import json\n\n\ndef load(path):\n    with open(path) as f:\n        return "]
SETTINGS = {  # name: run options (the second cuts prompts into chunks: chunked prefill)
    "pcp2-k2": dict(prompts=A, pcp=2, num_speculative_tokens=2, block_size=8, max_new_tokens=16,
                    max_num_batched_tokens=48),
    "pcp4-k3-chunked": dict(prompts=C, pcp=4, num_speculative_tokens=3, block_size=8, max_new_tokens=16,
                            max_num_batched_tokens=16),
}


@dataclass(frozen=True)
class Row:
    mutation: str
    setting: str
    harmless: bool
    ran: bool  # the patched engine finished its run
    note: str  # why not (one line)
    diverges: bool
    check_fails: bool
    at_own_place: bool
    first: str
    verdict: str
    top: str | None
    named: str = "-"  # the producer check (else diff) names for the first wrong value
    producer_right: bool = False  # it is the function the mutation patched
    producer_sure: bool = False  # named as "the fault is inside it", sure

    @property
    def exercised(self) -> bool:
        return self.ran and (self.diverges or self.check_fails)

    @property
    def confidently_wrong(self) -> bool:
        return not self.harmless and self.verdict == FAULT

    @property
    def clean_on_difference(self) -> bool:
        return self.verdict == CLEAN and self.diverges

    @property
    def producer_confidently_wrong(self) -> bool:
        return not self.harmless and self.producer_sure and not self.producer_right

    @property
    def alarm(self) -> bool:
        return self.harmless and (not self.ran or self.diverges or self.check_fails or self.verdict != CLEAN)


def run_engine(setting: str, trace_dir: Path, package_root: Path | None) -> str | None:
    """Run ``setting`` with the package under ``package_root`` (None: this one); None or the
    error's last line."""
    opts = dict(SETTINGS[setting])
    try:
        run_planted(package_root, opts.pop("prompts"), trace_dir, **opts)
    except RuntimeError as exc:
        return str(exc).split(" failed: ", 1)[-1]
    return None


def judge(m: Mutation, setting: str, bad: Path, good: Path) -> Row:
    report = run_checks(bad)
    d = diff_traces(good, bad)
    e = explain(bad, good)
    v = report.first_violation
    first = "-" if v is None else f"s{v.step} {v.phase}.{v.view} r{v.rank} ({v.check})"
    tb = open_trace(bad)
    who = attribute_violation(tb, report) or attribute_divergence(tb, d)
    named = "-" if who is None or who.producer is None else who.producer
    if isinstance(m, VllmMutation):  # the vLLM map's name of the patched function
        right = not m.harmless and named == m.producer
    else:  # the engine: the function of the patched file holding the patch
        want = None if m.harmless else patched_function(m.file, m.old)
        right = want is not None and who is not None and who.cite is not None and \
            who.cite.split(":")[0] == f"pcpviz/{m.file}" and named.split(".")[-1] == want.split(".")[-1]
    sure = who is not None and who.verdict == INSIDE and who.sure.startswith("sure")
    return Row(m.name, setting, m.harmless, True, "", d.first is not None, bool(report.failed),
               v is not None and m.at_own_place(v.phase, v.view), first, e.verdict,
               None if e.top is None else e.top.fault, named, right, sure)


def bench(settings, names=None, work: Path | None = None) -> list[Row]:
    muts = [m for m in MUTATIONS if names is None or m.name in names]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="pcpviz-bench-diag-", dir=work) as tmp:
        tmp = Path(tmp)
        src = Path(pcpviz.__file__).resolve().parent
        for s in settings:
            good = tmp / s / "good"
            err = run_engine(s, good, None)
            if err:
                raise RuntimeError(f"the clean run of {s} failed: {err}")
            for m in muts:
                root = tmp / s / m.name / "pkg"
                copy_package(src, root)
                (root / "data").symlink_to(ROOT / "data")  # the model weights the engine loads
                m.apply(root)
                bad = tmp / s / m.name / "trace"
                err = run_engine(s, bad, root)
                if err:
                    rows.append(Row(m.name, s, m.harmless, False, err, False, False, False, "-", "RUN FAILED", None))
                else:
                    rows.append(judge(m, s, bad, good))
                print(_line(rows[-1]), flush=True)
    return rows


VLLM_SETTINGS = {  # the CPU replay of vLLM's own classes (pcpviz.vllm.replay): scripted scenario, ranks as threads
    "replay-pcp2-k3-mixed": dict(pcp=2, mtp=3, scenario="mixed"),
    # vLLM's default CUDA-graph mode: the draft forwards dispatched PIECEWISE / FULL (stand-in graphs that read
    # their capture buffers), with pcpviz.vllm.fixes on: without them the clean run already fails
    # forward_consumed_prepared (docs/findings/piecewise-draft-prefill.md, full-draft-prefill-state.md)
    "replay-pcp4-k2-full-fixed": dict(pcp=4, mtp=2, scenario="mixed", graph_mode="FULL_AND_PIECEWISE", fixes="all"),
}


def bench_vllm(settings, names=None, work: Path | None = None) -> list[Row]:
    """Plant each ``VLLM_MUTATIONS`` bug in vLLM's own function, replay on CPU, judge against the
    clean replay (one process: vLLM is imported once; each bug is undone after its replay)."""
    from pcpviz.vllm.replay import replay  # imports vLLM (slow): only for this part

    muts = [m for m in VLLM_MUTATIONS if names is None or m.name in names]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="pcpviz-bench-diag-vllm-", dir=work) as tmp:
        for s in settings:
            good = Path(tmp) / s / "good"
            replay(trace_dir=good, **VLLM_SETTINGS[s])
            for m in muts:
                bad = Path(tmp) / s / m.name
                try:
                    with planted(m):
                        replay(trace_dir=bad, **VLLM_SETTINGS[s])
                except Exception as exc:  # noqa: BLE001 - a planted bug may crash vLLM's code: a row, not an abort
                    rows.append(Row(m.name, s, m.harmless, False, f"{type(exc).__name__}: {exc}"[:160], False, False,
                                    False, "-", "RUN FAILED", None))
                else:
                    rows.append(judge(m, s, bad, good))
                print(_line(rows[-1]), flush=True)
    return rows


def _line(r: Row) -> str:
    yn = lambda b: "yes" if b else "no"  # noqa: E731
    if not r.ran:
        return f"| {r.mutation} | {r.setting} | run failed: {r.note} | | | | | |"
    if not r.exercised and not r.harmless:
        return f"| {r.mutation} | {r.setting} | not exercised (run equals the clean one) | | | | | |"
    verdict = r.verdict + (f" {r.top}" if r.top else "")
    flag = "ALARM" if r.alarm else ("CONFIDENTLY WRONG" if r.confidently_wrong else
                                    "CLEAN ON A DIFFERENCE" if r.clean_on_difference else "ok")
    named = "-" if r.harmless else f"{yn(r.producer_right)} (`{r.named}`{', sure' if r.producer_sure else ''})"
    return (f"| {r.mutation}{' (refactor)' if r.harmless else ''} | {r.setting} | {yn(r.check_fails)} | "
            f"{yn(r.at_own_place)} ({r.first}) | {yn(r.diverges)} | {verdict} | {named} | {flag} |")


HEADER = ("| mutation | setting | check fails? | first evidence at the bug's phase/view? | diff diverges? | "
          "explain verdict | named producer is the patched function? | |\n|---|---|---|---|---|---|---|---|")


def summary(rows: list[Row]) -> dict:
    bugs = [r for r in rows if not r.harmless and r.exercised]
    ref = [r for r in rows if r.harmless]
    n = max(len(bugs), 1)
    return {"bugs_exercised": len(bugs),
            "not_exercised": sum(not r.harmless and r.ran and not r.exercised for r in rows),
            "run_failed": sum(not r.ran and not r.harmless for r in rows),
            "check_fails": sum(r.check_fails for r in bugs) / n,
            "first_evidence_at_own_place": sum(r.at_own_place for r in bugs) / n,
            "diff_diverges": sum(r.diverges for r in bugs) / n,
            "confidently_wrong": sum(r.confidently_wrong for r in bugs),
            "producer_named_right": sum(r.producer_right for r in bugs) / n,
            "producer_confidently_wrong": sum(r.producer_confidently_wrong for r in bugs),
            "clean_on_difference": sum(r.clean_on_difference for r in rows),
            "refactors": len(ref), "refactor_alarms": sum(r.alarm for r in ref)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--only", nargs="*", default=None, help="mutation names (default: all)")
    ap.add_argument("--part", choices=("engine", "vllm", "all"), default="all",
                    help="engine: bugs in the engine (pcpviz.analysis.mutations); vllm: bugs in vLLM's own code "
                         "replayed on CPU (pcpviz.analysis.vllm_mutations); all: both")
    a = ap.parse_args(argv)
    print(HEADER)
    rows = []
    if a.part in ("engine", "all"):
        rows += bench(a.settings, a.only)
    if a.part in ("vllm", "all"):
        rows += bench_vllm(list(VLLM_SETTINGS), a.only)
    vllm = {m.name for m in VLLM_MUTATIONS}
    parts = {"engine": [r for r in rows if r.mutation not in vllm],
             "vllm-replay": [r for r in rows if r.mutation in vllm]}
    print(json.dumps({k: summary(v) for k, v in parts.items() if v}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
