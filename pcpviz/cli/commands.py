"""pcpviz: vLLM 0.33.0's Prefill Context Parallel (PCP) + MTP data path, rank by rank.

    pcpviz layout --pcp 2 --batch p13,d1,d4          # DualChunkSwap rows, maps, write mask
    pcpviz layout --pcp 4 --batch p40,d2@31 --decodes replicated --dcp 4 --pad 48
    pcpviz layout --pcp 2 --batch p13,d1 --json      # the layout as JSON
    pcpviz run --pcp 2 --mtp 2 --device cpu --prompt "def f(" --trace runs/demo --json out.json
    pcpviz run --list-faults
    pcpviz check runs/demo                            # every invariant, first violation named
    pcpviz diff runs/demo runs/bad                    # first divergence + acceptance
    pcpviz explain runs/bad runs/demo                 # the most likely cause, with the evidence
    pcpviz export runs/demo --html runs/demo.html
    pcpviz replay --pcp 2 --mtp 2 --trace runs/vllm   # the real vLLM code on CPU

Also `python -m pcpviz ...`. Exit codes: 0 ok, 1 a check failed or runs differ, 2 bad input
(one-line reason on stderr; an invalid run.json too), 3 incomplete trace (data lost: a missing or
unreadable rank file, steps dropped after a damaged record, steps missing on some ranks; one
"incomplete:" line each on stderr; a run that did not finish or is being written), 130/143
`pcpviz run` stopped by SIGINT/SIGTERM (its trace marked partial), 141 stdout closed early (| head).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Callable, Sequence

from pcpviz.cli.guard import (EXIT_INCOMPLETE, bounded_int, check_output_file, exit_code, named_stdout, path,
                              read_prompts_file, seconds, system_error, trace_verdict)

_STARTED = time.monotonic()  # the command's wall time counts from here (its imports included)

__all__ = ["main", "UsageError"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
MAX_WORLD = 1024  # --pcp / --dcp of the layout command
MAX_LAYOUT_TOKENS, MAX_LAYOUT_ROWS = 1 << 16, 4096  # what a text diagram can show


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class Incomplete(Exception):
    """Nothing left to work on because data was lost: one 'incomplete:' line, exit code 3."""


class _Help(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (examples keep their lines); every option that has a default
    shows it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" not in text and action.option_strings and action.default not in (
                None, False, argparse.SUPPRESS) and not action.required:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        raise UsageError(f"{self.prog}: {message}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _cmd_layout(args: argparse.Namespace) -> int:
    from pcpviz.reference.batchspec import DEFAULT_DECODE_CURSOR, parse_batch_spec, row_name
    from pcpviz.views.diagram import render_layout
    from pcpviz.reference.layout import plan_layout

    try:
        spec = parse_batch_spec(args.batch)
        if len(spec.kinds) > MAX_LAYOUT_ROWS or sum(spec.num_scheduled_tokens) > MAX_LAYOUT_TOKENS:
            raise ValueError(f"{len(spec.kinds)} rows, {sum(spec.num_scheduled_tokens)} tokens: the "
                             f"layout command draws at most {MAX_LAYOUT_ROWS} rows and "
                             f"{MAX_LAYOUT_TOKENS} tokens")
        shard = None if args.decodes == "auto" else args.decodes == "sharded"
        plan = lambda pad: plan_layout(  # noqa: E731
            spec.num_scheduled_tokens, spec.is_prefilling, args.pcp,
            shard_decode_requests=shard, dcp_world_size=args.dcp, padded_num_tokens=pad)
        layout = plan(None)
    except ValueError as e:
        batch = args.batch if len(args.batch) <= 60 else f"{args.batch[:40]}... ({len(args.batch)} characters)"
        raise UsageError(f"pcpviz layout: --batch {batch!r}: {e}") from None
    if args.pad is not None:  # a --pad too small for this batch is --pad's fault, not --batch's
        try:
            layout = plan(args.pad)
        except ValueError as e:
            raise UsageError(f"pcpviz layout: --pad {args.pad}: {e}") from None
    names = [row_name(i) for i in range(len(spec.kinds))]  # A, B, ...: 'd1' would read as a decode
    specs = [f"{k}{q}" + ("" if c == (0 if k == "p" else DEFAULT_DECODE_CURSOR) else f"@{c}")
             for k, q, c in zip(spec.kinds, spec.num_scheduled_tokens, spec.num_computed_tokens)]
    if args.json:
        doc = {
            "pcp": layout.pcp_world_size,
            "dcp": layout.dcp_world_size,
            "shard_decode_requests": layout.shard_decode_requests,
            "req_ids": names,
            "rows": specs,
            "segments_by_rank": [
                [dict(global_req_idx=s.global_req_idx, global_start=s.global_start,
                      global_stop=s.global_stop, local_start=s.local_start, local_stop=s.local_stop)
                 for s in segs]
                for segs in layout.segments_by_rank
            ],
            "per_rank_num_tokens": list(layout.per_rank_num_tokens),
            "padded_num_tokens": layout.padded_num_tokens,
            "padded_gather_idx": layout.padded_gather_idx.tolist(),
            "hidden_restore_idx": layout.hidden_restore_idx.tolist(),
            "kv_write_mask": layout.kv_write_mask.tolist(),
        }
        print(json.dumps(doc, indent=1))
    else:
        print(render_layout(layout, names, row_specs=specs))
    return EXIT_OK


def _add_layout(sub) -> None:
    p = sub.add_parser("layout", help="draw the PCP layout of a batch",
                       description="How vLLM 0.33.0 splits one batch over PCP ranks (DualChunkSwap): "
                                   "each rank's rows, the all-gather and restore maps, the KV write "
                                   "mask. Requests are named A, B, ... in the order of --batch.")
    p.add_argument("--pcp", type=bounded_int(1, MAX_WORLD), required=True, help="PCP world size N")
    p.add_argument("--batch", required=True,
                   help="rows like p13,p10@12,d4@20: p<tokens> a prefill (@ = tokens already computed), "
                        "d<tokens> a decode of 1 + drafts (@ = its position)")
    p.add_argument("--dcp", type=bounded_int(1, MAX_WORLD), default=1, help="DCP world size")
    p.add_argument("--decodes", choices=["auto", "sharded", "replicated"], default="auto",
                   help="decode placement; auto = vLLM's default (sharded iff DCP == 1)")
    p.add_argument("--pad", type=bounded_int(1, MAX_LAYOUT_TOKENS), default=None,
                   help="CUDA-graph token count P per rank (default: the largest rank's tokens)")
    p.add_argument("--json", action="store_true", help="print the layout as JSON")
    p.set_defaults(func=_cmd_layout)


def _cmd_run(args: argparse.Namespace) -> int:
    if args.list_faults:
        from pcpviz.faults import ENGINE, faults_of

        for fault in faults_of(ENGINE).values():
            print(f"{fault.name}\n    {fault.summary}\n    vLLM: {fault.where}\n    caught by: {fault.caught_by}")
        return EXIT_OK
    from pcpviz.engine.launch import RankError, RunInterrupted, run

    prompts = list(args.prompt or [])
    try:
        for path, option in ((args.json, "--json"), (args.write_config, "--write-config")):
            if path:
                check_output_file(path, option)
        prompts += read_prompts_file(args.prompts_file) if args.prompts_file else []
    except ValueError as e:
        raise UsageError(f"pcpviz run: {e}") from None
    if not prompts:
        raise UsageError("pcpviz run: give at least one --prompt or --prompts-file")
    if args.write_config:
        return _write_rank_config(args, prompts)
    try:
        res = run(prompts, progress=not args.quiet, **_engine_options(args))
    except ValueError as e:
        raise UsageError(f"pcpviz run: {e}") from None
    except (RankError, RunInterrupted) as e:  # a stop: 130 (SIGINT) or 143 (SIGTERM), its trace marked partial
        print(f"pcpviz run: {e}", file=sys.stderr)
        return 128 + e.signum if isinstance(e, RunInterrupted) else EXIT_FAILED
    doc = res.summary()
    for i, text in enumerate(res.texts):
        print(f"--- request {i} ({len(res.output_token_ids[i])} tokens)\n{text}")
    num = lambda x: "-" if math.isnan(x) else f"{x:.2f}"  # noqa: E731 - NaN: nothing was drafted
    rates = ", ".join(num(r) for r in res.acceptance_rate_per_pos)
    print(f"acceptance per position [{rates}]  mean acceptance length {num(res.mean_acceptance_length)}  "
          f"steps {res.num_steps}  engine {res.wall_s:.1f}s, command {time.monotonic() - _STARTED:.1f}s"
          + (f"  trace {res.trace_path}" if res.trace_path else ""),
          flush=True)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
        except OSError as e:  # the run's output is above; only the file is lost
            raise UsageError(f"pcpviz run: --json {args.json}: {' '.join(str(e).split())}") from None
    return EXIT_OK


def _engine_options(args: argparse.Namespace) -> dict:
    """The `pcpviz run` flags as keyword arguments of pcpviz.run / build_config."""
    return dict(pcp=args.pcp, num_speculative_tokens=args.mtp, device=args.device,
                max_new_tokens=args.max_new_tokens, trace_dir=args.trace, inject=args.inject or (),
                max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, dtype=args.dtype,
                model_dir=args.model, timeout_s=args.timeout, overwrite=args.overwrite)


def _write_rank_config(args: argparse.Namespace, prompts: list[str]) -> int:
    """Write the rank config for torchrun (multi-host) instead of launching the ranks here: the
    GPUs are counted on the hosts that run the ranks, not on this one."""
    import os

    from pcpviz.engine.launch import build_config, start_trace

    try:
        cfg = build_config(prompts, count_local_devices=False, **_engine_options(args))
        work = os.path.abspath(os.path.splitext(args.write_config)[0] + "-work")
        os.makedirs(work, exist_ok=True)
        cfg["work_dir"] = work
        if cfg["trace_dir"]:
            start_trace(cfg, "pcpviz run --write-config").release()  # the ranks create their files
        with open(args.write_config, "w") as f:
            json.dump(cfg, f)
    except (ValueError, OSError) as e:
        raise UsageError(f"pcpviz run: {' '.join(str(e).split())}") from None
    print(f"wrote {args.write_config}; start the ranks with\n"
          f"  torchrun --nnodes <hosts> --nproc-per-node <ranks per host> --rdzv-backend c10d "
          f"--rdzv-endpoint <host0>:29500 -m pcpviz.engine.rank_main {args.write_config}\n"
          f"(WORLD_SIZE must equal --pcp {args.pcp}; rank 0 writes {work}/result.json)")
    return EXIT_OK


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="run the tiny model under PCP + MTP on N ranks and record a trace",
                       description="Run the shipped tiny DeepSeek-V3 model (or --model) on --pcp ranks "
                                   "with MTP speculative decoding, the way vLLM 0.33.0's model runner "
                                   "does, and record every step's views to --trace.")
    p.add_argument("--pcp", type=bounded_int(1, MAX_WORLD), default=2, help="PCP ranks (processes)")
    p.add_argument("--mtp", type=bounded_int(0, 64), default=2, help="num_speculative_tokens K (0 = no speculation)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; not empty)")
    p.add_argument("--prompts-file", type=path, help="JSON list of prompt strings")
    p.add_argument("--max-new-tokens", type=bounded_int(1, 1 << 20), default=32, help="tokens to generate per prompt")
    p.add_argument("--max-num-batched-tokens", type=bounded_int(1, 1 << 20), default=2048,
                   help="per-step token budget (chunked prefill)")
    p.add_argument("--block-size", type=bounded_int(1, 4096), default=16, help="KV cache block size")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="model and KV-cache dtype (vLLM runs the shipped checkpoint in bfloat16)")
    p.add_argument("--model", type=path, default=None, help="model directory (default: the shipped tiny model)")
    p.add_argument("--trace", type=path, default=None, help="write the trace to this directory (refused if it is "
                   "not empty, unless --overwrite, or if another run is writing there)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the trace in --trace (its run.json and rank files; nothing else)")
    p.add_argument("--json", type=path, default=None, help="write a summary (requests, acceptance) to this file")
    p.add_argument("--inject", action="append", help="inject a fault (repeatable); see --list-faults")
    p.add_argument("--list-faults", action="store_true", help="list the injectable faults and exit")
    p.add_argument("--timeout", type=seconds, default=300.0, help="collective timeout in seconds")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--write-config", type=path, default=None, metavar="FILE",
                   help="only write the rank config for torchrun (multi-host) and exit")
    p.set_defaults(func=_cmd_run)


# Each subcommand registers itself here: (adder, ...). Kept as a list so the
# engine, checks and export commands plug in without touching the others.
SUBCOMMANDS: list[Callable] = [_add_layout, _add_run]


# --------------------------------------------------------------------------- check / diff / export

def _open_trace(path: str, cmd: str, *, require_steps: bool = False):
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


def _no_steps(path: str, cmd: str, status) -> None:
    """A trace without one complete step: lost data (exit 3) if its status says data was lost
    (the rank files are missing or damaged), else bad input (exit 2)."""
    if not status.complete:
        raise Incomplete(f"pcpviz {cmd}: incomplete: {path}: no complete step is left")
    raise UsageError(f"pcpviz {cmd}: {path}: the trace has no complete steps")


def _cmd_check(args: argparse.Namespace) -> int:
    from pcpviz.analysis.checks import run_checks

    trace, status = _open_trace(args.trace, "check", require_steps=True)
    try:
        report = run_checks(trace, status=status)
    except ValueError as e:  # a payload that fails its checksum while being read
        raise UsageError(f"pcpviz check: {e}") from None
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.format())
    return exit_code(status, not report.failed)


def _add_check(sub) -> None:
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

    a, status_a = _open_trace(args.a, "diff")
    b, status_b = _open_trace(args.b, "diff")
    try:
        report = diff_traces(a, b)
    except ValueError as e:
        raise UsageError(f"pcpviz diff: {e}") from None
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.format())
    if not (status_a.complete and status_b.complete):
        return exit_code(status_a if not status_a.complete else status_b, report.same)
    return EXIT_OK if report.same else EXIT_FAILED


def _add_diff(sub) -> None:
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
    writers = [(fmt, out, _exporter(fmt)) for fmt, out in wanted]
    trace, status = _open_trace(args.trace, "export")
    if not trace.steps and not status.complete:
        _no_steps(args.trace, "export", status)
    for fmt, out, fn in writers:
        try:
            written = fn(trace, out)
        except (ValueError, OSError) as e:
            raise UsageError(f"pcpviz export: --{fmt} {out}: {' '.join(str(e).split())}") from None
        for shown in ([written] if isinstance(written, (str, bytes)) or not hasattr(written, "__iter__")
                     else written):
            print(f"wrote {shown}")
    return exit_code(status, True)


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a trace (Chrome trace, HTML report)",
                       description="Write a trace in other formats; several at once are allowed. "
                                   "Exit 0 written, 2 bad input, 3 written but the trace is "
                                   "incomplete (one 'incomplete:' line each on stderr).")
    p.add_argument("trace", type=path, help="run directory (or its run.json)")
    for fmt, (text, _) in EXPORT_FORMATS.items():
        p.add_argument(f"--{fmt}", type=path, metavar="OUT", default=None, help=text)
    p.set_defaults(func=_cmd_export)


SUBCOMMANDS += [_add_check, _add_diff, _add_export]


def _add_explain(sub) -> None:
    def run(args: argparse.Namespace) -> int:
        from pcpviz.analysis.explain import explain

        bad, status = _open_trace(args.bad, "explain", require_steps=True)
        good = None if args.good is None else _open_trace(args.good, "explain", require_steps=True)[0]
        try:
            report = explain(bad, good, rerun=not args.no_rerun, status=status)
        except ValueError as e:  # a payload that fails its checksum while being read
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


SUBCOMMANDS.append(_add_explain)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pcpviz", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with named_stdout():
        try:
            args = build_parser().parse_args(argv)
            code = int(args.func(args))
            sys.stdout.flush()  # a full disk or a closed pipe on stdout is reported here, not at exit
            return code
        except UsageError as e:
            print(str(e).splitlines()[0], file=sys.stderr)
            return EXIT_BAD_INPUT
        except Incomplete as e:
            print(str(e).splitlines()[0], file=sys.stderr)
            return EXIT_INCOMPLETE
        except (OSError, MemoryError, RecursionError) as e:  # `| head`, a name too long, a full disk
            return system_error(argv, e)


# --------------------------------------------------------------------------- replay

def _cmd_replay(args: argparse.Namespace) -> int:
    """Drive vLLM 0.33.0's real PCP + MTP classes on CPU through a scripted scenario and record
    the trace (see pcpviz.vllm.replay). vLLM's model runner, PCP manager, block tables and MTP
    proposer run as they are; the models are small stand-ins."""
    if args.mtp > 4:  # the cheap checks before importing vLLM (seconds)
        raise UsageError(f"pcpviz replay: mtp (num_speculative_tokens) must be an int in 1..4, got {args.mtp}")
    from pcpviz.trace import claim
    from pcpviz.trace.owner import check_target

    try:
        check_target(args.trace, overwrite=args.overwrite)
    except ValueError as e:
        raise UsageError(f"pcpviz replay: --trace {e}") from None
    try:
        from pcpviz.vllm import replay as replay_module
    except (ImportError, RuntimeError) as e:  # vLLM missing, wrong version, imported too early
        raise UsageError(f"pcpviz replay: cannot drive vLLM on CPU: {' '.join(str(e).split())}") from None
    say = None if args.quiet else (lambda line: print(line, flush=True))
    try:
        with claim(args.trace, overwrite=args.overwrite, command="pcpviz replay"):
            res = replay_module.replay(pcp=args.pcp, mtp=args.mtp, trace_dir=args.trace, scenario=args.scenario,
                                       decodes=args.decodes, block_size=args.block_size,
                                       overwrite=args.overwrite, progress=say)
    except ValueError as e:
        raise UsageError(f"pcpviz replay: {' '.join(str(e).split())}") from None
    print(f"replayed {len(res.steps)} steps of '{res.scenario}' on {res.pcp} ranks (K={res.num_speculative_tokens}, "
          f"{'no PCP' if res.pcp == 1 else ('sharded' if res.shard_decode_requests else 'replicated') + ' decodes'}) in {res.seconds:.1f}s; "
          f"trace {res.trace_path}")
    if not args.check:
        return EXIT_OK
    from pcpviz.analysis.checks import run_checks

    report = run_checks(res.trace)
    print(report.format())
    return EXIT_OK if report.ok else EXIT_FAILED


def _add_replay(sub) -> None:
    p = sub.add_parser("replay", help="replay real vLLM 0.33.0 PCP + MTP code on CPU and record a trace",
                       description=_cmd_replay.__doc__)
    p.add_argument("--pcp", type=_positive_int, default=2, help="PCP ranks (threads); 1: the PCP=1 baseline")
    p.add_argument("--mtp", type=_positive_int, default=2, help="num_speculative_tokens K (1..4)")
    p.add_argument("--trace", type=path, required=True, help="write the trace to this directory")
    p.add_argument("--scenario", choices=["mixed", "decode_only", "dspark"], default="mixed",
                   help="scripted steps")
    p.add_argument("--decodes", choices=["sharded", "replicated"], default="sharded",
                   help="decode placement (vLLM's default with DCP = 1 is sharded)")
    p.add_argument("--block-size", type=bounded_int(1, 1024), default=4, help="KV block size")
    p.add_argument("--overwrite", action="store_true", help="replace a trace already in --trace")
    p.add_argument("--check", action="store_true", help="run pcpviz check on the trace (exit 1 on a failure)")
    p.add_argument("--quiet", action="store_true", help="no per-step progress")
    p.set_defaults(func=_cmd_replay)


SUBCOMMANDS.append(_add_replay)


if __name__ == "__main__":  # last, so every subcommand above is registered
    sys.exit(main())
