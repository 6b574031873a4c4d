"""The rank config of a ``pcpviz.run``: every option validated, the prompts tokenized.

    cfg = build_config(["def fib(n):"], pcp=2, num_speculative_tokens=2)   # ValueError, one line
    cfg["prompt_token_ids"], cfg["num_blocks"]

``build_config`` returns a JSON-able dict; ``pcpviz.engine.launch`` writes it for the ranks
(``pcpviz.engine.rank_main``), ``pcpviz run --write-config`` for torchrun.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

from pcpviz.engine.prompt_budget import check_prompt_budget

__all__ = ["build_config", "DTYPES", "MAX_CPU_RANKS", "MAX_BLOCK_SIZE", "MAX_BATCHED_TOKENS", "MAX_TIMEOUT_S"]


MAX_CPU_RANKS = 32
"""Most ranks (processes) a CPU run starts."""
MAX_BLOCK_SIZE = 4096
MAX_BATCHED_TOKENS = 1 << 20
MAX_TIMEOUT_S = 7 * 24 * 3600.0


DTYPES = ("float32", "bfloat16")
"""Model and KV-cache dtypes: float32 (the default: exact, CPU-friendly) or bfloat16 (the
checkpoint's ``torch_dtype``, what vLLM runs it in)."""


def build_config(prompts: Sequence[str | Sequence[int]], *, pcp: int = 1, num_speculative_tokens: int = 2,
                 device: str = "cpu", max_new_tokens: int = 32, trace_dir: str | None = None,
                 inject: Sequence[str] = (), model_dir: str | None = None, block_size: int = 16,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 16, num_blocks: int | None = None,
                 shard_decode_requests: bool | None = None, seed: int = 0, timeout_s: float = 300.0,
                 stop_at_eos: bool = False, overwrite: bool = False, dtype: str = "float32",
                 count_local_devices: bool = True, cuda_graphs: bool | None = None,
                 time_phases: bool = False, profile_dir: str | None = None, dcp: int = 1,
                 dcp_interleave: int = 1) -> dict:
    """Validate the arguments and build the rank config (a JSON-able dict).

    ``cuda_graphs``: decode steps from CUDA graphs (None: on for CUDA at PCP=1, see
    ``EngineConfig.cuda_graphs`` for why not yet at PCP > 1; True on the CPU runs
    the same padded path without capture, see ``pcpviz.engine.graphs``). ``time_phases``: the
    per-phase breakdown of the loop (``RunResult.phases``, ``pcpviz.engine.phases``).
    ``profile_dir``: a torch.profiler profile of every step after the first (which carries the
    one-time JIT and allocator costs) per rank, the phases as labelled ranges:
    ``profile_rank<r>.txt`` (operators by device time) and ``profile_rank<r>.json`` (a Chrome
    trace for Perfetto / chrome://tracing); implies ``time_phases``.

    ``overwrite``: replace the trace already in ``trace_dir`` (its run.json and rank files
    only); without it a non-empty ``trace_dir`` is refused. ``count_local_devices=False`` skips
    "this host has ``pcp`` GPUs" for a config that torchrun starts on other hosts
    (``pcpviz run --write-config``). Raises ValueError with a one-line
    reason naming the option.

    ``dcp``: decode context parallel over the PCP ranks (1 or ``pcp``: the DCP group *is* the PCP
    group, as vLLM 0.33.0 allows at TP=1, ``config/parallel.py`` 595-606), the KV cache sharded by
    ``pcpviz.reference.dcp`` in runs of ``dcp_interleave`` tokens. vLLM 0.33.0 refuses PCP + DCP for a
    dense-MLA model like the shipped one (``pcp_manager.py`` 195-200): this is the engine's own DCP,
    not a vLLM 0.33.0 configuration."""
    from pcpviz.engine.tokenizer import EOS_ID
    from pcpviz.faults import validate_faults
    from pcpviz.trace.owner import check_target

    _check_sizes(pcp=pcp, num_speculative_tokens=num_speculative_tokens, max_new_tokens=max_new_tokens,
                 block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    _check_choices(device=device, pcp=pcp, cuda_graphs=cuda_graphs, dtype=dtype, timeout_s=timeout_s)
    _check_dcp(pcp=pcp, dcp=dcp, dcp_interleave=dcp_interleave, block_size=block_size, cuda_graphs=cuda_graphs,
               shard_decode_requests=shard_decode_requests)
    if trace_dir is not None:
        check_target(trace_dir, overwrite=overwrite)
    if profile_dir is not None:
        profile_dir = _profile_target(profile_dir)
    if device == "cuda" and count_local_devices:
        _check_local_gpus(pcp)
    faults = sorted(validate_faults(inject))
    model_dir, ids = _prompt_ids(prompts, model_dir, max_new_tokens=max_new_tokens,
                                 num_speculative_tokens=num_speculative_tokens)
    if max_num_batched_tokens < 1 + num_speculative_tokens:
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} cannot fit one decode of 1+K="
                         f"{1 + num_speculative_tokens} tokens")
    if num_blocks is None:
        per_req = -(-(max(len(t) for t in ids) + max_new_tokens + 2 * num_speculative_tokens + 1) // block_size)
        num_blocks = 1 + per_req * min(max_num_seqs, len(ids))
    return {
        "pcp": pcp, "num_speculative_tokens": num_speculative_tokens, "device": device,
        "max_new_tokens": max_new_tokens, "trace_dir": os.path.abspath(trace_dir) if trace_dir else None,
        "inject": faults, "model_dir": model_dir, "block_size": block_size,
        "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs, "num_blocks": num_blocks,
        "shard_decode_requests": shard_decode_requests, "seed": seed, "timeout_s": float(timeout_s),
        "prompt_token_ids": ids, "eos_token_id": EOS_ID if stop_at_eos else None, "dtype": dtype,
        "overwrite": bool(overwrite),
        "cuda_graphs": None if cuda_graphs is None else bool(cuda_graphs),
        "time_phases": bool(time_phases or profile_dir), "profile_dir": profile_dir,
        "dcp": int(dcp), "dcp_interleave": int(dcp_interleave),
    }


def _check_dcp(*, pcp: int, dcp: int, dcp_interleave: int, block_size: int, cuda_graphs,
               shard_decode_requests) -> None:
    """The engine's DCP spans the PCP group: dcp is 1 or pcp; the interleave divides the block size."""
    if isinstance(dcp, bool) or not isinstance(dcp, int) or dcp not in (1, pcp):
        raise ValueError(f"dcp={dcp}: the engine's DCP spans the PCP group, so dcp must be 1 or pcp={pcp}")
    if isinstance(dcp_interleave, bool) or not isinstance(dcp_interleave, int) or dcp_interleave < 1 \
            or block_size % dcp_interleave:
        raise ValueError(f"dcp_interleave={dcp_interleave} must be >= 1 and divide block_size={block_size}")
    if dcp > 1 and cuda_graphs:
        raise ValueError("cuda_graphs with dcp > 1: the engine's DCP attention runs eager only")
    if dcp > 1 and shard_decode_requests:
        raise ValueError("shard_decode_requests with dcp > 1: decodes are replicated under DCP (vLLM too)")


def _check_sizes(*, pcp: int, num_speculative_tokens: int, max_new_tokens: int, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int) -> None:
    """The integer options: each at least its minimum and at most what pcpviz runs."""
    _positive("pcp", pcp)
    _positive("num_speculative_tokens", num_speculative_tokens, 0)
    _positive("max_new_tokens", max_new_tokens)
    _positive("block_size", block_size)
    _positive("max_num_seqs", max_num_seqs)
    _positive("max_num_batched_tokens", max_num_batched_tokens)
    for name, value, hi in (("block_size", block_size, MAX_BLOCK_SIZE),
                            ("max_num_batched_tokens", max_num_batched_tokens, MAX_BATCHED_TOKENS),
                            ("max_num_seqs", max_num_seqs, 4096),
                            ("num_speculative_tokens", num_speculative_tokens, 64)):
        if value > hi:
            raise ValueError(f"{name}={value} is larger than pcpviz runs ({hi} at most)")


def _check_choices(*, device: str, pcp: int, cuda_graphs, dtype: str, timeout_s) -> None:
    """The device, graph mode, dtype and timeout options."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if cuda_graphs not in (None, True, False):
        raise ValueError(f"cuda_graphs must be True, False or None, got {cuda_graphs!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device == "cpu" and pcp > MAX_CPU_RANKS:
        raise ValueError(f"pcp={pcp} on CPU would start {pcp} processes; use at most {MAX_CPU_RANKS}")
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
            or not math.isfinite(timeout_s) or not 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT_S}], got {timeout_s!r}")


def _check_local_gpus(pcp: int) -> None:
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < pcp:
        raise ValueError(f"device='cuda' with pcp={pcp} needs {pcp} GPUs, found {have}")


def _prompt_ids(prompts: Sequence[str | Sequence[int]], model_dir: str | None, *, max_new_tokens: int,
                num_speculative_tokens: int) -> tuple[str, list[list[int]]]:
    """(the model directory made absolute, every prompt's token ids), each prompt checked against
    the prompt budget, the model's vocabulary and its context."""
    from pcpviz.engine.checkpoint import check_model_dir
    from pcpviz.engine.model_config import default_model_dir
    from pcpviz.engine.tokenizer import encode

    check_prompt_budget(prompts)
    model_dir = os.path.abspath(model_dir or default_model_dir())
    mcfg = check_model_dir(model_dir)
    if num_speculative_tokens > 0 and mcfg.num_mtp_layers < 1:
        raise ValueError(f"model {model_dir} has no MTP layer; use num_speculative_tokens=0")
    ids = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) and not p:
            raise ValueError(f"prompt {i} is empty (prompts count from 0)")
        toks = encode(p) if isinstance(p, str) else [int(t) for t in p]
        if not toks:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in toks if not 0 <= t < mcfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} outside the vocabulary (0..{mcfg.vocab_size - 1})")
        if len(toks) + max_new_tokens + num_speculative_tokens > mcfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i}: {len(toks)} tokens + max_new_tokens {max_new_tokens} exceed the model's "
                f"context of {mcfg.max_position_embeddings} tokens"
            )
        ids.append(toks)
    return model_dir, ids


def _positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _profile_target(path) -> str:
    """``profile_dir`` made absolute and created; ValueError (one line) when it cannot hold the
    profiles (a file, not creatable, not writable)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"profile_dir must be a directory path, got {path!r}")
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"profile_dir {path}: not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"profile_dir {path}: cannot create it ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"profile_dir {path}: not writable")
    return path
