"""pcpviz findings: is a vLLM 0.33.0 configuration exposed to pcpviz's findings (docs/findings/),
and which PCPVIZ_FIXES removes each (pcpviz.analysis.exposure).

    pcpviz findings --pcp 2 --mtp 2                                   # vLLM's default graph mode
    pcpviz findings --pcp 2 --mtp 2 --cudagraph-mode NONE
    pcpviz findings data/traces/vllm-h200x2-pcp2-mtp2-piecewise       # what a recorded run ran
    pcpviz findings --vllm-args '{"prefill_context_parallel_size": 2, "enforce_eager": true,
                                  "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from pcpviz.cli.guard import EXIT_FAILED, EXIT_OK, UsageError, path

__all__ = ["add_findings"]


def _setup(args: argparse.Namespace):
    from pcpviz.analysis.exposure import ALL_CUDAGRAPH_MODES, VllmSetup, parse_fixes

    try:
        fixes = parse_fixes(args.fixes)
    except ValueError as e:
        raise UsageError(f"pcpviz findings: --fixes: {e}") from None
    given = [n for n, v in (("TRACE", args.trace), ("--vllm-args", args.vllm_args)) if v]
    if len(given) > 1:
        raise UsageError("pcpviz findings: give a trace or --vllm-args, not both")
    if args.trace:
        from pcpviz.cli.trace_commands import open_trace_arg

        trace, _ = open_trace_arg(args.trace, "findings")
        s = VllmSetup.from_meta(trace.run_meta)
        return dataclasses.replace(s, fixes=tuple(dict.fromkeys(s.fixes + fixes)))
    if args.vllm_args:
        try:
            kw = json.loads(args.vllm_args)
            if not isinstance(kw, dict):
                raise ValueError("not a JSON object of vllm.LLM keywords")
            return VllmSetup.from_llm_kwargs(kw, fixes=fixes)
        except ValueError as e:
            raise UsageError(f"pcpviz findings: --vllm-args: {' '.join(str(e).split())}") from None
    mode = args.cudagraph_mode.upper()
    if mode not in ALL_CUDAGRAPH_MODES:
        raise UsageError(f"pcpviz findings: --cudagraph-mode {args.cudagraph_mode!r}: one of "
                         f"{', '.join(ALL_CUDAGRAPH_MODES)}")
    return VllmSetup(pcp=args.pcp, method=args.method, k=args.mtp, cudagraph_mode=mode,
                     enforce_eager=args.enforce_eager, fixes=fixes)


def _cmd_findings(args: argparse.Namespace) -> int:
    """Say, for each of pcpviz's findings in vLLM 0.33.0 (docs/findings/), whether the configuration
    meets it (and what must also happen at run time), or why not, or that its opt-in fix is on.
    Exit 1 when the configuration is exposed to one, 0 when to none, 2 on bad input."""
    from pcpviz.analysis.exposure import EXPOSED, exposures, vllm_refuses

    s = _setup(args)
    found = exposures(s)
    refused = vllm_refuses(s)
    if args.json:
        print(json.dumps({"setup": {**s.__dict__, "graph_mode": s.graph_mode}, "vllm_refuses": refused,
                          "findings": [e.__dict__ for e in found]}, indent=1))
        return EXIT_FAILED if any(e.verdict == EXPOSED for e in found) else EXIT_OK
    print(f"vLLM 0.33.0, PCP={s.pcp}, {s.method or 'no drafter'} K={s.k}, cudagraph_mode {s.graph_mode}"
          + (f", fixes {', '.join(s.fixes)}" if s.fixes else ""))
    if refused is not None:
        print(f"  vLLM refuses this configuration at start: {refused}; no finding applies")
        return EXIT_OK
    for e in found:
        print("\n".join("  " + x for x in e.lines()))
    hit = [e.finding for e in found if e.verdict == EXPOSED]
    if hit:
        print(f"removed by pcpviz's plugin with PCPVIZ_FIXES={','.join(hit)} (opt-in patches), or by "
              "cudagraph_mode NONE")
    return EXIT_FAILED if any(e.verdict == EXPOSED for e in found) else EXIT_OK


def add_findings(sub) -> None:
    p = sub.add_parser("findings", help="is a vLLM configuration exposed to pcpviz's findings",
                       description=__doc__ + "\n" + (_cmd_findings.__doc__ or ""))
    p.add_argument("trace", nargs="?", type=path, default=None, help="a trace: the configuration its run.json records")
    p.add_argument("--pcp", type=int, default=2, help="prefill_context_parallel_size")
    p.add_argument("--method", default="mtp", help="speculative_config.method (mtp, dspark, eagle, ...)")
    p.add_argument("--mtp", type=int, default=2, help="num_speculative_tokens K")
    p.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE", help="compilation_config.cudagraph_mode")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM's --enforce-eager (no CUDA graphs)")
    p.add_argument("--fixes", default=None, help="PCPVIZ_FIXES in effect (comma-separated)")
    p.add_argument("--vllm-args", default=None, help="vllm.LLM keywords as a JSON object, instead of the options")
    p.add_argument("--json", action="store_true", help="the verdicts as JSON")
    p.set_defaults(func=_cmd_findings)
