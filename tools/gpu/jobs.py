"""On the GPU machine (after tools/gpu/install.py): the real-vLLM jobs behind data/traces and
data/bench/vllm_h200x2.json.

    source /root/pcpviz-gpu/env.sh
    python3 tools/gpu/jobs.py --out $OUT trace-k2 trace-chunked engine      # any subset, in order
    python3 tools/gpu/jobs.py --list

Each job runs in child processes with its own time limit; a failed job is logged and the next one
runs. Results accumulate in ``$PCPVIZ_GPU_HOME/results`` (traces/, bench/, logs/, jobs.json) and,
after every job, the whole folder is packed into ``OUT/results.tar.xz`` (with ``OUT/jobs.log``),
so a command stopped at its limit still returns what finished.

The prompts are held-out standard-library sources (``data/bench/prompts.json``), the same ones
the engine and the parity test use. Every vLLM job runs eager (``cudagraph_mode`` NONE) unless its
name says otherwise, with the settings docs/gpu.md explains.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
import urllib.request
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOME = Path(os.environ.get("PCPVIZ_GPU_HOME", "/root/pcpviz-gpu"))
RESULTS = HOME / "results"
MODEL = str(REPO / "data" / "models" / "pcpviz-tiny-dsv3")
PROMPTS = json.loads((REPO / "data" / "bench" / "prompts.json").read_text())
TRACE_PROMPTS = PROMPTS["short"][:4]
CHUNKED_PROMPTS = PROMPTS["short"][4:7] + [PROMPTS["long"][:9000]]
CHUNKED_TOKENS = 10  # few decode steps after the long prefill: its block-table rows are 563 wide
MAX_TOKENS = 48
BATCH_TOKENS = 2048  # the engine's default budget: same budget, same scheduled batches
# Settings every real-vLLM job here uses (docs/gpu.md says why each is needed on this machine).
ENGINE_ARGS = {"gpu_memory_utilization": 0.3, "disable_custom_all_reduce": True,
               "max_num_batched_tokens": BATCH_TOKENS, "disable_log_stats": False}

JOBS: dict[str, Callable[[dict], dict]] = {}


def job(name: str) -> Callable[[Callable[[dict], dict]], Callable[[dict], dict]]:
    def deco(fn: Callable[[dict], dict]) -> Callable[[dict], dict]:
        JOBS[name] = fn
        return fn

    return deco


def _log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    with (RESULTS / "jobs.log").open("a") as f:
        f.write(line + "\n")


def _check(trace_dir: Path) -> dict:
    """``pcpviz check`` on a trace: exit code and its last line."""
    res = subprocess.run([sys.executable, "-m", "pcpviz.cli", "check", str(trace_dir)], capture_output=True,
                         text=True, timeout=300)
    out = (res.stdout + res.stderr).strip().splitlines()
    return {"check_rc": res.returncode, "check": out[-1] if out else "", "check_out": out[-40:]}


def _vllm_trace(name: str, *, job_name: str, k: int, prompts: list, mode: str = "NONE",
                max_tokens: int = MAX_TOKENS, extra: dict | None = None, timeout_s: float = 420,
                pcp: int = 2, model: str = MODEL) -> dict:
    from pcpviz.vllm.launch import run

    trace_dir = RESULTS / "traces" / name
    lines: list[str] = []
    t0 = time.time()
    try:
        trace, outputs = run(model, prompts, pcp=pcp, num_speculative_tokens=k, trace_dir=trace_dir,
                             max_tokens=max_tokens, cudagraph_mode=mode,
                             extra_engine_args={**ENGINE_ARGS, **(extra or {})}, progress=lines.append,
                             timeout_s=timeout_s)
    finally:
        (RESULTS / "logs" / f"{name}.log").write_text("\n".join(lines) + "\n")
    if trace is None:  # flight recorder: dumps only
        return {"trace": str(trace_dir.relative_to(RESULTS)), "seconds": round(time.time() - t0, 1),
                "tokens": [len(o) for o in outputs]}
    _stamp(trace_dir, job_name)
    return {"trace": str(trace_dir.relative_to(RESULTS)), "seconds": round(time.time() - t0, 1),
            "steps": len(trace.steps), "tokens": [len(o) for o in outputs], **_check(trace_dir)}


def _stamp(trace_dir: Path, job_name: str) -> None:
    """Add the job's own command line to run.json (the plugin wrote the rest)."""
    meta_path = trace_dir / "run.json"
    meta = json.loads(meta_path.read_text())
    meta["job"] = {"name": job_name, "command": f"python3 tools/gpu/jobs.py {job_name}",
                   "settings": {k: os.environ.get(k) for k in sorted(os.environ) if k.startswith(("VLLM_", "NCCL_"))}}
    from pcpviz.trace import write_run_meta

    write_run_meta(trace_dir, meta)


@job("trace-k1")
def _k1(_: dict) -> dict:
    return _vllm_trace("vllm-h200x2-pcp2-mtp1", job_name="trace-k1", k=1, prompts=TRACE_PROMPTS)


@job("trace-k2")
def _k2(_: dict) -> dict:
    return _vllm_trace("vllm-h200x2-pcp2-mtp2", job_name="trace-k2", k=2, prompts=TRACE_PROMPTS)


@job("trace-k3")
def _k3(_: dict) -> dict:
    return _vllm_trace("vllm-h200x2-pcp2-mtp3", job_name="trace-k3", k=3, prompts=TRACE_PROMPTS)


@job("trace-chunked")
def _chunked(_: dict) -> dict:
    """Three short prompts first (they prefill first, then decode), then a 9,000-token prompt that
    the 2,048-token budget prefills in chunks over five steps while they decode."""
    return _vllm_trace("vllm-h200x2-pcp2-mtp2-chunked", job_name="trace-chunked", k=2, prompts=CHUNKED_PROMPTS,
                       max_tokens=CHUNKED_TOKENS)


@job("trace-piecewise")
def _piecewise(_: dict) -> dict:
    return _vllm_trace("vllm-h200x2-pcp2-mtp2-piecewise", job_name="trace-piecewise", k=2, prompts=TRACE_PROMPTS,
                       mode="PIECEWISE", timeout_s=540)


@job("piecewise-address-check")
def _piecewise_address_check(_: dict) -> dict:
    """trace-piecewise with VLLM_LOGGING_LEVEL=DEBUG, which makes vLLM's CUDAGraphWrapper assert
    that every replay gets the input addresses its graph was captured with
    (compilation/cuda_graph.py). Reports the first assertion and the frames that led to it."""
    os.environ["VLLM_LOGGING_LEVEL"] = "DEBUG"
    try:
        try:
            result = _vllm_trace("vllm-h200x2-pcp2-mtp2-piecewise-debug", job_name="piecewise-address-check", k=2,
                                 prompts=TRACE_PROMPTS, mode="PIECEWISE", timeout_s=540)
        except Exception as exc:  # noqa: BLE001 - the assertion is the expected outcome
            result = {"run": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
    log = (RESULTS / "logs" / "vllm-h200x2-pcp2-mtp2-piecewise-debug.log").read_text().splitlines()
    hits = [i for i, ln in enumerate(log) if "Input addresses for cudagraphs are different" in ln]
    frames = []
    if hits:
        start = max(0, hits[0] - 60)
        frames = [ln.strip()[:200] for ln in log[start:hits[0] + 1]
                  if 'File "' in ln or "Input addresses" in ln or "_run_model" in ln or "propose" in ln]
    (RESULTS / "logs" / "piecewise-address-check.txt").write_text("\n".join(frames))
    return {**result, "assertions": len(hits), "frames": frames[-14:]}


def _diff(good: Path, bad: Path) -> dict:
    """``pcpviz diff GOOD BAD``: exit code and the result lines."""
    res = subprocess.run([sys.executable, "-m", "pcpviz.cli", "diff", str(good), str(bad)], capture_output=True,
                         text=True, timeout=300)
    out = (res.stdout + res.stderr).strip().splitlines()
    return {"diff_rc": res.returncode, "diff": [ln for ln in out if "result" in ln or "first divergence" in ln
                                                or "compared" in ln or "note" in ln][:8]}


def _pcp1(name: str, job_name: str, mode: str) -> dict:
    """PCP=1 (one GPU), the prompts, K and budget of trace-k2: the GOOD run for the shipped PCP=2
    trace (issue 24); the job also diffs them and says how the trace ended."""
    out = _vllm_trace(name, job_name=job_name, k=2, prompts=TRACE_PROMPTS, mode=mode, pcp=1,
                      timeout_s=540 if mode != "NONE" else 420)
    trace_dir = RESULTS / "traces" / name
    out.update(_diff(REPO / "data" / "traces" / "vllm-h200x2-pcp2-mtp2", trace_dir))
    out["complete"] = json.loads((trace_dir / "complete.json").read_text()) if (trace_dir / "complete.json").exists() \
        else None
    return out


@job("trace-pcp1")
def _trace_pcp1(_: dict) -> dict:
    return _pcp1("vllm-h200x1-pcp1-mtp2", "trace-pcp1", "NONE")


@job("trace-pcp1-piecewise")
def _trace_pcp1_piecewise(_: dict) -> dict:
    return _pcp1("vllm-h200x1-pcp1-mtp2-piecewise", "trace-pcp1-piecewise", "PIECEWISE")


@job("flight-pcp1")
def _flight_pcp1(_: dict) -> dict:
    """The flight recorder on real vLLM (PCP=1, eager): the last 16 steps kept; acceptance below
    0.9 over 8 drafted steps dumps them (this model accepts ~0.6), as does the shutdown."""
    env = {"PCPVIZ_FLIGHT_RECORDER": "16", "PCPVIZ_FLIGHT_ACCEPTANCE": "0.9", "PCPVIZ_FLIGHT_WINDOW": "8",
           "PCPVIZ_FLIGHT_MAX_DUMPS": "2"}
    os.environ.update(env)
    try:
        out = _vllm_trace("vllm-h200x1-pcp1-mtp2-flight", job_name="flight-pcp1", k=2, prompts=TRACE_PROMPTS,
                          pcp=1)
    finally:
        for key in env:
            os.environ.pop(key, None)
    base = RESULTS / "traces" / "vllm-h200x1-pcp1-mtp2-flight"
    out["env"] = env
    out["dumps"] = {d.name: _check(d) for d in sorted(base.glob("flight-*"))}
    return out


def _script(name: str, cmd: list[str], timeout_s: float = 540) -> dict:
    """Run one of the repository's scripts in a child process (its output in logs/NAME.log)."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        out, rc = res.stdout + res.stderr, res.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = f"{exc.stdout or ''}{exc.stderr or ''}\ntimed out after {timeout_s:.0f} s", 124
        out = out if isinstance(out, str) else out.decode(errors="replace")
    (RESULTS / "logs" / f"{name}.log").write_text(out)
    return {"rc": rc, "command": shlex.join(cmd), "tail": out.strip().splitlines()[-16:]}


@job("overhead")
def _overhead(_: dict) -> dict:
    """benchmarks/bench_plugin_overhead.py: recording off / on / flight recorder, interleaved, 9
    repeats, one process, FULL_AND_PIECEWISE, the four workloads (the batch-64 32k-context memory
    measurement left out: ``overhead-long``); data/bench/plugin_overhead_h200x1.json."""
    out = RESULTS / "bench" / "plugin_overhead_h200x1.json"
    return _script("overhead", [sys.executable, str(REPO / "benchmarks" / "bench_plugin_overhead.py"), "--out",
                                str(out), "--repeats", "9", "--no-long"])


@job("overhead-long")
def _overhead_long(_: dict) -> dict:
    """bench_plugin_overhead.py's batch-64 32k-context trace / ring bytes and host memory only."""
    out = RESULTS / "bench" / "plugin_overhead_h200x1_b64.json"
    return _script("overhead-long", [sys.executable, str(REPO / "benchmarks" / "bench_plugin_overhead.py"),
                                     "--out", str(out), "--long-only"])


@job("profile")
def _profile(_: dict) -> dict:
    """tools/gpu/profile_plugin.py: cProfile of a batch-1 decode (FULL_AND_PIECEWISE), off / flight /
    record, and the host microseconds per step inside the hooks."""
    out = RESULTS / "bench" / "plugin_profile_h200x1.txt"
    return _script("profile", [sys.executable, str(REPO / "tools" / "gpu" / "profile_plugin.py"), "--out", str(out)])


FULL_TRACE = "vllm-h200x1-pcp1-mtp2-full"


@job("trace-full-pcp1")
def _trace_full_pcp1(_: dict) -> dict:
    """PCP=1, K=2, vLLM's default FULL_AND_PIECEWISE, three prompts: the draft phases replayed as FULL
    graphs carry their views (fwd_source graph_capture / graph_buffers) and ``pcpviz check`` runs its
    draft checks and forward_consumed_prepared on them. The trace is packed alone too (``OUT``)."""
    out = _vllm_trace(FULL_TRACE, job_name="trace-full-pcp1", k=2, prompts=TRACE_PROMPTS[:3], mode="FULL_AND_PIECEWISE",
                      pcp=1, max_tokens=32, timeout_s=420)
    out.update(_full_phases(RESULTS / "traces" / FULL_TRACE))
    return out


def _full_phases(trace_dir: Path) -> dict:
    """Draft phases per graph_mode and fwd_source, and the size of the trace."""
    import numpy as np

    import pcpviz.trace as pt

    t = pt.open(trace_dir)
    counts: dict[str, int] = {}
    for step in t.steps:
        for rank in t.ranks:
            for ph in t.phases(step, rank):
                if not ph.startswith("draft_"):
                    continue
                rec = t.record(step, rank, ph)
                key = f"{ph}:{np.asarray(rec.get('graph_mode', 'NONE'))}:{np.asarray(rec.get('fwd_source', '-'))}"
                counts[key] = counts.get(key, 0) + 1
    size = sum(f.stat().st_size for f in trace_dir.rglob("*") if f.is_file())
    return {"draft_phases": counts, "trace_bytes": size}


MOE_MODEL = os.environ.get("PCPVIZ_MOE_MODEL", str(REPO / "data" / "models" / "pcpviz-tiny-moe-dsa"))


@job("trace-moe-pcp1")
def _trace_moe_pcp1(_: dict) -> dict:
    """The MoE + DSA model (``pcpviz-tiny-moe-dsa``; ``PCPVIZ_MOE_MODEL`` names another copy) through
    vLLM 0.33.0's own kernels: PCP=1, K=2, eager, three prompts; the byte tokenizer through
    ``tokenizer_mode="hf"`` (vLLM picks "deepseek_v32" for this architecture, ``config/model.py:756``).
    Needs the extras (``stage.py --extras``: the fused MoE's ops, DeepGEMM for the indexer, the CuTe
    DSL). The model is first made one vLLM's CUDA kernels take (``tools/gpu/pad_indexer.py``): on
    compute capability 9 its indexer widened to 32 heads, the added ones inert (DeepGEMM's MQA
    logits take 32 or 64 heads there), and ``index_topk`` raised to a multiple of 128 (the sparse
    MLA's slot mapping, ``sparse_utils.py:549``): 64 -> 128, a change of the model past 64 keys."""
    model, note = _deepgemm_ready(MOE_MODEL)
    res = _vllm_trace("vllm-h200x1-pcp1-mtp2-moe-dsa", job_name="trace-moe-pcp1", k=2, prompts=TRACE_PROMPTS[:3],
                      mode="NONE", pcp=1, max_tokens=32, timeout_s=480, model=model,
                      extra={"tokenizer_mode": "hf"})
    return {**res, "model": model, "model_note": note}


def _deepgemm_ready(model: str) -> tuple[str, str]:
    """``model``, or the copy of it vLLM's CUDA kernels take (see ``trace-moe-pcp1``) and what changed."""
    import torch

    cfg = json.loads((Path(model) / "config.json").read_text())
    heads, topk = cfg.get("index_n_heads"), cfg.get("index_topk")
    major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0
    new_heads = 32 if heads is not None and heads not in (32, 64) and major == 9 else heads
    new_topk = -(-topk // 128) * 128 if topk is not None and topk % 128 else topk
    if (new_heads, new_topk) == (heads, topk):
        return model, "as shipped"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pad_indexer import pad_indexer_heads

    out = HOME / "models" / f"{Path(model).name}-h{new_heads}-topk{new_topk}"
    if not (out / "config.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        pad_indexer_heads(Path(model), out, heads=new_heads, topk=new_topk)
    return str(out), (f"indexer heads {heads} -> {new_heads} (added heads inert), index_topk {topk} -> {new_topk} "
                      "(tools/gpu/pad_indexer.py)")


@job("engine")
def _engine(_: dict) -> dict:
    """Our engine on the 2 GPUs (NCCL), the same prompts and budget as trace-k2."""
    return _engine_runs("engine-h200x2-pcp2-mtp2", "vllm-h200x2-pcp2-mtp2", TRACE_PROMPTS, MAX_TOKENS)


@job("engine-chunked")
def _engine_chunked(_: dict) -> dict:
    """Our engine on the 2 GPUs, the same prompts and budget as trace-chunked."""
    return _engine_runs("engine-h200x2-pcp2-mtp2-chunked", "vllm-h200x2-pcp2-mtp2-chunked", CHUNKED_PROMPTS,
                        CHUNKED_TOKENS)


def _engine_runs(prefix: str, vllm_name: str, prompts: list[str], max_tokens: int) -> dict:
    out: dict = {}
    prompts_file = RESULTS / f"{prefix}-prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    ref = RESULTS / "traces" / vllm_name / "run.json"
    block = json.loads(ref.read_text()).get("block_size", 16) if ref.exists() else 16  # vLLM's, for parity
    out["block_size"] = block
    for dtype in ("float32", "bfloat16"):
        name = f"{prefix}-{dtype}"
        trace_dir = RESULTS / "traces" / name
        cmd = [sys.executable, "-m", "pcpviz.cli", "run", "--pcp", "2", "--mtp", "2", "--device", "cuda",
               "--prompts-file", str(prompts_file), "--max-new-tokens", str(max_tokens),
               "--max-num-batched-tokens", str(BATCH_TOKENS), "--block-size", str(block),
               "--trace", str(trace_dir), "--json", str(RESULTS / "logs" / f"{name}.json"), "--quiet"]
        if dtype != "float32":
            cmd += ["--dtype", dtype]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        (RESULTS / "logs" / f"{name}.log").write_text(res.stdout + res.stderr)
        out[dtype] = {"rc": res.returncode, "tail": (res.stdout + res.stderr).strip().splitlines()[-3:]}
        if res.returncode == 0:
            out[dtype].update(_check(trace_dir))
    return out


@job("serve")
def _serve(_: dict) -> dict:
    """README's `vllm serve` recipe: three completions over HTTP on 127.0.0.1, then SIGINT."""
    trace_dir = RESULTS / "traces" / "vllm-serve-h200x2-pcp2-mtp2"
    port = 8011
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", MODEL, "--host", "127.0.0.1", "--port",
           str(port), "--prefill-context-parallel-size", "2", "--speculative-config",
           '{"method": "mtp", "num_speculative_tokens": 2}', "--enforce-eager", "--disable-custom-all-reduce",
           "--gpu-memory-utilization", "0.3", "--max-num-batched-tokens", str(BATCH_TOKENS)]
    env = {**os.environ, "PCPVIZ_TRACE_DIR": str(trace_dir)}
    log = (RESULTS / "logs" / "serve.log").open("w")
    log.write("$ PCPVIZ_TRACE_DIR=... " + shlex.join(cmd) + "\n")
    log.flush()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.time()
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode} before it was ready")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > 300:
                raise RuntimeError("vllm serve not ready after 300 s")
            time.sleep(1)
        ready_s = time.time() - t0
        completions = []
        for p in TRACE_PROMPTS[:3]:
            body = json.dumps({"model": MODEL, "prompt": p, "max_tokens": 32, "temperature": 0.0}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                completions.append(json.loads(r.read())["choices"][0]["text"])
        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        spec = [ln for ln in metrics.splitlines() if ln.startswith("vllm:spec_decode") and "_created" not in ln]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        log.close()
    meta_path = trace_dir / "run.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        meta["serve"] = {"command": "PCPVIZ_TRACE_DIR=" + str(trace_dir) + " " + shlex.join(cmd),
                         "completions": completions, "spec_decode_metrics": spec}
        from pcpviz.trace import write_run_meta

        write_run_meta(trace_dir, meta)
    return {"ready_s": round(ready_s, 1), "shutdown_rc": rc, "completions": [c[:40] for c in completions],
            "spec_metrics": spec[:12], **(_check(trace_dir) if meta_path.exists() else {"check": "no trace"})}


# A child process that runs vLLM without the recording plugin (a FULL replay runs no Python, so
# nothing could be recorded) and prints one RESULT line: tokens and vLLM's spec-decode counters.
_UNRECORDED_CHILD = r"""
import json, sys, time
from vllm import LLM, SamplingParams
job = json.loads(sys.argv[1])
llm = LLM(**job["llm"])
t0 = time.time()
outs = llm.generate(job["prompts"], SamplingParams(temperature=0.0, max_tokens=job["max_tokens"]))
metrics = {m.name: getattr(m, "values", getattr(m, "value", None))
           for m in llm.get_metrics() if "spec_decode" in m.name}
print("RESULT " + json.dumps({"seconds": round(time.time() - t0, 1), "metrics": metrics,
                              "tokens": [list(o.outputs[0].token_ids) for o in outs]}, default=str), flush=True)
"""


def unrecorded_job(prompts: list, mode: str, *, max_tokens: int = 24) -> dict:
    """The ``vllm.LLM`` keywords and inputs of one unrecorded PCP = 2, K = 2 run in ``mode``."""
    llm = {"model": MODEL, "prefill_context_parallel_size": 2, "seed": 0, "enforce_eager": mode == "NONE",
           "speculative_config": {"method": "mtp", "num_speculative_tokens": 2},
           "compilation_config": {"cudagraph_mode": mode}, **ENGINE_ARGS}
    return {"llm": llm, "prompts": prompts, "max_tokens": max_tokens}


def _unrecorded(name: str, job_spec: dict, timeout_s: float = 420) -> dict:
    """Run ``job_spec`` in its own session; a timeout (a hang) kills the whole process group."""
    env = {k: v for k, v in os.environ.items() if k != "PCPVIZ_TRACE_DIR"}
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    proc = subprocess.Popen([sys.executable, "-c", _UNRECORDED_CHILD, json.dumps(job_spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    t0 = time.time()
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        outcome = "completed" if proc.returncode == 0 else f"exited with code {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        outcome = f"timed out after {timeout_s:.0f} s (hung)"
    (RESULTS / "logs" / f"{name}.log").write_text(out or "")
    result = next((json.loads(ln[7:]) for ln in (out or "").splitlines() if ln.startswith("RESULT ")), {})
    return {"outcome": outcome, "seconds": round(time.time() - t0, 1), **result}


@job("full-graphs")
def _full_graphs(_: dict) -> dict:
    """docs/findings/full-draft-prefill-state.md on GPUs, tiny model, PCP = 2, K = 2, unrecorded: four
    prompts under FULL_DECODE_ONLY (decodes sharded over the ranks: no rank's draft prefill is a uniform
    batch, so no FULL draft prefill; the draft decodes replay FULL graphs), then one prompt eager and
    under FULL_DECODE_ONLY (one sharded decode: the owner rank's draft prefill replays a FULL graph while
    the other rank's runs eagerly with its all-gathers; the CPU replay predicts a hang)."""
    one = TRACE_PROMPTS[:1]
    return {"four_full_decode_only": _unrecorded("full-graphs-four", unrecorded_job(TRACE_PROMPTS, "FULL_DECODE_ONLY")),
            "one_eager": _unrecorded("full-graphs-one-eager", unrecorded_job(one, "NONE")),
            "one_full_decode_only": _unrecorded("full-graphs-one", unrecorded_job(one, "FULL_DECODE_ONLY"), 300)}


@job("bisect-pcp1")
def _bisect_pcp1(_: dict) -> dict:
    """``pcpviz bisect --producer vllm`` on one GPU: base PCP=1, K=2, FULL_AND_PIECEWISE (vLLM's
    default), the graph-mode knob (NONE, PIECEWISE); the report lands in bench/bisect_vllm_h200x1.json."""
    from pcpviz.bisect import bisect

    engine_args = {k: v for k, v in ENGINE_ARGS.items() if k != "max_num_batched_tokens"}
    report = bisect("vllm", out_dir=RESULTS / "traces" / "bisect-pcp1", knobs=["graph_mode"],
                    base={"pcp": 1, "k": 2, "engine_args": engine_args}, progress=_log)
    doc = {"command": "python3 tools/gpu/jobs.py --out $OUT bisect-pcp1", **report.to_dict(), "text": report.format()}
    (RESULTS / "bench" / "bisect_vllm_h200x1.json").write_text(json.dumps(doc, indent=1))
    return {"flips": doc["flips"], "text": doc["text"].splitlines()}


@job("bench")
def _bench(_: dict) -> dict:
    out = RESULTS / "bench" / "vllm_h200x2.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_vllm.py"), "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=560)
    (RESULTS / "logs" / "bench.log").write_text(res.stdout + res.stderr)
    return {"rc": res.returncode, "tail": (res.stdout + res.stderr).strip().splitlines()[-12:]}


def _pack(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    full = RESULTS / "traces" / FULL_TRACE
    if full.is_dir():  # the trace to ship, on its own
        with tarfile.open(out / f"{FULL_TRACE}.tar.xz", "w:xz", preset=6) as tar:
            tar.add(full, arcname=FULL_TRACE)
    tmp = out / "results.tar.xz.tmp"
    with tarfile.open(tmp, "w:xz", preset=6) as tar:
        tar.add(RESULTS, arcname="results")
    tmp.rename(out / "results.tar.xz")
    (out / "jobs.log").write_text((RESULTS / "jobs.log").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="real-vLLM jobs on the GPU machine")
    ap.add_argument("jobs", nargs="*", help="job names, run in order")
    ap.add_argument("--out", type=Path, default=None, help="pack results here after every job ($OUT)")
    ap.add_argument("--list", action="store_true", help="list the jobs and exit")
    a = ap.parse_args(argv)
    if a.list or not a.jobs:
        print("\n".join(JOBS))
        return 0
    unknown = [j for j in a.jobs if j not in JOBS]
    if unknown:
        ap.error(f"unknown job {unknown[0]!r}; one of: {', '.join(JOBS)}")
    for sub in ("traces", "logs", "bench"):
        (RESULTS / sub).mkdir(parents=True, exist_ok=True)
    summary_path = RESULTS / "jobs.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    for name in a.jobs:
        _log(f"job {name}: start")
        t0 = time.time()
        try:
            result = {"ok": True, **JOBS[name]({})}
        except BaseException as exc:  # noqa: BLE001 - report and go on with the next job
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                      "traceback": traceback.format_exc()[-3000:]}
            if isinstance(exc, KeyboardInterrupt):
                raise
        result["wall_s"] = round(time.time() - t0, 1)
        summary[name] = result
        summary_path.write_text(json.dumps(summary, indent=1))
        _log(f"job {name}: {'ok' if result['ok'] else 'FAILED'} in {result['wall_s']} s: "
             + json.dumps({k: v for k, v in result.items() if k not in ('traceback', 'check_out')})[:1500])
        if a.out is not None:
            _pack(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
