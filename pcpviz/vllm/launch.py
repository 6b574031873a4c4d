"""Run real vLLM 0.33.0 on GPUs under PCP + MTP with the pcpviz plugin recording a trace.

    from pcpviz.vllm import run
    trace, outputs = run("data/models/pcpviz-tiny-dsv3", ["def fib(n):"], pcp=2,
                         num_speculative_tokens=2, trace_dir="runs/gpu-pcp2-mtp2")
    trace.steps, outputs[0]                  # the pcpviz trace, generated token ids

``run`` launches ``vllm.LLM`` in a child process (``python -m pcpviz.vllm.launch JOB``) with
``PCPVIZ_TRACE_DIR`` set, so the ``vllm.general_plugins`` entry point
(``pcpviz.vllm.plugin:register``) swaps in the recording PCP manager in every worker; it
streams the child's output, then returns ``pcpviz.trace.open(trace_dir)`` and the generated
token ids. ``build_vllm_launch`` is the pure part (argv, environment, ``vllm.LLM`` keyword
arguments), so what would be launched can be inspected, and tested, without GPUs.

The ``vllm.LLM`` keywords are vLLM 0.33.0's own (``vllm/entrypoints/llm.py``;
``prefill_context_parallel_size`` and ``speculative_config`` are ``EngineArgs`` fields passed
through ``**kwargs``, ``vllm/engine/arg_utils.py``)::

    vllm.LLM(model=..., tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
             speculative_config={"method": "mtp", "num_speculative_tokens": K},
             compilation_config={"cudagraph_mode": "PIECEWISE"}, enforce_eager=False, seed=0)

The same deployment as a server (``vllm serve``; ``-pcp`` / ``-sc`` / ``-cc`` are the short forms)::

    PCPVIZ_TRACE_DIR=runs/serve-pcp2-mtp2 vllm serve data/models/pcpviz-tiny-dsv3 \\
        --tensor-parallel-size 1 --prefill-context-parallel-size 2 \\
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}' \\
        --enforce-eager

``pcp=1`` records a deployment without PCP (the baseline a PCP run of the same prompts is diffed
against). ``cudagraph_mode`` ``PIECEWISE``, ``NONE`` or ``FULL_AND_PIECEWISE`` (see
``CUDAGRAPH_MODES``: a FULL replay runs no Python, so the draft inputs of the steps it replays
are not recorded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pcpviz.vllm.contract import ENV_FIXES, ENV_TRACE_DIR, SUPPORTED_VLLM_VERSION  # the one definition

__all__ = ["run", "build_vllm_launch", "VllmLaunch", "LaunchError", "preflight", "gpus_missing", "CUDAGRAPH_MODES"]

CUDAGRAPH_MODES = ("PIECEWISE", "NONE", "FULL_AND_PIECEWISE")
"""What ``run`` records. FULL_AND_PIECEWISE replays uniform decode steps as FULL graphs: the
target's views and the verify outcome are recorded (their Python still runs), the draft phases
those graphs replay carry only their tokens (``graph_mode`` FULL; one warning)."""


class LaunchError(RuntimeError):
    """The run cannot start or failed; the message is one line."""


@dataclass(frozen=True)
class VllmLaunch:
    """Everything ``run`` launches: the child's ``argv``, the environment variables it adds
    (``env``), the ``vllm.LLM`` keyword arguments, the ``SamplingParams`` keywords and the
    prompts (text, or ``{"prompt_token_ids": [...]}``)."""

    argv: list[str]
    env: dict[str, str]
    llm_kwargs: dict[str, Any]
    sampling_kwargs: dict[str, Any]
    prompts: list[Any]
    trace_dir: Path
    num_gpus: int
    job: dict[str, Any] = field(default_factory=dict)


def _prompt(p: Any) -> Any:
    if isinstance(p, str):
        return p
    if isinstance(p, Sequence) and not isinstance(p, (bytes, bytearray)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not p:
            raise ValueError("a token-id prompt is empty")
        return {"prompt_token_ids": [int(t) for t in p]}
    raise ValueError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")


def build_vllm_launch(
    model: str | os.PathLike,
    prompts: Sequence[str | Sequence[int]],
    *,
    pcp: int = 2,
    tp: int = 1,
    num_speculative_tokens: int = 2,
    trace_dir: str | os.PathLike,
    max_tokens: int = 32,
    cudagraph_mode: str = "PIECEWISE",
    extra_engine_args: Mapping[str, Any] | None = None,
    python: str | None = None,
    job_path: str | os.PathLike | None = None,
    base_env: Mapping[str, str] | None = None,
    fixes: str | None = None,
) -> VllmLaunch:
    """The launch ``run`` would make, without making it (pure: no import of vLLM or torch).

    Raises ValueError (one line) for a bad configuration. ``extra_engine_args`` are more
    ``vllm.LLM`` keywords (they may override the ones built here, except ``model``).
    """
    for name, value, low in (("pcp", pcp, 1), ("tp", tp, 1), ("num_speculative_tokens", num_speculative_tokens, 1),
                             ("max_tokens", max_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    mode = str(cudagraph_mode).upper()
    if mode not in CUDAGRAPH_MODES:
        raise ValueError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, got {cudagraph_mode!r} "
                         "(FULL and FULL_DECODE_ONLY replay the drafter's steps with no Python running: the "
                         "recording would miss their inputs)")
    if isinstance(prompts, (str, bytes)) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings or token-id lists")
    prompt_list = [_prompt(p) for p in prompts]
    if trace_dir is None or str(trace_dir) == "":
        raise ValueError("trace_dir is required")
    trace_path = Path(trace_dir).absolute()
    if trace_path.exists() and not trace_path.is_dir():
        raise ValueError(f"trace_dir {trace_path} exists and is not a directory")
    if trace_path.is_dir() and any(trace_path.glob("rank*.arrow")):
        raise ValueError(f"trace_dir {trace_path} already holds a trace; choose a new directory")
    extra = dict(extra_engine_args or {})
    if "model" in extra:
        raise ValueError("extra_engine_args must not set 'model' (pass it as the first argument)")
    model_str = str(model)
    llm_kwargs: dict[str, Any] = {
        "model": model_str,
        "tensor_parallel_size": tp,
        "prefill_context_parallel_size": pcp,
        "speculative_config": {"method": "mtp", "num_speculative_tokens": num_speculative_tokens},
        "compilation_config": {"cudagraph_mode": mode},
        "enforce_eager": mode == "NONE",
        "seed": 0,
    }
    llm_kwargs.update(extra)
    sampling = {"temperature": 0.0, "max_tokens": max_tokens}
    env = {ENV_TRACE_DIR: str(trace_path), "VLLM_USE_V2_MODEL_RUNNER": "1"}  # PCP exists only in MRv2
    if fixes is not None:  # the plugin applies them in the child (pcpviz.vllm.fixes)
        env[ENV_FIXES] = fixes
    plugins = (base_env if base_env is not None else os.environ).get("VLLM_PLUGINS")
    if plugins is not None and "pcpviz" not in [p.strip() for p in plugins.split(",")]:
        # VLLM_PLUGINS filters the general plugins vLLM loads; keep ours in.
        env["VLLM_PLUGINS"] = ",".join([p for p in plugins.split(",") if p.strip()] + ["pcpviz"])
    job = {"llm_kwargs": llm_kwargs, "sampling": sampling, "prompts": prompt_list}
    job_file = str(job_path) if job_path is not None else "JOB.json"
    argv = [python or sys.executable, "-u", "-m", "pcpviz.vllm.launch", job_file]
    return VllmLaunch(argv=argv, env=env, llm_kwargs=llm_kwargs, sampling_kwargs=sampling, prompts=prompt_list,
                      trace_dir=trace_path, num_gpus=pcp * tp, job=job)


def _installed_vllm_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def _visible_gpus() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def preflight(num_gpus: int) -> None:
    """Raise LaunchError (one line) unless vLLM 0.33.0 is installed and ``num_gpus`` GPUs
    are visible."""
    version = _installed_vllm_version()
    if version is None:
        raise LaunchError("vLLM is not installed: pip install vllm==0.33.0 (with its dependencies, on a GPU "
                          "machine) to run pcpviz.vllm.run")
    if version != SUPPORTED_VLLM_VERSION:
        raise LaunchError(f"pcpviz.vllm.run needs vLLM {SUPPORTED_VLLM_VERSION}; vLLM {version} is installed")
    visible = _visible_gpus()
    if visible < num_gpus:
        raise LaunchError(f"pcp*tp = {num_gpus} GPUs needed, torch sees {visible} "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})")


def gpus_missing(num_gpus: int = 2) -> str | None:
    """Why ``run`` cannot launch here (vLLM 0.33.0 missing, too few GPUs), or None if it can:
    for notebooks that launch real vLLM when they can and open a shipped trace otherwise."""
    try:
        preflight(num_gpus)
    except LaunchError as exc:
        return str(exc)
    return None


def run(
    model: str | os.PathLike,
    prompts: Sequence[str | Sequence[int]],
    *,
    pcp: int = 2,
    tp: int = 1,
    num_speculative_tokens: int = 2,
    trace_dir: str | os.PathLike,
    max_tokens: int = 32,
    cudagraph_mode: str = "PIECEWISE",
    extra_engine_args: Mapping[str, Any] | None = None,
    progress: bool | Callable[[str], None] = True,
    timeout_s: float | None = None,
    fixes: str | None = None,
):
    """Generate with real vLLM 0.33.0 (PCP=``pcp``, TP=``tp``, MTP with
    ``num_speculative_tokens``) in a child process, recording a pcpviz trace into
    ``trace_dir``; returns ``(pcpviz.trace.open(trace_dir), output token ids per prompt)``.

    ``progress``: True prints the child's output as it comes, a callable receives each line,
    False keeps quiet. Raises ValueError for a bad configuration and LaunchError (one line)
    when vLLM or the GPUs are missing or the child fails.
    """
    with tempfile.TemporaryDirectory(prefix="pcpviz-launch-") as tmp:
        job_path = Path(tmp) / "job.json"
        launch = build_vllm_launch(model, prompts, pcp=pcp, tp=tp, num_speculative_tokens=num_speculative_tokens,
                                   trace_dir=trace_dir, max_tokens=max_tokens, cudagraph_mode=cudagraph_mode,
                                   extra_engine_args=extra_engine_args, job_path=job_path, fixes=fixes)
        preflight(launch.num_gpus)
        out_path = Path(tmp) / "outputs.json"
        job_path.write_text(json.dumps({**launch.job, "outputs": str(out_path)}))
        launch.trace_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **launch.env}
        emit = progress if callable(progress) else (print if progress else None)
        tail: list[str] = []
        proc = subprocess.Popen(launch.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail = (tail + [line])[-20:]
                if emit is not None:
                    emit(line)
            rc = proc.wait(timeout=timeout_s)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if rc != 0 or not out_path.exists():
            last = next((t for t in reversed(tail) if t.strip()), "")
            raise LaunchError(f"vLLM exited with code {rc}: {last.strip()[:300]}")
        result = json.loads(out_path.read_text())
        outputs = result["output_token_ids"]
    from pcpviz.trace import open as open_trace
    from pcpviz.trace import write_run_meta

    meta_path = launch.trace_dir / "run.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        meta.update({"launch": {"llm_kwargs": launch.llm_kwargs, "sampling": launch.sampling_kwargs,
                                "env": launch.env, "seconds": result.get("seconds", {})},
                     "prompts": launch.prompts, "output_token_ids": outputs,
                     "vllm_spec_decode_metrics": result.get("spec_decode_metrics", {})})
        write_run_meta(launch.trace_dir, meta)
    if not meta_path.exists() and any(launch.trace_dir.glob("flight-*")):
        return None, outputs  # flight recorder (PCPVIZ_FLIGHT_RECORDER): the dumps are the traces
    return open_trace(launch.trace_dir), outputs


def spec_decode_metrics(llm: Any) -> dict[str, Any]:
    """vLLM's own speculative-decoding counters (``vllm:spec_decode_*``, the figures its
    ``/metrics`` endpoint and log line show), summed over engines; ``{}`` when stats are off
    (``disable_log_stats=True``, the ``LLM`` default) or the metrics cannot be read.

    ``acceptance_rate_per_pos[i] = num_accepted_tokens_per_pos[i] / num_drafts``: the share of
    verify steps whose draft at position ``i`` was accepted (vLLM's definition)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - metrics are a bonus, never a failure
        return {}
    out: dict[str, Any] = {}
    for m in metrics:
        if not m.name.startswith("vllm:spec_decode"):
            continue
        key = m.name.removeprefix("vllm:spec_decode_")
        if hasattr(m, "values"):
            prev = out.get(key, [0] * len(m.values))
            out[key] = [int(a) + int(b) for a, b in zip(prev, m.values)]
        elif hasattr(m, "value"):
            out[key] = out.get(key, 0) + int(m.value)
    drafts = out.get("num_drafts", 0)
    if drafts and "num_accepted_tokens_per_pos" in out:
        out["acceptance_rate_per_pos"] = [round(a / drafts, 4) for a in out["num_accepted_tokens_per_pos"]]
    return out


def _child(job_path: str) -> int:
    """The child process: ``vllm.LLM(**llm_kwargs).generate(prompts)``; writes the token ids."""
    job = json.loads(Path(job_path).read_text())
    from vllm import LLM, SamplingParams

    print(f"pcpviz: vllm.LLM({', '.join(f'{k}={v!r}' for k, v in job['llm_kwargs'].items())})", flush=True)
    t0 = time.perf_counter()
    llm = LLM(**job["llm_kwargs"])
    t1 = time.perf_counter()
    outs = llm.generate(job["prompts"], SamplingParams(**job["sampling"]))
    t2 = time.perf_counter()
    token_ids = [list(map(int, o.outputs[0].token_ids)) for o in outs]
    Path(job["outputs"]).write_text(json.dumps({
        "output_token_ids": token_ids, "spec_decode_metrics": spec_decode_metrics(llm),
        "seconds": {"startup": round(t1 - t0, 2), "generate": round(t2 - t1, 2)}}))
    print(f"pcpviz: generated {[len(t) for t in token_ids]} tokens", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m pcpviz.vllm.launch JOB.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(_child(sys.argv[1]))
