"""``pcpviz bisect``: the same prompts under a ladder of configurations, one knob changed each, and
the knob(s) that flip acceptance or tokens, each with its first divergent view (``pcpviz.bisect``).

    pcpviz bisect --producer replay --graph-mode PIECEWISE --out runs/bisect
    pcpviz bisect --producer engine --pcp 2 --budget 16 --inject draft_hidden_rank_local --out runs/b --json
    pcpviz bisect --producer vllm --pcp 1 --knobs graph_mode,prefix_caching --out runs/b   # real vLLM, GPUs
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

    from pcpviz.vllm.launch import LaunchError

    base = _base(args)
    knobs = None if args.knobs is None else [k.strip() for k in args.knobs.split(",") if k.strip()]
    say = None if args.quiet or args.json else (lambda line: print(line, flush=True))
    extra = {"prompts": args.prompt} if args.prompt else {}
    try:
        report = bisect(args.producer, out_dir=args.out, base=base, knobs=knobs, tolerance=args.tolerance,
                        inject=args.inject, fixes=args.fixes, progress=say, **extra)
    except (ValueError, ImportError) as e:  # a bad option; vLLM missing or the wrong version (replay)
        raise UsageError(f"pcpviz bisect: {' '.join(str(e).split())}") from None
    except LaunchError as e:  # real vLLM: not installed, too few GPUs, or the base run failed
        raise UsageError(f"pcpviz bisect: the base run on vLLM: {' '.join(str(e).split())}") from None
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.format())
    return EXIT_FAILED if report.flips() else EXIT_OK


def _base(args: argparse.Namespace) -> dict:
    """The base configuration from the options, each option checked against the producer."""
    base = {"pcp": args.pcp, "k": args.mtp}
    if args.producer == "engine" and args.graph_mode not in (None, "NONE"):
        raise UsageError("pcpviz bisect: --graph-mode is a replay and vllm knob (the engine's CPU ranks run no graphs)")
    if args.producer != "vllm" and (args.model or args.vllm_args):
        raise UsageError("pcpviz bisect: --model and --vllm-args are for --producer vllm")
    if args.producer == "replay" and (args.budget is not None or args.prompt):
        raise UsageError("pcpviz bisect: the replay runs its own scenario: --budget and --prompt are for the "
                         "engine and vllm producers (use --no-chunking)")
    if args.producer == "replay":
        base.update(graph_mode=args.graph_mode or "NONE", chunked_prefill=not args.no_chunking,
                    decodes=args.decodes)
    elif args.producer == "engine":
        base.update(max_num_batched_tokens=args.budget or 16, device=args.device)
    else:
        try:
            engine_args = json.loads(args.vllm_args) if args.vllm_args else {}
        except ValueError as e:
            raise UsageError(f"pcpviz bisect: --vllm-args is not JSON: {e}") from None
        if not isinstance(engine_args, dict):
            raise UsageError("pcpviz bisect: --vllm-args must be a JSON object of vllm.LLM keywords")
        base.update(graph_mode=args.graph_mode or "FULL_AND_PIECEWISE", max_num_batched_tokens=args.budget or 2048,
                    prefix_caching=args.prefix_caching, engine_args=engine_args)
        if args.model:
            base["model"] = args.model
    return base


def add_bisect(sub) -> None:
    p = sub.add_parser("bisect", help="which configuration knob flips acceptance or tokens",
                       description=_cmd_bisect.__doc__)
    p.add_argument("--producer", choices=["replay", "engine", "vllm"], default="replay",
                   help="replay: vLLM's classes on CPU; engine: the pcpviz engine; vllm: real vLLM 0.33.0 (GPUs)")
    p.add_argument("--out", type=path, required=True, help="one trace per rung under this directory")
    p.add_argument("--pcp", type=positive_int, default=2, help="base PCP size")
    p.add_argument("--mtp", type=positive_int, default=2, help="base num_speculative_tokens K")
    p.add_argument("--graph-mode", choices=["NONE", "PIECEWISE", "FULL_AND_PIECEWISE"], default=None,
                   help="base CUDA-graph mode (replay: NONE; vllm: FULL_AND_PIECEWISE, vLLM's default)")
    p.add_argument("--decodes", choices=["sharded", "replicated"], default="sharded", help="base decodes (replay)")
    p.add_argument("--no-chunking", action="store_true", help="base without chunked prefill (replay)")
    p.add_argument("--budget", type=positive_int, default=None,
                   help="base max_num_batched_tokens (engine: 16; vllm: 2048)")
    p.add_argument("--prefix-caching", action="store_true", help="base with prefix caching on (vllm)")
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeat; engine and vllm)")
    p.add_argument("--model", default=None, help="the model directory (vllm; default: the shipped tiny MTP model)")
    p.add_argument("--vllm-args", default=None, help="more vllm.LLM keywords for every rung, as a JSON object")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="engine ranks")
    p.add_argument("--knobs", default=None, help="comma-separated subset of pcp,graph_mode,k,chunked_prefill,"
                                                 "decodes,max_num_batched_tokens,prefix_caching")
    p.add_argument("--tolerance", type=float, default=0.1, help="acceptance change per position that counts")
    p.add_argument("--inject", action="append", default=[], help="plant an engine fault in every rung")
    p.add_argument("--fixes", default=None, help="pcpviz.vllm.fixes (PCPVIZ_FIXES) for every replay or vllm rung")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_cmd_bisect)
