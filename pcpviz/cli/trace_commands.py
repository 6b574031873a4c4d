"""The commands that read a trace: ``pcpviz check``, ``diff``, ``export`` and ``explain``, each
opening its traces the same way (a bad trace is one line and exit 2, lost data one
``incomplete:`` line each and exit 3).

    pcpviz check runs/demo
    pcpviz diff runs/demo runs/bad
    pcpviz export runs/demo --html runs/demo.html
    pcpviz explain runs/bad runs/demo
"""

from __future__ import annotations

import argparse
import json
import sys

from pcpviz.cli.guard import (EXIT_FAILED, EXIT_OK, Incomplete, UsageError, exit_code, path,
                              terminal_safe, trace_verdict)
from pcpviz.trace.schema import MalformedValue
from pcpviz.trace.outputs import check_output, special_kind

__all__ = ["add_check", "add_diff", "add_export", "add_explain", "EXPORT_FORMATS"]


def open_trace_arg(path: str, cmd: str, *, require_steps: bool = False):
    """``pcpviz.trace.open`` and ``pcpviz.trace.validate``: a bad trace or an invalid run.json is
    one-line exit-2 input; lost data (open's warnings among it) is one ``incomplete:`` line
    each on stderr. Returns ``(trace, status)``."""
    import warnings

    from pcpviz.trace import open as open_trace

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")  # each is reported below as an 'incomplete:' line
        try:
            trace = open_trace(path)
            status = trace_verdict(trace, cmd)
        except ValueError as e:  # TraceError, invalid run.json
            raise UsageError(f"pcpviz {cmd}: {' '.join(str(e).split())}") from None
    if require_steps and not trace.steps:
        _no_steps(path, cmd, status)
    return trace, status


class _Reported(Incomplete):
    """Exit 3 whose one line (the trace's 'incomplete: ... (damaged data)') is already on stderr."""


def _damaged(*statuses) -> bool:
    """A value no integer view can hold was found on open (``pcpviz.trace.values``): a command
    that then fails on that value exits 3 with the line already printed, not a second one."""
    return any(p.message.endswith("(damaged data)") for st in statuses for p in st.problems)


def _no_steps(path: str, cmd: str, status) -> None:
    """A trace without one complete step: lost data (exit 3) if its status says data was lost
    (the rank files are missing or damaged), else bad input (exit 2)."""
    if not status.complete:
        raise Incomplete(f"pcpviz {cmd}: incomplete: {path}: no complete step is left")
    raise UsageError(f"pcpviz {cmd}: {path}: the trace has no complete steps")


def _cmd_check(args: argparse.Namespace) -> int:
    from pcpviz.analysis.checks import run_checks
    from pcpviz.analysis.producers import attribute_violation

    trace, status = open_trace_arg(args.trace, "check", require_steps=True)
    try:
        report = run_checks(trace, status=status)
    except ValueError as e:  # a payload that fails its checksum while being read
        raise UsageError(f"pcpviz check: {e}") from None
    who = attribute_violation(trace, report)
    if args.json:
        print(json.dumps({**report.to_dict(), "producer": None if who is None else who.to_dict()}, indent=1))
    else:
        print(report.format() + ("" if who is None else f"\n  first wrong value: {who.line()}"))
    return exit_code(status, not report.failed)


def add_check(sub) -> None:
    p = sub.add_parser("check", help="check a trace against vLLM's PCP + MTP invariants",
                       description="Run every pcpviz.analysis.checks check over every step and rank. "
                                   "run.json is validated first (schema, and against the data: "
                                   "pcp vs rank files, K vs draft phases, block size, steps). "
                                   "Exit 0 all pass (skipped checks are reported), 1 a check "
                                   "failed, 2 unreadable trace or invalid run.json, 3 incomplete "
                                   "trace (a rank file missing or unreadable, steps lost after a "
                                   "damaged record or missing on some ranks, a run unfinished, stopped "
                                   "early or still being written: one 'incomplete:' line each on "
                                   "stderr; the checks still run on what is left).")
    p.add_argument("trace", type=path, help="run directory (or its run.json)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_check)


def _cmd_diff(args: argparse.Namespace) -> int:
    from pcpviz.analysis.diff import diff_traces
    from pcpviz.analysis.producers import attribute_divergence

    a, status_a = open_trace_arg(args.a, "diff")
    b, status_b = open_trace_arg(args.b, "diff")
    try:
        report = diff_traces(a, b)
    except ValueError as e:
        if _damaged(status_a, status_b):
            raise _Reported("") from None
        raise UsageError(f"pcpviz diff: {e}") from None
    who = attribute_divergence(b, report)
    if args.json:
        print(json.dumps({**report.to_dict(), "producer": None if who is None else who.to_dict()}, indent=1))
    else:
        print(report.format() + ("" if who is None else f"\n  first divergent value: {who.line()}"))
    if not (status_a.complete and status_b.complete):
        return exit_code(status_a if not status_a.complete else status_b, report.same)
    return EXIT_OK if report.same else EXIT_FAILED


def add_diff(sub) -> None:
    p = sub.add_parser("diff", help="compare two runs of the same prompts",
                       description="First divergent step/phase/view/rank and acceptance per "
                                   "position side by side. Exit 0 same, 1 differ, 2 bad input, "
                                   "3 a trace is incomplete.")
    p.add_argument("a", type=path, help="run directory A (the reference: 'expected')")
    p.add_argument("b", type=path, help="run directory B ('actual')")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_diff)


# Export formats: flag -> (help, "module:function"); the function is called as
# function(trace, out) -> path or list of paths.
EXPORT_FORMATS: dict[str, tuple[str, str]] = {
    "chrome": ("Chrome trace for Perfetto / HTA: OUT.json = one merged file, otherwise a "
               "directory of rank<r>.json", "pcpviz.views.export.chrome:export_chrome"),
    "html": ("self-contained HTML report", "pcpviz.views.export.html:export_html"),
}


def _exporter(fmt: str):
    import importlib

    module, func = EXPORT_FORMATS[fmt][1].split(":")
    return getattr(importlib.import_module(module), func)


def _cmd_export(args: argparse.Namespace) -> int:
    wanted = [(fmt, getattr(args, fmt)) for fmt in EXPORT_FORMATS if getattr(args, fmt)]
    if not wanted:
        raise UsageError("pcpviz export: nothing to export; give "
                         + " or ".join(f"--{f} OUT" for f in EXPORT_FORMATS))
    if args.rank and not args.html:
        raise UsageError("pcpviz export: --rank chooses the HTML report's ranks; give --html OUT too")
    for fmt, out in wanted:  # a device, FIFO or socket (or a link to one) is refused before any work
        if special_kind(out) not in (None, "a directory"):
            try:
                check_output(out, f"--{fmt}")
            except ValueError as e:
                raise UsageError(f"pcpviz export: {e}") from None
    writers = [(fmt, out, _exporter(fmt)) for fmt, out in wanted]
    trace, status = open_trace_arg(args.trace, "export")
    if not trace.steps and not status.complete:
        _no_steps(args.trace, "export", status)
    for fmt, out, fn in writers:
        try:
            written = fn(trace, out, ranks=args.rank) if fmt == "html" and args.rank else fn(trace, out)
        except (MalformedValue, OverflowError, ValueError) as e:
            if not (_damaged(status) or isinstance(e, (MalformedValue, OverflowError))):
                raise UsageError(f"pcpviz export: --{fmt} {out}: {' '.join(str(e).split())}") from None
            if _damaged(status):  # inf, NaN, 2.5 where an integer view is declared: said on open
                raise _Reported("") from None
            raise Incomplete(f"pcpviz export: incomplete: {args.trace}: {' '.join(str(e).split())} "
                             f"(damaged data; --{fmt} {out} not written)") from None
        except OSError as e:
            raise UsageError(f"pcpviz export: --{fmt} {out}: {' '.join(str(e).split())}") from None
        for shown in ([written] if isinstance(written, (str, bytes)) or not hasattr(written, "__iter__")
                     else written):
            print(f"wrote {shown}")
    return exit_code(status, True)


def add_export(sub) -> None:
    p = sub.add_parser("export", help="export a trace (Chrome trace, HTML report)",
                       description="Write a trace in other formats; several at once are allowed. "
                                   "Exit 0 written, 2 bad input, 3 written but the trace is "
                                   "incomplete (one 'incomplete:' line each on stderr).")
    p.add_argument("trace", type=path, help="run directory (or its run.json)")
    for fmt, (text, _) in EXPORT_FORMATS.items():
        p.add_argument(f"--{fmt}", type=path, metavar="OUT", default=None, help=text)
    p.add_argument("--rank", type=int, action="append", default=None, metavar="R",
                   help="the HTML report's ranks (repeatable; default: every rank up to 8, else 8 evenly "
                        "sampled plus those of first violations)")
    p.set_defaults(func=_cmd_export)


def _say_rerun(trace) -> None:
    """Up front on stderr: what explain re-runs without GOOD, roughly how long, how to skip it."""
    from pcpviz.analysis.explain import other_producer, rerun_plan

    plan, why = rerun_plan(trace)
    if plan is None:
        return
    n, new = len(plan["prompts"]), plan["max_new_tokens"]
    other = other_producer(trace)
    print(terminal_safe(
        f"pcpviz explain: no GOOD run given: re-running the {n} prompt{'s' * (n > 1)} on pcpviz's engine as the "
        f"reference (PCP {plan['pcp']}, K {plan['num_speculative_tokens']}, {n * new} tokens to generate; the "
        f"engine's start-up plus generation, typically tens of seconds on CPU)"
        + (f"; {other}, so only the checks and prompts count, not its differences" if other else "")
        + "; --no-rerun skips it"), file=sys.stderr, flush=True)


def add_explain(sub) -> None:
    def run(args: argparse.Namespace) -> int:
        from pcpviz.analysis.explain import explain

        bad, status = open_trace_arg(args.bad, "explain", require_steps=True)
        good = None if args.good is None else open_trace_arg(args.good, "explain", require_steps=True)[0]
        if good is None and not args.no_rerun:
            _say_rerun(bad)
        try:
            report = explain(bad, good, rerun=not args.no_rerun, status=status, progress=not args.json)
        except ValueError as e:  # a payload that fails its checksum while being read
            if _damaged(status):
                raise _Reported("") from None
            raise UsageError(f"pcpviz explain: {' '.join(str(e).split())}") from None
        print(json.dumps(report.to_dict(), indent=1) if args.json else report.format())
        return exit_code(status, report.ok)

    p = sub.add_parser("explain", help="from 'acceptance dropped' to the most likely cause",
                       description="Rank the registered faults (pcpviz run --list-faults) against the "
                                   "evidence: the checks, the diff against GOOD (a good run of the same "
                                   "prompts; without GOOD, an engine re-run of BAD's prompts with the same "
                                   "PCP, K and block size), acceptance per position / request / step / "
                                   "rank, KV replica agreement and the step of the first violation. Says "
                                   "plainly when nothing matches. Exit 0 nothing wrong, 1 a cause found or "
                                   "acceptance dropped, 2 bad input, 3 incomplete trace.")
    p.add_argument("bad", type=path, help="run directory to explain")
    p.add_argument("good", type=path, nargs="?", default=None, help="a good run of the same prompts (the reference)")
    p.add_argument("--no-rerun", action="store_true", help="without GOOD, do not re-run the prompts on the engine")
    p.add_argument("--json", action="store_true", help="print the explanation as JSON")
    p.set_defaults(func=run)
