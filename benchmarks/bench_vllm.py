"""Real vLLM 0.33.0 on the shipped model: the peer figures for our engine (2 GPUs).

    source /root/pcpviz-gpu/env.sh      # after tools/gpu/install.py (docs/gpu.md)
    python3 benchmarks/bench_vllm.py --out data/bench/vllm_h200x2.json

One child process per configuration (a fresh ``vllm.LLM`` each, eager mode, the settings of
docs/gpu.md), every figure from one run:

* ``prefill_pcp2_over_pcp1``: time of a 16,384-token prefill (``max_tokens=1``, prefix caching off,
  a different prompt each repetition, median of 3 after one warm-up) at PCP=1 over PCP=2 (> 1:
  PCP=2 is faster);
* ``decode_mtp2_over_k0``: decode tokens per second at batch 1 (``(T(257) - T(1)) / 256`` from two
  generations of the same 256-token prompt) with MTP K=2 over no speculation, both at PCP=2;
* ``plugin_overhead``: PCP=2, K=2 with ``PCPVIZ_TRACE_DIR`` set over unset, for the prefill and the
  decode time (1.0: recording costs nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "data" / "models" / "pcpviz-tiny-dsv3")
PREFILL_TOKENS = 16384
DECODE_PROMPT_TOKENS = 256
DECODE_TOKENS = 256
CONFIGS = {
    "pcp2_k2_trace": {"pcp": 2, "k": 2, "trace": True, "measure": ["prefill", "decode"]},
    "pcp2_k2": {"pcp": 2, "k": 2, "trace": False, "measure": ["prefill", "decode"]},
    "pcp1_k2": {"pcp": 1, "k": 2, "trace": False, "measure": ["prefill"]},
    "pcp2_k0": {"pcp": 2, "k": 0, "trace": False, "measure": ["decode"]},
}


def _token_prompts() -> tuple[list[list[int]], list[int]]:
    sys.path.insert(0, str(ROOT))
    from pcpviz.engine.tokenizer import encode

    text = json.loads((ROOT / "data" / "bench" / "prompts.json").read_text())["long"]
    ids = encode(text)
    need = PREFILL_TOKENS + 4 * 997
    while len(ids) < need:
        ids = ids + ids[1:]
    prefill = [ids[i * 997: i * 997 + PREFILL_TOKENS] for i in range(4)]  # 1 warm-up + 3 measured
    return prefill, ids[-DECODE_PROMPT_TOKENS:]


def child(name: str, out_path: str) -> None:
    cfg = CONFIGS[name]
    from vllm import LLM, SamplingParams

    kwargs = dict(model=MODEL, prefill_context_parallel_size=cfg["pcp"], enforce_eager=True,
                  disable_custom_all_reduce=True, gpu_memory_utilization=0.3, enable_prefix_caching=False,
                  max_num_batched_tokens=PREFILL_TOKENS, seed=0)
    if cfg["k"]:
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": cfg["k"]}
    llm = LLM(**kwargs)
    prefill, decode_prompt = _token_prompts()
    res: dict = {"config": {**cfg, "llm_kwargs": kwargs}}

    def timed(prompt: list[int], n: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        return time.perf_counter() - t0

    if "prefill" in cfg["measure"]:
        timed(prefill[0], 1)
        times = [timed(p, 1) for p in prefill[1:]]
        res["prefill_s"] = statistics.median(times)
        res["prefill_s_all"] = times
    if "decode" in cfg["measure"]:
        timed(decode_prompt, 8)
        t1 = min(timed(decode_prompt, 1) for _ in range(2))
        tn = min(timed(decode_prompt, DECODE_TOKENS + 1) for _ in range(2))
        res["decode_tok_s"] = DECODE_TOKENS / (tn - t1)
        res["decode_ms_per_token"] = 1000 * (tn - t1) / DECODE_TOKENS
    Path(out_path).write_text(json.dumps(res))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "data" / "bench" / "vllm_h200x2.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.child_out)
        return 0
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        for name in a.configs.split(","):
            env = dict(os.environ)
            env.pop("PCPVIZ_TRACE_DIR", None)
            if CONFIGS[name]["trace"]:
                env["PCPVIZ_TRACE_DIR"] = os.path.join(tmp, f"trace-{name}")
            out = os.path.join(tmp, f"{name}.json")
            t0 = time.time()
            proc = subprocess.run([sys.executable, __file__, "--child", name, "--child-out", out], env=env,
                                  capture_output=True, text=True, timeout=300)
            if proc.returncode != 0 or not os.path.exists(out):
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
                results[name] = {"error": f"exit {proc.returncode}", "tail": tail}
                print(f"{name}: FAILED {tail[-1:] if tail else ''}", flush=True)
                continue
            results[name] = json.loads(Path(out).read_text())
            results[name]["wall_s"] = round(time.time() - t0, 1)
            print(f"{name}: {json.dumps({k: v for k, v in results[name].items() if k != 'config'})}", flush=True)
    ratios = {}
    r = results
    if "prefill_s" in r.get("pcp1_k2", {}) and "prefill_s" in r.get("pcp2_k2", {}):
        ratios["prefill_pcp2_over_pcp1"] = r["pcp1_k2"]["prefill_s"] / r["pcp2_k2"]["prefill_s"]
    if "decode_tok_s" in r.get("pcp2_k2", {}) and "decode_tok_s" in r.get("pcp2_k0", {}):
        ratios["decode_mtp2_over_k0"] = r["pcp2_k2"]["decode_tok_s"] / r["pcp2_k0"]["decode_tok_s"]
    on, off = r.get("pcp2_k2_trace", {}), r.get("pcp2_k2", {})
    if "prefill_s" in on and "prefill_s" in off:
        ratios["plugin_overhead_prefill"] = on["prefill_s"] / off["prefill_s"]
    if "decode_tok_s" in on and "decode_tok_s" in off:
        ratios["plugin_overhead_decode"] = off["decode_tok_s"] / on["decode_tok_s"]
    doc = {"what": "real vLLM 0.33.0, data/models/pcpviz-tiny-dsv3, eager, 2 GPUs; ratios from one run",
           "command": "python3 benchmarks/bench_vllm.py --out data/bench/vllm_h200x2.json",
           "prefill_tokens": PREFILL_TOKENS, "decode_tokens": DECODE_TOKENS, "ratios": ratios,
           "runs": results}
    try:
        import torch

        doc["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        doc["torch_version"] = torch.__version__
    except Exception:  # noqa: BLE001
        pass
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
