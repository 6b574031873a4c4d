"""Command line of the cost model.

    python -m pcpviz.costmodel fit                     # fit, print every point, write data/bench/costmodel_fit.json
    python -m pcpviz.costmodel predict --model deepseek-v3 --context 131072 --pcp 2 --k 2 --alpha 0.8

Bad input (an option out of range, an unreadable fit file) is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from pcpviz.io_guards import bounded_int, check_output_file
from pcpviz.costmodel.specs import H200, MODEL_NAMES, repo_root, model_by_name

DEFAULT_FIT = os.path.join("data", "bench", "costmodel_fit.json")
DEFAULT_TP = {"tiny": 1, "deepseek-v3": 8}  # fp8 DeepSeek-V3 (671 GB) needs 8 H200s to hold it


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse would print usage too)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not (math.isfinite(v) and 0.0 <= v <= 1.0):
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return v


def _fractions(text: str) -> tuple[float, ...]:
    return tuple(_fraction(x) for x in text.split(","))


def _efficiency(text: str) -> float:
    v = _fraction(text)
    if v == 0:
        raise argparse.ArgumentTypeError("expected a number in (0, 1], got 0")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m pcpviz.costmodel", description="When do PCP and MTP pay off? (docs/cost-model.md)")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    f = sub.add_parser("fit", help="fit the free parameters to every measured point in data/bench/")
    f.add_argument("--out", default=None, help=f"fit file to write (default {DEFAULT_FIT}; '-' writes none)")
    p = sub.add_parser("predict", help="prefill (PCP) and decode (MTP) predictions for one configuration")
    p.add_argument("--model", choices=MODEL_NAMES, default="deepseek-v3")
    p.add_argument("--context", type=bounded_int(1, 1 << 24), required=True,
                   help="prompt tokens to prefill, and the positions a decode step attends to")
    p.add_argument("--pcp", type=bounded_int(1, 64), default=2)
    p.add_argument("--tp", type=bounded_int(1, 64), default=None,
                   help="tensor parallel (default: 1 tiny, 8 deepseek-v3)")
    p.add_argument("--k", type=bounded_int(0, 16), default=2, help="MTP draft tokens")
    acc = p.add_mutually_exclusive_group()
    acc.add_argument("--alpha", type=_fraction, default=None,
                     help="conditional acceptance at every draft position (default 0.8)")
    acc.add_argument("--acceptance", type=_fractions, default=None,
                     help="conditional acceptance per draft position, comma-separated (K of them)")
    p.add_argument("--batch", type=bounded_int(1, 1 << 16), default=1)
    p.add_argument("--chunk", type=bounded_int(1, 1 << 24), default=None, help="prefill token budget per step")
    p.add_argument("--system", default="vllm-graphs",
                   help="a system of the fit file (vllm-eager, vllm-graphs, engine, engine-v2)")
    p.add_argument("--attn-eff", type=_efficiency, default=None, help="override the system's attention efficiency")
    p.add_argument("--fit", default=None, help=f"fit file (default {DEFAULT_FIT})")
    p.add_argument("--moe-gather", action="store_true",
                   help="add the MoE's PCP all-gather and reduce-scatter (vLLM without expert parallelism)")
    return ap


def cmd_fit(args) -> int:
    from pcpviz.costmodel.fit import fit, format_fit, write_fit

    out = os.path.join(repo_root(), DEFAULT_FIT) if args.out is None else args.out
    if out != "-":
        check_output_file(out, "--out")
    f = fit()
    print(format_fit(f))
    if out != "-":
        write_fit(f, out)
        print(f"wrote {os.path.relpath(out)}")
    return 0


def cmd_predict(args) -> int:
    import dataclasses

    from pcpviz.costmodel.answers import pcp_breakeven
    from pcpviz.costmodel.fit import load_fit
    from pcpviz.costmodel.step import (decode_step, expected_accepted_tokens, geometric_acceptance, prefill_step,
                                       prefill_time)
    from pcpviz.costmodel.step import seconds_text as _ms

    path = args.fit or os.path.join(repo_root(), DEFAULT_FIT)
    systems = load_fit(path)
    if args.system not in systems:
        raise ValueError(f"--system {args.system}: not in {path} (has {', '.join(sorted(systems))})")
    sysm = systems[args.system]
    if args.attn_eff is not None:
        sysm = dataclasses.replace(sysm, attn_eff=args.attn_eff)
    model = model_by_name(args.model)
    tp = args.tp or DEFAULT_TP[args.model]
    k, n = args.k, args.context
    if args.acceptance is not None and len(args.acceptance) != k:
        raise ValueError(f"--acceptance: {len(args.acceptance)} rates given for --k {k}")
    acc = args.acceptance if args.acceptance is not None else geometric_acceptance(
        0.8 if args.alpha is None else args.alpha, k)
    print(f"{model.name}: {model.params_per_token / 1e9:.3g} B weights a token, {model.total_params / 1e9:.3g} B "
          f"in all; {H200.name}, TP={tp}, system {args.system}"
          f"{f' (attention efficiency {sysm.attn_eff:g})' if args.attn_eff is not None else ''} "
          f"from {os.path.relpath(path)}")
    mg = args.moe_gather
    if mg:
        print("  with the MoE's PCP all-gather and reduce-scatter (--moe-gather; not fitted to any MoE point)")
    kw = dict(k=k, tp=tp, chunk=args.chunk)
    one = prefill_time(model, H200, sysm, tokens=n, pcp=1, **kw)
    many = prefill_time(model, H200, sysm, tokens=n, pcp=args.pcp, moe_gather=mg, **kw)
    print(f"prefill of {n:,} tokens (K={k}): PCP=1 {_ms(one)}, PCP={args.pcp} {_ms(many)}: {one / many:.2f}x")
    if args.chunk is None:
        st = prefill_step(model, H200, sysm, tokens=n, pcp=args.pcp, k=k, tp=tp, moe_gather=mg)
        print(f"  PCP={args.pcp} step: overhead {_ms(st.overhead_s)}, GEMM {_ms(st.gemm_s)}, attention "
              f"{_ms(st.attention_s)}, collectives {_ms(st.comm_s)}, draft {_ms(st.draft_s)}")
    if args.pcp > 1:
        target = min(1.5, args.pcp * 0.75)
        be = pcp_breakeven(model, H200, sysm, pcp=args.pcp, threshold=target, k=k, tp=tp, moe_gather=mg)
        print(f"  PCP={args.pcp} beats PCP=1 by {target:g}x from "
              f"{f'{be:,} tokens' if be else 'beyond 16.8M tokens (never here)'} (one step)")
    d0 = decode_step(model, H200, sysm, batch=args.batch, context=n, k=0, pcp=args.pcp, tp=tp, moe_gather=mg)
    line = f"decode, batch {args.batch} at {n:,} positions, PCP={args.pcp}: K=0 {_ms(d0.total_s)} a step"
    if k:
        dk = decode_step(model, H200, sysm, batch=args.batch, context=n, k=k, pcp=args.pcp, tp=tp, moe_gather=mg)
        accepted = expected_accepted_tokens(acc)
        line += (f"; K={k} {_ms(dk.total_s)} a step, acceptance {', '.join(f'{a:g}' for a in acc)}: "
                 f"{accepted:.2f} tokens a step: MTP {accepted * d0.total_s / dk.total_s:.2f}x")
    print(line)
    print(f"  K=0 step: overhead {_ms(d0.overhead_s)}, GEMM {_ms(d0.gemm_s)}, attention {_ms(d0.attention_s)}, "
          f"collectives {_ms(d0.comm_s)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return cmd_fit(args) if args.cmd == "fit" else cmd_predict(args)
    except (ValueError, OSError) as e:
        print(f"python -m pcpviz.costmodel {args.cmd}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 141


if __name__ == "__main__":
    sys.exit(main())
