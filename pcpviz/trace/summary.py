"""What a trace's ``run.json`` says about the run, for a reader: ``run_summary(meta)``.

A trace records the model as the path it was loaded from on the machine that ran it
(``/work/main/data/models/pcpviz-tiny-dsv3``) and the device as ``device`` (the pcpviz engine:
``cpu`` / ``cuda``) or ``gpus`` (the vLLM plugin: ``['NVIDIA H200', 'NVIDIA H200']``). For the
shipped 2 x H200 PCP=2 trace ``run_summary(trace.run_meta)`` gives ``{'producer': 'vllm-plugin',
'pcp': 2, 'num_speculative_tokens': 2, 'block_size': 16, 'model': 'pcpviz-tiny-dsv3',
'device': '2 x NVIDIA H200'}``: the model's directory name and what is known of the device
(``RunMeta.device_text``).
"""

from __future__ import annotations

import os
from typing import Any

from .meta_model import RunMeta

__all__ = ["SUMMARY_KEYS", "run_summary"]

SUMMARY_KEYS = ("producer", "pcp", "num_speculative_tokens", "block_size", "model", "device")


def run_summary(meta: RunMeta, keys: tuple[str, ...] = SUMMARY_KEYS) -> dict[str, Any]:
    """``keys`` of ``meta`` (``Trace.run_meta``) as a reader wants them: ``model`` as its directory
    name, ``device`` from ``device`` or ``gpus``; keys the trace does not record are left out."""
    out: dict[str, Any] = {}
    for k in keys:
        v = meta.device_text if k == "device" else meta.recorded_value(k)
        if k == "model" and v:
            v = os.path.basename(str(v).rstrip("/")) or str(v)
        if v is not None:
            out[k] = v
    return out
