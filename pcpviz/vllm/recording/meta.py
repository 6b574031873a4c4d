"""What the recorders learn about the run for ``run.json`` (besides what the PCP manager tells
them: ``pcp``, ``dcp``, ``shard_decode_requests``, block sizes).

For a PCP=2 MTP run of DeepSeek-V3 on two H200s, PCP rank 0 writes (among others)::

    {"gpus": ["NVIDIA H200", "NVIDIA H200"], "torch_version": "...", "python_version": "3.11.9",
     "num_speculative_tokens": 2, "speculative_method": "mtp", "speculator": "MTPSpeculator",
     "vllm_version": "0.33.0", "cudagraph_mode": "PIECEWISE", "tp": 1, ...}
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from typing import Any

import torch
import vllm

from pcpviz.vllm import fixes

__all__ = ["environment_meta", "speculator_meta"]


def environment_meta() -> dict[str, Any]:
    """Where the trace was recorded (run.json keys): ``gpus`` (names of the visible CUDA devices,
    ``[]`` on CPU), ``torch_version``, ``cuda_version``, ``python_version``, ``hostname`` and
    ``command`` (this process's command line: vLLM's workers inherit the user's ``sys.argv``)."""
    gpus: list[str] = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"gpus": gpus, "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
            "python_version": platform.python_version(), "hostname": platform.node(),
            "command": shlex.join([os.path.basename(sys.executable)] + list(sys.argv))}


def speculator_meta(spec: Any) -> dict[str, Any]:
    """The speculator's settings (run.json keys): ``num_speculative_tokens``,
    ``speculative_method``, ``speculator`` (its class), ``vllm_version`` and, where its
    ``vllm_config`` has them, ``model``, ``model_moe`` (the model has routed experts: its
    ``hf_config``'s ``n_routed_experts`` or ``num_experts``), ``cudagraph_mode`` and ``tp``."""
    meta: dict[str, Any] = {"num_speculative_tokens": int(spec.num_speculative_steps),
                            "speculative_method": str(getattr(spec, "method", "")),
                            "speculator": type(spec).__name__, "vllm_version": vllm.__version__}
    cfg = getattr(spec, "vllm_config", None)
    model = getattr(getattr(cfg, "model_config", None), "model", None)
    if isinstance(model, str):
        meta["model"] = model
    mode = getattr(getattr(cfg, "compilation_config", None), "cudagraph_mode", None)
    if mode is not None:
        meta["cudagraph_mode"] = getattr(mode, "name", str(mode))
    hf = getattr(getattr(cfg, "model_config", None), "hf_config", None)
    if hf is not None:
        experts = getattr(hf, "n_routed_experts", None) or getattr(hf, "num_experts", None)
        meta["model_moe"] = bool(experts)  # routed experts: MoE layers gather and reduce-scatter over PCP
    tp = getattr(getattr(cfg, "parallel_config", None), "tensor_parallel_size", None)
    if isinstance(tp, int):
        meta["tp"] = tp
    meta["vllm_fixes"] = list(fixes.active())  # pcpviz's opt-in patches this process runs with
    return meta
