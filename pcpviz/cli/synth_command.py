"""``pcpviz synth``: a synthetic trace (``pcpviz.synthetic``) with steps as large as asked, in
seconds: a 128k-token prefill step that the engine on CPU cannot reach, to try the views and the
checks at that size. Every structural view is what vLLM 0.33.0's PCP layout gives (the pcpviz
reference); the tokens and acceptance are simulated.

    pcpviz synth --tokens 131072 --requests 16 --pcp 4 --trace runs/synth-128k
    pcpviz check runs/synth-128k
"""

from __future__ import annotations

import argparse
import time

from pcpviz.limits import MAX_SYNTH_TOKENS
from pcpviz.cli.guard import EXIT_OK, UsageError, bounded_int, path

__all__ = ["add_synth"]


def _cmd_synth(args: argparse.Namespace) -> int:
    from pcpviz.synthetic import RequestSpec, generate
    from pcpviz.trace import claim
    from pcpviz.trace.owner import check_target

    if args.requests > args.tokens:
        raise UsageError(f"pcpviz synth: --requests {args.requests} is more than --tokens {args.tokens}")
    if args.tokens * args.pcp > MAX_SYNTH_TOKENS * 8:  # the rank-local rows: tokens x ranks
        raise UsageError(f"pcpviz synth: --tokens {args.tokens} x --pcp {args.pcp} is more than "
                         f"{MAX_SYNTH_TOKENS * 8:,} rank-local rows; give fewer tokens or ranks")
    try:
        check_target(args.trace, overwrite=args.overwrite)
    except ValueError as e:
        raise UsageError(f"pcpviz synth: --trace {e}") from None
    t0 = time.monotonic()
    share, extra = divmod(args.tokens, args.requests)
    reqs = [RequestSpec(f"r{i}", share + (i < extra), args.new_tokens) for i in range(args.requests)]
    budget = args.step_tokens or args.tokens
    try:
        run = generate(reqs, pcp=args.pcp, num_speculative_tokens=args.mtp, block_size=args.block_size,
                       max_num_batched_tokens=budget, max_num_reqs=args.requests + 1, seed=args.seed)
        with claim(args.trace, overwrite=args.overwrite, command="pcpviz synth"):
            run.write(args.trace)
    except ValueError as e:
        raise UsageError(f"pcpviz synth: {' '.join(str(e).split())}") from None
    print(f"wrote {args.trace}: {len(run.steps)} steps, {args.requests} requests, {args.tokens} prompt tokens "
          f"(at most {budget} a step), PCP={args.pcp} K={args.mtp}, in {time.monotonic() - t0:.1f}s")
    return EXIT_OK


def add_synth(sub) -> None:
    p = sub.add_parser("synth", help="write a synthetic trace with steps as large as asked (128k tokens and more)",
                       description=__doc__.replace("``", ""))
    p.add_argument("--tokens", type=bounded_int(1, MAX_SYNTH_TOKENS), default=131072,
                   help="prompt tokens of all requests together")
    p.add_argument("--requests", type=bounded_int(1, 1024), default=16, help="requests (prompts of equal length)")
    p.add_argument("--step-tokens", type=bounded_int(1, MAX_SYNTH_TOKENS), default=None,
                   help="per-step token budget (default: --tokens, so the first step prefills every prompt)")
    p.add_argument("--new-tokens", type=bounded_int(1, 4096), default=4, help="tokens to generate per request")
    p.add_argument("--pcp", type=bounded_int(1, 64), default=4, help="PCP ranks")
    p.add_argument("--mtp", type=bounded_int(0, 8), default=2, help="num_speculative_tokens K")
    p.add_argument("--block-size", type=bounded_int(1, 4096), default=16, help="KV block size")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated tokens and acceptance")
    p.add_argument("--trace", type=path, required=True, help="write the trace to this directory")
    p.add_argument("--overwrite", action="store_true", help="replace a trace already in --trace")
    p.set_defaults(func=_cmd_synth)
