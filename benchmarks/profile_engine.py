"""Where one engine run's time goes, operator by operator: one case per invocation.

Runs ``pcpviz.run(..., profile_dir=OUT/CASE, time_phases=True)`` for one case and writes
``OUT/CASE/summary.json`` (phases per step, tokens, wall time) beside the per-rank profiles
(``pcpviz.engine.profile``). One case per process, so a shell ``timeout`` bounds a hang
and the stack dumps (``PCPVIZ_STACK_DUMP``) say where it hung::

    for c in prefill decode; do for p in 1 2; do
      PCPVIZ_STACK_DUMP=out/stacks:45 timeout 200 python benchmarks/profile_engine.py \\
          --case $c --pcp $p --device cuda --dtype bfloat16 --out out
    done; done

Cases:
* ``prefill``  two long prompts (``--long-tokens``) prefilled in two steps; the second is profiled
* ``decode``   one short prompt, ``--decode-tokens`` new tokens at K = ``--k`` (CUDA graphs as
               ``--graphs``: auto, on or off)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pcpviz  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", required=True, choices=["prefill", "decode"])
    ap.add_argument("--pcp", type=int, default=1)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--graphs", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--long-tokens", type=int, default=32000)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(os.path.join(ROOT, "data", "bench", "prompts.json")) as f:
        prompts = json.load(f)
    from pcpviz.engine.tokenizer import encode

    graphs = {"auto": None, "on": True, "off": False}[args.graphs]
    name = f"{args.case}_pcp{args.pcp}" + (f"_k{args.k}_graphs-{args.graphs}" if args.case == "decode" else "")
    out_dir = os.path.join(args.out, name)
    common = dict(pcp=args.pcp, device=args.device, dtype=args.dtype, cuda_graphs=graphs, progress=False,
                  profile_dir=out_dir, time_phases=True, model_dir=args.model_dir, timeout_s=120)
    t0 = time.perf_counter()
    if args.case == "prefill":
        long_ids = encode(prompts["long"])[: args.long_tokens]
        second = long_ids[:1] + long_ids[len(long_ids) // 2:] + long_ids[1:len(long_ids) // 2]
        res = pcpviz.run([long_ids, second], num_speculative_tokens=0, max_new_tokens=1,
                         max_num_batched_tokens=len(long_ids) + 8, **common)
    else:
        res = pcpviz.run(prompts["short"][:1], num_speculative_tokens=args.k, max_new_tokens=args.decode_tokens,
                         **common)
    summary = {"case": name, "args": vars(args), "wall_s": time.perf_counter() - t0, "num_steps": res.num_steps,
               "graphs": res.graphs, "phases": res.phases, "output_token_ids": res.output_token_ids,
               "acceptance_rate_per_pos": res.acceptance_rate_per_pos}
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{name}: {summary['wall_s']:.1f} s, {res.num_steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
