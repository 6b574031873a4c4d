"""``pcpviz run``: the tiny model under PCP + MTP on N ranks (``pcpviz.run``), its trace
recorded; ``--write-config`` writes the rank config for torchrun instead.

    pcpviz run --pcp 2 --mtp 2 --device cpu --prompt "def f(" --trace runs/demo --json out.json
    pcpviz run --list-faults
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from pcpviz.cli.guard import (EXIT_FAILED, EXIT_OK, UsageError, bounded_int, check_output_file, path,
                              read_prompts_file, seconds)
from pcpviz.limits import MAX_ENGINE_BLOCK_SIZE, MAX_LAYOUT_WORLD
from pcpviz.trace.outputs import write_output

__all__ = ["add_run", "STARTED"]

STARTED = time.monotonic()  # the command's wall time counts from here (the CLI's imports included)


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
        res = run(prompts, progress=not args.quiet, redeliver_stop=False, **_engine_options(args))
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
          f"steps {res.num_steps}  engine {res.wall_s:.1f}s, command {time.monotonic() - STARTED:.1f}s"
          + (f"  trace {res.trace_path}" if res.trace_path else ""),
          flush=True)
    if args.json:
        try:
            write_output(args.json, json.dumps(doc, indent=1), option="--json")
        except (OSError, ValueError) as e:  # the run's output is above; only the file is lost
            raise UsageError(f"pcpviz run: --json {args.json}: {' '.join(str(e).split())}") from None
    return EXIT_OK


def _engine_options(args: argparse.Namespace) -> dict:
    """The `pcpviz run` flags as keyword arguments of pcpviz.run / build_config."""
    return dict(pcp=args.pcp, num_speculative_tokens=args.mtp, device=args.device,
                max_new_tokens=args.max_new_tokens, trace_dir=args.trace, inject=args.inject or (),
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                block_size=args.block_size, dtype=args.dtype,
                model_dir=args.model, timeout_s=args.timeout, overwrite=args.overwrite,
                dcp=args.dcp, dcp_interleave=args.dcp_interleave)


def _write_rank_config(args: argparse.Namespace, prompts: list[str]) -> int:
    """Write the rank config for torchrun (multi-host) instead of launching the ranks here: the
    GPUs are counted on the hosts that run the ranks, not on this one."""
    import dataclasses
    import os

    from pcpviz.engine.run_config import build_config
    from pcpviz.engine.trace_dir import start_trace

    try:
        cfg = build_config(prompts, count_local_devices=False, **_engine_options(args))
        work = os.path.abspath(os.path.splitext(args.write_config)[0] + "-work")
        os.makedirs(work, exist_ok=True)
        cfg = dataclasses.replace(cfg, work_dir=work)
        if cfg.trace_dir:
            owner = start_trace(cfg, "pcpviz run --write-config")
            owner.release()  # the ranks create their files
            cfg = dataclasses.replace(cfg, trace_owner=owner.token)
        write_output(args.write_config, json.dumps(cfg.to_dict()), option="--write-config")
    except (ValueError, OSError) as e:
        raise UsageError(f"pcpviz run: {' '.join(str(e).split())}") from None
    print(f"wrote {args.write_config}; start the ranks with\n"
          f"  torchrun --nnodes <hosts> --nproc-per-node <ranks per host> --rdzv-backend c10d "
          f"--rdzv-endpoint <host0>:29500 -m pcpviz.engine.rank_main {args.write_config}\n"
          f"(WORLD_SIZE must equal --pcp {args.pcp}; rank 0 writes {work}/result.json)")
    return EXIT_OK


def add_run(sub) -> None:
    p = sub.add_parser("run", help="run the tiny model under PCP + MTP on N ranks and record a trace",
                       description="Run the shipped tiny DeepSeek-V3 model (or --model) on --pcp ranks "
                                   "with MTP speculative decoding, the way vLLM 0.33.0's model runner "
                                   "does, and record every step's views to --trace.")
    p.add_argument("--pcp", type=bounded_int(1, MAX_LAYOUT_WORLD), default=2, help="PCP ranks (processes)")
    p.add_argument("--dcp", type=bounded_int(1, MAX_LAYOUT_WORLD), default=1,
                   help="decode context parallel: 1, or --pcp (KV sharded over the PCP ranks; the engine's own "
                        "DCP on the dense model, not a vLLM 0.33.0 configuration)")
    p.add_argument("--dcp-interleave", type=bounded_int(1, MAX_ENGINE_BLOCK_SIZE), default=1,
                   help="cp_kv_cache_interleave_size: DCP shards the KV in runs of this many tokens")
    p.add_argument("--mtp", type=bounded_int(0, 64), default=2, help="num_speculative_tokens K (0 = no speculation)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; not empty)")
    p.add_argument("--prompts-file", type=path, help="JSON list of prompt strings")
    p.add_argument("--max-new-tokens", type=bounded_int(1, 1 << 20), default=32, help="tokens to generate per prompt")
    p.add_argument("--max-num-batched-tokens", type=bounded_int(1, 1 << 20), default=2048,
                   help="per-step token budget (chunked prefill)")
    p.add_argument("--max-num-seqs", type=bounded_int(1, 1024), default=16,
                   help="most requests in one step (vLLM's max_num_seqs; 64 prompts in one step need 64)")
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
    p.add_argument("--timeout", type=seconds, default=300.0,
                   help="collective timeout in seconds: how long a rank waits on a stuck or dead peer")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--write-config", type=path, default=None, metavar="FILE",
                   help="only write the rank config for torchrun (multi-host) and exit")
    p.set_defaults(func=_cmd_run)
