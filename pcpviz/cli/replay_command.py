"""``pcpviz replay``: vLLM 0.33.0's real PCP + MTP classes on CPU through a scripted scenario
(``pcpviz.vllm.replay``), the trace recorded and, with ``--check``, checked.

    pcpviz replay --pcp 2 --mtp 2 --trace runs/vllm --check
"""

from __future__ import annotations

import argparse

from pcpviz.cli.guard import EXIT_FAILED, EXIT_OK, UsageError, bounded_int, path, positive_int

__all__ = ["add_replay"]


def _cmd_replay(args: argparse.Namespace) -> int:
    """Drive vLLM 0.33.0's real PCP + MTP classes on CPU through a scripted scenario and record
    the trace (see pcpviz.vllm.replay). vLLM's model runner, PCP manager, block tables and MTP
    proposer run as they are; the target and MTP compute with the tiny checkpoint's weights (--model: which
    checkpoint, the MoE + DSA one included)."""
    if args.mtp > 4:  # the cheap checks before importing vLLM (seconds)
        raise UsageError(f"pcpviz replay: mtp (num_speculative_tokens) must be an int in 1..4, got {args.mtp}")
    if args.model is not None:
        if args.models == "scripted":
            raise UsageError("pcpviz replay: --model is the weights of --models tiny; the scripted models have none")
        from pcpviz.engine.model_files import check_model_dir

        try:
            check_model_dir(args.model)
        except ValueError as e:
            raise UsageError(f"pcpviz replay: --model {' '.join(str(e).split())}") from None
    from pcpviz.trace import claim
    from pcpviz.trace.flight import FlightConfig
    from pcpviz.trace.owner import check_target

    try:
        FlightConfig.from_env()  # PCPVIZ_FLIGHT_*: a bad value is one line before anything is created
    except ValueError as e:
        raise UsageError(f"pcpviz replay: {e}") from None
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
                                       overwrite=args.overwrite, progress=say, models=args.models,
                                       graph_mode=args.graph_mode, fixes=args.fixes, model_dir=args.model)
    except ValueError as e:
        raise UsageError(f"pcpviz replay: {' '.join(str(e).split())}") from None
    decodes = "no PCP" if res.pcp == 1 else ("sharded" if res.shard_decode_requests else "replicated") + " decodes"
    print(f"replayed {len(res.steps)} steps of '{res.scenario}' on {res.pcp} ranks (K={res.num_speculative_tokens}, "
          f"{decodes}) in {res.seconds:.1f}s; trace {res.trace_path}")
    if not args.check:
        return EXIT_OK
    from pcpviz.analysis.checks import run_checks

    report = run_checks(res.trace)
    print(report.format())
    return EXIT_OK if report.ok else EXIT_FAILED


def add_replay(sub) -> None:
    p = sub.add_parser("replay", help="replay real vLLM 0.33.0 PCP + MTP code on CPU and record a trace",
                       description=_cmd_replay.__doc__)
    p.add_argument("--pcp", type=positive_int, default=2, help="PCP ranks (threads); 1: the PCP=1 baseline")
    p.add_argument("--mtp", type=positive_int, default=2, help="num_speculative_tokens K (1..4)")
    p.add_argument("--trace", type=path, required=True, help="write the trace to this directory")
    p.add_argument("--scenario", choices=["mixed", "decode_only", "dspark", "long_context"], default="mixed",
                   help="scripted steps")
    p.add_argument("--decodes", choices=["sharded", "replicated"], default="sharded",
                   help="decode placement (vLLM's default with DCP = 1 is sharded)")
    p.add_argument("--block-size", type=bounded_int(1, 1024), default=4, help="KV block size")
    p.add_argument("--models", choices=["tiny", "scripted"], default=None,
                   help="tiny: the shipped checkpoint's weights, real acceptance (default; dspark: scripted)")
    p.add_argument("--model", type=path, default=None,
                   help="--models tiny: the checkpoint (default data/models/pcpviz-tiny-dsv3; "
                        "data/models/pcpviz-tiny-moe-dsa: the MoE + DSA model)")
    p.add_argument("--graph-mode", choices=["NONE", "PIECEWISE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"],
                   default="NONE", help="the speculator's CUDA-graph mode (vLLM's dispatch, stand-in graphs)")
    p.add_argument("--fixes", default=None, help="pcpviz.vllm.fixes to patch in, comma-separated "
                                                 "(default: $PCPVIZ_FIXES)")
    p.add_argument("--overwrite", action="store_true", help="replace a trace already in --trace")
    p.add_argument("--check", action="store_true", help="run pcpviz check on the trace (exit 1 on a failure)")
    p.add_argument("--quiet", action="store_true", help="no per-step progress")
    p.set_defaults(func=_cmd_replay)
