"""Engine benchmark: prints ratios measured in one run, and writes them as JSON.

    python benchmarks/bench_engine.py --device cuda --out data/bench/h200x2.json   # 2 GPUs
    python benchmarks/bench_engine.py --device cuda --out data/bench/h200x1.json   # 1 GPU: PCP=1 only
    python benchmarks/bench_engine.py --device cpu --small                          # smoke run

Measures (every figure from the same invocation):
* ``prefill_pcp2_over_pcp1``  the target-forward time of a long prompt's prefill step at PCP=2 over
                              PCP=1 (ideal 0.5), the second of two such steps in one run (warm);
* ``mtp_decode_speedup``      decode tokens/s with MTP K=2 over no speculation, batch 1;
* ``recording_overhead``      loop time with the trace on over off (PCP=2, K=2; PCP=1 on one GPU);
* ``acceptance_rate_per_pos`` for K=2 and K=3 on held-out Python source;
* ``tokens_equal``            the same prompts on CPU (gloo) and on the device (NCCL) give the same
                              tokens, and match ``data/bench/expected_tokens.json`` (made on CPU here).
* ``phases``                  per configuration, where each step's time goes (``pcpviz.engine.phase_timer``):
                              schedule, batch, h2d, target, gather, verify, draft_0, draft_k, record,
                              capture, other, per step (``per_step``: host ms, and device ms from CUDA
                              events on CUDA), over all steps and over decode steps only;
* ``decode_ms_per_token``     batch 1, from the loop's wall time (K=0 and K=2) less the one-time graph
                              captures (vLLM captures at start-up), beside real vLLM's
                              ``decode_ms_per_token`` in ``data/bench/vllm_h200x2.json``;
* ``mtp_batch16``             batch 16 (the short prompts twice), K=0 and K=2, interleaved repeats: the
                              best steady decode step of each, ms per token, ``mtp_speedup``;
* ``decode_steady``           batch 1, K=0 and K=2: the median decode step's wall time after the
                              first 8 (no JIT, no captures, no timer events), tokens per decode step,
                              ms per token, and ``mtp_speedup`` from them (the steady-state figures);
* ``graphs``                  decode steps from CUDA graphs against the eager path: tok/s both ways
                              and whether the tokens are the same (CUDA only);
* ``compile``                 batch-1 steady decode (K=0, K=2) with the decode graphs' model code
                              through torch.compile (``PCPVIZ_COMPILE=1``, the CUDA default) and
                              without (``0``), interleaved repeats, and whether the tokens agree;
* ``beside_vllm``             decode ms/token at PCP=2 batch 1 (K=0, K=2) and the prefill step at PCP=1
                              and 2, the engine's next to real vLLM's (``data/bench/vllm_h200x2.json``).
On one GPU the PCP=2 figures (``prefill_pcp2_over_pcp1``, ``decode_pcp2``) are not taken and
acceptance and recording run at PCP=1 (``max_pcp`` in the JSON); ``prefill_step_ms_pcp1`` is the
32k prefill step. Times are the engine loop's wall time (process start and model load excluded; one warm-up
forward first). Each configuration runs ``--repeat`` times and the minimum is kept; its last
repeat runs with the phase timer on and gives ``phases`` (and ``phases_wall_s``: the timer's
own cost is the difference to the untimed best).

``--out`` keeps the keys an existing file has that this run does not write (e.g. ``kernels``,
merged from ``bench_kernels.py``).
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


def best(fn, repeat):
    """The fastest of ``repeat`` runs ``fn(time_phases)``, and the last one, run with the phase
    timer on (the same run when ``repeat`` is 1)."""
    results = [fn(i == repeat - 1) for i in range(repeat)]
    return min(results, key=steady_s), results[-1]


def beside_vllm(out: dict) -> dict:
    """The engine's figures next to real vLLM's (``data/bench/vllm_h200x2.json``, eager), each
    with its configuration; {} when that file is missing."""
    path = os.path.join(ROOT, "data", "bench", "vllm_h200x2.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        v = json.load(f)
    runs = v.get("runs", {})
    get = lambda run, key: runs.get(run, {}).get(key)  # noqa: E731
    pre = out.get("prefill_step_s", {})
    dec2 = out.get("decode_ms_per_token_pcp2", {})
    return {
        "decode_ms_per_token_pcp2_k0": {"engine": dec2.get("k0"), "vllm": get("pcp2_k0", "decode_ms_per_token")},
        "decode_ms_per_token_pcp2_k2": {"engine": dec2.get("k2"), "vllm": get("pcp2_k2", "decode_ms_per_token")},
        "prefill_step_ms_pcp1": {"engine": 1e3 * pre["pcp1"][-1] if pre.get("pcp1") else None,
                                 "vllm": 1e3 * get("pcp1_k2", "prefill_s") if get("pcp1_k2", "prefill_s") else None,
                                 "tokens": {"engine": out.get("long_prompt_tokens"), "vllm": v.get("prefill_tokens")}},
        "prefill_step_ms_pcp2": {"engine": 1e3 * pre["pcp2"][-1] if pre.get("pcp2") else None,
                                 "vllm": 1e3 * get("pcp2_k2", "prefill_s") if get("pcp2_k2", "prefill_s") else None,
                                 "tokens": {"engine": out.get("long_prompt_tokens"), "vllm": v.get("prefill_tokens")}},
        "vllm_source": "data/bench/vllm_h200x2.json (" + str(v.get("what", "")) + ")",
    }


def steady_s(res) -> float:
    """The loop's wall time less the one-time CUDA graph captures (vLLM captures at start-up,
    outside its decode figures; the engine captures a decode shape on first use)."""
    return res.wall_s - ((res.graphs or {}).get("capture_s") or 0.0)


def steady_decode(res) -> dict:
    """The untimed run's steady decode: the median decode step's wall time after the first 8
    (``RunResult.steady_decode_ms``: no Triton JIT, no captures, no phase-timer events), the
    tokens a decode step makes, and so the milliseconds per token."""
    decode_steps = sum(1 for kind, _ in res.step_ms if kind == "decode")
    ms = res.steady_decode_ms()
    per_step = (sum(len(o) for o in res.output_token_ids) - len(res.output_token_ids)) / max(decode_steps, 1)
    return {"ms_per_step": ms, "tokens_per_step": per_step,
            "ms_per_token": ms / per_step if ms is not None and per_step else None}


def phase_summary(res) -> dict:
    """The timed run's breakdown: wall time, and per step kind the steps, their summed time and
    each phase's time per step (host ms; device ms on CUDA)."""
    out = {"wall_s": res.wall_s, "graphs": res.graphs}
    for kind, s in res.phases.items():
        out[kind] = {"steps": s["steps"], "step_ms": s["step_ms"], "per_step": s["per_step"]}
    return out


def print_phases(name: str, summary: dict) -> None:
    s = summary.get("decode") if summary.get("decode", {}).get("steps") else summary.get("all")
    if not s:
        return
    clock = "device_ms" if "device_ms" in next(iter(s["per_step"].values())) else "host_ms"
    cells = "  ".join(f"{p} {v[clock]:.3f}" for p, v in s["per_step"].items() if v[clock] >= 0.0005)
    print(f"[phases {name}] {s['steps']} steps, ms/step ({clock}): {cells}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--trace-out", default=None, help="also write a small PCP=2 trace here")
    ap.add_argument("--long-tokens", type=int, default=32000)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="tiny sizes for a CPU smoke run")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="model and KV-cache dtype of every section but tokens (vLLM runs bfloat16)")
    ap.add_argument("--sections", nargs="+", default=None, metavar="NAME",
                    help="run only these sections (tokens warmup prefill mtp_decode mtp_batch16 decode_pcp2 graphs "
                         "compile acceptance recording); default all")
    ap.add_argument("--partial", default=None,
                    help="rewrite this JSON after every section (what a killed run keeps)")
    args = ap.parse_args()
    if args.small:
        args.long_tokens, args.decode_tokens, args.repeat = 600, 24, 1
    dev = args.device
    with open(os.path.join(ROOT, "data", "bench", "prompts.json")) as f:
        prompts = json.load(f)
    from pcpviz.engine.tokenizer import encode

    long_ids = encode(prompts["long"])[: args.long_tokens]
    short = prompts["short"][:3]
    out: dict = {"device": dev, "dtype": args.dtype, "long_prompt_tokens": len(long_ids),
                 "decode_tokens": args.decode_tokens,
                 "engine_kernels": os.environ.get("PCPVIZ_KERNELS", "1") != "0", "phases": {}}
    max_pcp = 2  # PCP=2 needs two GPUs; on one, every PCP=2 section runs at PCP=1 or is skipped
    if dev == "cuda":
        import torch

        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out["torch"] = torch.__version__
        max_pcp = min(2, torch.cuda.device_count())
    out["max_pcp"] = max_pcp

    def run_(*a, **kw):  # every section but tokens runs at --dtype
        return pcpviz.run(*a, dtype=args.dtype, **kw)

    def section(name, fn):
        # One failing measurement must not lose the others: record the error and go on.
        if args.sections is not None and name not in args.sections:
            return
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            out.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            print(f"[{name}] FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        out.setdefault("section_s", {})[name] = round(time.time() - t0, 1)
        print(f"[{name}] {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
        if args.partial:
            with open(args.partial, "w") as f:
                json.dump(out, f, indent=1)

    # -- tokens: CPU (gloo) vs device (NCCL), and vs the expected file made on CPU here -----------
    def _tokens():
        common = dict(num_speculative_tokens=2, max_new_tokens=32, max_num_batched_tokens=64, progress=False)
        runs = {}
        configs = [("cpu_pcp2", dict(device="cpu", pcp=2)), (f"{dev}_pcp1", dict(device=dev, pcp=1))]
        if max_pcp > 1:
            configs.insert(1, (f"{dev}_pcp2", dict(device=dev, pcp=2)))
        for name, kw in configs:
            runs[name] = pcpviz.run(short, trace_dir=args.trace_out if name == f"{dev}_pcp2" else None,
                                    **common, **kw).output_token_ids
        expected_path = os.path.join(ROOT, "data", "bench", "expected_tokens.json")
        expected = json.load(open(expected_path))["output_token_ids"] if os.path.exists(expected_path) else None
        ref = f"{dev}_pcp2" if max_pcp > 1 else f"{dev}_pcp1"
        out["tokens_equal"] = {
            f"cpu_pcp2_vs_{ref}": runs["cpu_pcp2"] == runs[ref],
            "device_pcp1_vs_pcp2": runs[f"{dev}_pcp1"] == runs[f"{dev}_pcp2"] if max_pcp > 1 else None,
            "vs_expected_file": (runs[ref] == expected) if expected is not None else None,
        }
        if expected is None and dev == "cpu":
            with open(expected_path, "w") as f:
                json.dump({"prompts": short, **{k: v for k, v in common.items() if k != "progress"},
                           "output_token_ids": runs["cpu_pcp2"]}, f)

    section('tokens', _tokens)

    # -- warm-up: compile the Triton kernels once (their disk cache is shared by the rank processes)
    def _warmup():
        for pcp, k in ((1, 0), (1, 2), (2, 2))[: 3 if max_pcp > 1 else 2]:
            run_(short[:1], pcp=pcp, num_speculative_tokens=k, max_new_tokens=8, device=dev, progress=False)

    section("warmup", _warmup)

    # -- prefill latency of one long prompt: PCP=2 over PCP=1 -------------------------------------
    # Two long prompts are prefilled in consecutive steps; the second step's target phase (from the
    # trace's t_start_us/t_end_us, slowest rank) is the measurement, so first-use costs (allocator
    # growth, library handles) fall on the first one.
    def _prefill():
        import tempfile

        import pcpviz.trace as pt

        second = long_ids[:1] + long_ids[len(long_ids) // 2:] + long_ids[1:len(long_ids) // 2]
        pre = dict(num_speculative_tokens=0, max_new_tokens=1, max_num_batched_tokens=len(long_ids) + 8,
                   device=dev, progress=False)
        secs, toks = {}, {}
        for pcp in (1, 2)[:max_pcp]:
            with tempfile.TemporaryDirectory() as d:
                res = run_([long_ids, second], pcp=pcp, trace_dir=d, time_phases=True, **pre)
                out["phases"][f"prefill_pcp{pcp}"] = phase_summary(res)
                print_phases(f"prefill_pcp{pcp}", out["phases"][f"prefill_pcp{pcp}"])
                t = pt.open(d)
                durations = []
                for step in t.steps:
                    recs = [t.record(step, r, "target") for r in t.ranks]
                    if int(recs[0]["num_scheduled_tokens"].sum()) >= len(long_ids) // 2:
                        durations.append(max(int(x["t_end_us"]) - int(x["t_start_us"]) for x in recs) / 1e6)
                secs[f"pcp{pcp}"] = durations
                toks[pcp] = res.output_token_ids
        out["prefill_step_s"] = secs
        if max_pcp > 1:
            out["prefill_pcp2_over_pcp1"] = secs["pcp2"][-1] / secs["pcp1"][-1]
            out["prefill_tokens_equal"] = toks[1] == toks[2]
        out["prefill_step_ms_pcp1"] = 1e3 * secs["pcp1"][-1]

    section('prefill', _prefill)

    # -- MTP decode speed at batch 1 -------------------------------------------------------------
    dec = dict(max_new_tokens=args.decode_tokens, device=dev, progress=False, pcp=1)
    decode_runs = {}

    def _mtp_decode():
        for k in (0, 2):
            res, timed = best(lambda tp: run_(short[:1], num_speculative_tokens=k, time_phases=tp, **dec),
                              args.repeat)
            decode_runs[k] = res
            out["phases"][f"decode_k{k}"] = dict(phase_summary(timed), untimed_best_wall_s=res.wall_s)
            print_phases(f"decode_k{k}", out["phases"][f"decode_k{k}"])
        k0, k2 = decode_runs[0], decode_runs[2]
        loop = {k: steady_s(r) for k, r in decode_runs.items()}
        out["decode_tok_s"] = {"k0": args.decode_tokens / loop[0], "k2": args.decode_tokens / loop[2]}
        out["decode_ms_per_token"] = {"k0": 1e3 * loop[0] / args.decode_tokens,
                                      "k2": 1e3 * loop[2] / args.decode_tokens}
        out["decode_graphs"] = {"k0": k0.graphs, "k2": k2.graphs}
        out["mtp_decode_speedup"] = loop[0] / loop[2]
        steady = {f"k{k}": steady_decode(r) for k, r in decode_runs.items()}
        if steady["k0"]["ms_per_token"] and steady["k2"]["ms_per_token"]:
            steady["mtp_speedup"] = steady["k0"]["ms_per_token"] / steady["k2"]["ms_per_token"]
        out["decode_steady"] = steady
        out["mtp_tokens_equal"] = k0.output_token_ids == k2.output_token_ids

    section('mtp_decode', _mtp_decode)

    # -- MTP at batch 16: K=2 over K=0 per token, interleaved repeats ----------------------------
    def _mtp_batch16():
        batch = (short * 2)[:16]  # the 8 short prompts twice
        runs: dict = {}
        for _ in range(args.repeat):  # interleaved, so drift on the machine falls on both
            for k in (0, 2):
                runs.setdefault(k, []).append(run_(batch, num_speculative_tokens=k, **dec))
        cell = {}
        for k, rs in runs.items():
            st = sorted((steady_decode(r) for r in rs), key=lambda d: d["ms_per_token"] or float("inf"))
            cell[f"k{k}"] = dict(st[0], all_ms_per_step=[d["ms_per_step"] for d in st])
        if cell["k0"]["ms_per_token"] and cell["k2"]["ms_per_token"]:
            cell["mtp_speedup"] = cell["k0"]["ms_per_token"] / cell["k2"]["ms_per_token"]
        cell["tokens_equal"] = runs[0][0].output_token_ids == runs[2][0].output_token_ids
        out["mtp_batch16"] = cell

    section('mtp_batch16', _mtp_batch16)

    # -- decode at PCP=2, batch 1: the configuration real vLLM's decode figures were taken in ---
    def _decode_pcp2():
        ms = {}
        for k in (0, 2):
            res = run_(short[:1], num_speculative_tokens=k, **dict(dec, pcp=2))
            ms[f"k{k}"] = 1e3 * steady_s(res) / args.decode_tokens
            ms[f"k{k}_steady"] = steady_decode(res)
        out["decode_ms_per_token_pcp2"] = ms

    if max_pcp > 1:
        section("decode_pcp2", _decode_pcp2)

    # -- decode steps from CUDA graphs against the eager path (same tokens?) ---------------------
    def _graphs():
        off = {}
        for k in (0, 2):
            res = run_(short[:1], num_speculative_tokens=k, cuda_graphs=False, time_phases=True, **dec)
            off[k] = res
            out["phases"][f"decode_k{k}_graphs_off"] = phase_summary(res)
            print_phases(f"decode_k{k}_graphs_off", out["phases"][f"decode_k{k}_graphs_off"])
        out["graphs"] = {
            "decode_tok_s_graphs_off": {f"k{k}": args.decode_tokens / r.wall_s for k, r in off.items()},
            "mtp_decode_speedup_graphs_off": off[0].wall_s / off[2].wall_s,
            "tokens_equal_graphs_on_off": all(off[k].output_token_ids == decode_runs[k].output_token_ids
                                              for k in off if k in decode_runs),
        }

    if dev == "cuda":
        section("graphs", _graphs)

    # -- the decode graphs' model code through torch.compile or not (PCPVIZ_COMPILE) ---------------
    def _compile():
        runs: dict = {}
        for rep in range(args.repeat):  # interleaved, so drift on the machine falls on both
            for k in (0, 2):
                for flag in ("0", "1"):
                    os.environ["PCPVIZ_COMPILE"] = flag
                    try:
                        res = run_(short[:1], num_speculative_tokens=k, **dec)
                    finally:
                        os.environ.pop("PCPVIZ_COMPILE", None)
                    runs.setdefault((flag, k), []).append(res)
        cell = {}
        for (flag, k), rs in runs.items():
            ms = sorted(steady_decode(r)["ms_per_step"] for r in rs)
            cell[f"compile{flag}_k{k}"] = {"ms_per_step": ms[0], "all_ms_per_step": ms,
                                          "tokens_per_step": steady_decode(rs[0])["tokens_per_step"]}
        for flag in ("0", "1"):
            k0, k2 = cell[f"compile{flag}_k0"], cell[f"compile{flag}_k2"]
            cell[f"compile{flag}_mtp_speedup"] = k0["ms_per_step"] * k2["tokens_per_step"] / k2["ms_per_step"]
        cell["tokens_equal"] = all(runs[("0", k)][0].output_token_ids == runs[("1", k)][0].output_token_ids
                                   for k in (0, 2))
        out["compile"] = cell

    if dev == "cuda":
        section("compile", _compile)

    # -- acceptance per position on held-out source, K=2 and K=3 ----------------------------------
    def _acceptance():
        acc = {}
        for k in (2, 3):
            r = run_(prompts["short"], pcp=max_pcp, num_speculative_tokens=k, device=dev,
                           max_new_tokens=args.decode_tokens // 2, progress=False)
            acc[f"k{k}"] = {"per_pos": r.acceptance_rate_per_pos, "mean_acceptance_length": r.mean_acceptance_length,
                            "num_drafts": r.num_drafts}
        out["acceptance_rate_per_pos"] = acc

    section('acceptance', _acceptance)

    # -- recording overhead ------------------------------------------------------------------------
    def _recording():
        import tempfile

        rec = dict(pcp=max_pcp, num_speculative_tokens=2, device=dev, max_new_tokens=args.decode_tokens // 2,
                   progress=False)
        off, off_timed = best(lambda tp: run_(short, time_phases=tp, **rec), args.repeat)
        with tempfile.TemporaryDirectory() as d:
            on, on_timed = best(lambda tp: run_(short, trace_dir=d, overwrite=True, time_phases=tp, **rec),
                                args.repeat)
        for name, r, timed in (("trace_off", off, off_timed), ("trace_on", on, on_timed)):
            out["phases"][f"recording_{name}"] = dict(phase_summary(timed), untimed_best_wall_s=r.wall_s)
            print_phases(f"recording_{name}", out["phases"][f"recording_{name}"])
        out["loop_s"] = {"trace_off": steady_s(off), "trace_on": steady_s(on)}
        out["recording_overhead"] = steady_s(on) / steady_s(off)
        out["recording_tokens_equal"] = on.output_token_ids == off.output_token_ids

    section('recording', _recording)

    if dev == "cuda":  # vLLM's figures are from the H200s: no peer for a CPU run
        out["beside_vllm"] = beside_vllm(out)
    print(json.dumps(out, indent=1))
    print("  ".join(f"{k} {out[k]:.3f}" if isinstance(out.get(k), float) else f"{k} n/a"
                    for k in ("prefill_pcp2_over_pcp1", "mtp_decode_speedup", "recording_overhead")))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        merged = {}
        if os.path.exists(args.out):
            try:
                with open(args.out) as f:
                    merged = json.load(f)
            except (OSError, ValueError):
                merged = {}
        merged.update(out)
        if "errors" not in out:
            merged.pop("errors", None)  # an earlier run's errors are not this run's
        with open(args.out, "w") as f:
            json.dump(merged, f, indent=1)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"total {time.time() - t0:.0f}s", file=sys.stderr)
