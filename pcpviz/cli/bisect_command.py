"""``pcpviz bisect``: the same prompts under a ladder of configurations, one knob changed each, and
the knob(s) that flip acceptance or tokens, each with its first divergent view (``pcpviz.bisect``).

    pcpviz bisect --producer replay --graph-mode PIECEWISE --out runs/bisect
    pcpviz bisect --producer engine --pcp 2 --budget 16 --inject draft_hidden_rank_local --out runs/b --json
"""

from __future__ import annotations

import argparse
import json

from pcpviz.cli.guard import EXIT_FAILED, EXIT_OK, UsageError, path, positive_int

__all__ = ["add_bisect"]


def _cmd_bisect(args: argparse.Namespace) -> int:
    """Run the base configuration and one rung per knob (PCP on/off, graph mode, K, the chunked-prefill
    budget or chunking, decode placement), then report which rungs flip tokens or acceptance and the
    first divergent view of each. Exit 1 when a knob flips something, 0 when none does."""
    from pcpviz.bisect import bisect

    base = {"pcp": args.pcp, "k": args.mtp}
    if args.producer == "replay":
        base.update(graph_mode=args.graph_mode, chunked_prefill=not args.no_chunking, decodes=args.decodes)
    else:
        if args.graph_mode != "NONE":
            raise UsageError("pcpviz bisect: --graph-mode is a replay knob (the engine's CPU ranks run no graphs)")
        base.update(max_num_batched_tokens=args.budget, device=args.device)
    knobs = None if args.knobs is None else [k.strip() for k in args.knobs.split(",") if k.strip()]
    say = None if args.quiet or args.json else (lambda line: print(line, flush=True))
    try:
        report = bisect(args.producer, out_dir=args.out, base=base, knobs=knobs, tolerance=args.tolerance,
                        inject=args.inject, fixes=args.fixes, progress=say)
    except (ValueError, ImportError) as e:  # a bad option; vLLM missing or the wrong version (replay)
        raise UsageError(f"pcpviz bisect: {' '.join(str(e).split())}") from None
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.format())
    return EXIT_FAILED if report.flips() else EXIT_OK


def add_bisect(sub) -> None:
    p = sub.add_parser("bisect", help="which configuration knob flips acceptance or tokens",
                       description=_cmd_bisect.__doc__)
    p.add_argument("--producer", choices=["replay", "engine"], default="replay",
                   help="replay: vLLM's classes on CPU; engine: the pcpviz engine")
    p.add_argument("--out", type=path, required=True, help="one trace per rung under this directory")
    p.add_argument("--pcp", type=positive_int, default=2, help="base PCP size")
    p.add_argument("--mtp", type=positive_int, default=2, help="base num_speculative_tokens K")
    p.add_argument("--graph-mode", choices=["NONE", "PIECEWISE", "FULL_AND_PIECEWISE"], default="NONE",
                   help="base draft CUDA-graph mode (replay)")
    p.add_argument("--decodes", choices=["sharded", "replicated"], default="sharded", help="base decodes (replay)")
    p.add_argument("--no-chunking", action="store_true", help="base without chunked prefill (replay)")
    p.add_argument("--budget", type=positive_int, default=16, help="base max_num_batched_tokens (engine)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="engine ranks")
    p.add_argument("--knobs", default=None, help="comma-separated subset of pcp,graph_mode,k,chunked_prefill,"
                                                 "decodes,max_num_batched_tokens,prefix_caching")
    p.add_argument("--tolerance", type=float, default=0.1, help="acceptance change per position that counts")
    p.add_argument("--inject", action="append", default=[], help="plant an engine fault in every rung")
    p.add_argument("--fixes", default=None, help="pcpviz.vllm.fixes for every replay rung")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_cmd_bisect)
