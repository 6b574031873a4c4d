"""The config of a ``pcpviz.run``, one type from the command line to the ranks: every option
validated, the prompts tokenized.

    cfg = build_config(["def fib(n):"], pcp=2, num_speculative_tokens=2)   # ValueError, one line
    cfg.prompt_token_ids, cfg.num_blocks                                     # a frozen RunConfig

``pcpviz run`` and ``pcpviz.run(...)`` build it with ``build_config``; ``pcpviz.engine.launch``
writes it for the ranks (``RunConfig.to_json``), ``pcpviz run --write-config`` for torchrun, and
each rank process decodes the same type back (``RunConfig.from_json``: one line naming the file
and the key when it is damaged); run.json is derived from it (``pcpviz.engine.trace_dir.trace_meta``)
and the rank's ``EngineConfig`` too (``rank_main``). A PCP=2 run's file::

    {"pcp": 2, "num_speculative_tokens": 2, "device": "cpu", "block_size": 16, ...,
     "prompt_token_ids": [[1, 100, 101, 102]], "work_dir": "/tmp/pcpviz-...", "trace_owner": "3f2a..."}
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence, get_type_hints

from pcpviz.engine.prompt_budget import check_prompt_budget
from pcpviz.limits import (MAX_BATCHED_TOKENS, MAX_CPU_RANKS, MAX_ENGINE_BLOCK_SIZE, MAX_NUM_SEQS,
                           MAX_SPECULATIVE_TOKENS, MAX_TIMEOUT_S)

__all__ = ["RunConfig", "build_config", "DTYPES"]


DTYPES = ("float32", "bfloat16")
"""Model and KV-cache dtypes: float32 (the default: exact, CPU-friendly) or bfloat16 (the
checkpoint's ``torch_dtype``, what vLLM runs it in)."""


@dataclass(frozen=True)
class RunConfig:
    """One run of the engine, as every process sees it (``build_config`` validates it)."""

    pcp: int
    num_speculative_tokens: int  # K
    device: str  # "cpu" or "cuda"
    max_new_tokens: int
    trace_dir: str | None  # absolute
    inject: tuple[str, ...]  # fault names, sorted
    model_dir: str
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    num_blocks: int
    shard_decode_requests: bool | None
    seed: int
    timeout_s: float
    prompt_token_ids: tuple[tuple[int, ...], ...]  # int[R][len]
    eos_token_id: int | None
    dtype: str
    overwrite: bool
    cuda_graphs: bool | None
    time_phases: bool
    profile_dir: str | None
    work_dir: str | None = None  # where the ranks write result.json / errors (set by the launcher)
    store_file: str | None = None  # the FileStore rendezvous of a local launch (None: env:// TCP)
    trace_owner: str | None = None  # the trace directory's claim token (pcpviz.trace.owner)
    warmup: bool = True  # one throw-away forward before the first step
    dcp: int = 1  # decode context parallel: 1, or pcp (the engine's own DCP; not a vLLM 0.33.0 configuration)
    dcp_interleave: int = 1  # cp_kv_cache_interleave_size: DCP shards the KV in runs of this many tokens

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (lists for the tuples)."""
        d = dataclasses.asdict(self)
        d["inject"] = list(self.inject)
        d["prompt_token_ids"] = [list(p) for p in self.prompt_token_ids]
        return d

    def to_json(self, path: str) -> None:
        """Write the JSON document to ``path`` (OSError as ``open`` raises it)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def from_dict(cls, doc: Any, where: str = "config") -> "RunConfig":
        """The config of a JSON document; ValueError, one line naming ``where`` and the key."""
        if not isinstance(doc, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(doc).__name__}")
        hints = get_type_hints(cls)
        unknown = sorted(set(doc) - set(hints))
        if unknown:
            raise ValueError(f"{where}: {unknown[0]}: not a key of a run config")
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name not in doc:
                if f.default is dataclasses.MISSING:
                    raise ValueError(f"{where}: {f.name}: missing")
                continue
            kw[f.name] = _typed(doc[f.name], hints[f.name], f"{where}: {f.name}")
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str) -> "RunConfig":
        """Read ``path`` (a rank config); ValueError, one line naming the file and the key."""
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError, RecursionError) as exc:
            raise ValueError(f"{path}: {' '.join(str(exc).split()) or type(exc).__name__}") from None
        return cls.from_dict(doc, path)


def _typed(value: Any, hint: Any, where: str) -> Any:
    """``value`` as ``hint`` (int, float, str, bool, X | None, tuple[X, ...]), or ValueError."""
    args = getattr(hint, "__args__", ())
    if type(None) in args:
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        args = getattr(hint, "__args__", ())
    if getattr(hint, "__origin__", None) is tuple:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_typed(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    ok = (isinstance(value, bool) if hint is bool else
          isinstance(value, (int, float)) and not isinstance(value, bool) if hint is float else
          isinstance(value, hint) and not (hint is int and isinstance(value, bool)))
    if not ok:
        raise ValueError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    return float(value) if hint is float else value


def build_config(prompts: Sequence[str | Sequence[int]], *, pcp: int = 1, num_speculative_tokens: int = 2,
                 device: str = "cpu", max_new_tokens: int = 32, trace_dir: str | None = None,
                 inject: Sequence[str] = (), model_dir: str | None = None, block_size: int = 16,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 16, num_blocks: int | None = None,
                 shard_decode_requests: bool | None = None, seed: int = 0, timeout_s: float = 300.0,
                 stop_at_eos: bool = False, overwrite: bool = False, dtype: str = "float32",
                 count_local_devices: bool = True, cuda_graphs: bool | None = None,
                 time_phases: bool = False, profile_dir: str | None = None, dcp: int = 1,
                 dcp_interleave: int = 1) -> RunConfig:
    """Validate the arguments and build the run's config.

    ``cuda_graphs``: decode steps from CUDA graphs (None: on for CUDA at PCP=1, see
    ``EngineConfig.cuda_graphs`` for why not yet at PCP > 1; True on the CPU runs
    the same padded path without capture, see ``pcpviz.engine.decode_graphs``). ``time_phases``: the
    per-phase breakdown of the loop (``RunResult.phases``, ``pcpviz.engine.phase_timer``).
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
    _check_moe_dsa_model(model_dir, pcp=pcp, dcp=dcp, cuda_graphs=cuda_graphs)
    if max_num_batched_tokens < 1 + num_speculative_tokens:
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} cannot fit one decode of 1+K="
                         f"{1 + num_speculative_tokens} tokens")
    if num_blocks is None:
        per_req = -(-(max(len(t) for t in ids) + max_new_tokens + 2 * num_speculative_tokens + 1) // block_size)
        num_blocks = 1 + per_req * min(max_num_seqs, len(ids))
    return RunConfig(
        pcp=pcp, num_speculative_tokens=num_speculative_tokens, device=device,
        max_new_tokens=max_new_tokens, trace_dir=os.path.abspath(trace_dir) if trace_dir else None,
        inject=tuple(faults), model_dir=model_dir, block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, num_blocks=num_blocks,
        shard_decode_requests=shard_decode_requests, seed=seed, timeout_s=float(timeout_s),
        prompt_token_ids=tuple(tuple(int(t) for t in p) for p in ids), eos_token_id=EOS_ID if stop_at_eos else None,
        dtype=dtype, overwrite=bool(overwrite),
        cuda_graphs=None if cuda_graphs is None else bool(cuda_graphs),
        time_phases=bool(time_phases or profile_dir), profile_dir=profile_dir,
        dcp=int(dcp), dcp_interleave=int(dcp_interleave),
    )


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
    for name, value, hi in (("block_size", block_size, MAX_ENGINE_BLOCK_SIZE),
                            ("max_num_batched_tokens", max_num_batched_tokens, MAX_BATCHED_TOKENS),
                            ("max_num_seqs", max_num_seqs, MAX_NUM_SEQS),
                            ("num_speculative_tokens", num_speculative_tokens, MAX_SPECULATIVE_TOKENS)):
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
    from pcpviz.engine.model_files import check_model_dir
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


def _check_moe_dsa_model(model_dir: str, *, pcp: int, dcp: int, cuda_graphs) -> None:
    """What the engine runs the MoE + DSA model (``pcpviz-tiny-moe-dsa``) with: its sparse attention
    is eager and DCP-free (``pcpviz.engine.sparse_attention``), its experts' intermediate width
    splits over the PCP ranks (``pcpviz.engine.moe``)."""
    from pcpviz.engine.model_config import read_config

    m = read_config(model_dir)
    if m.is_sparse and dcp > 1:
        raise ValueError("dcp > 1 with a DSA (index_topk) model: the engine's DCP attention is dense MLA only")
    if m.is_sparse and cuda_graphs:
        raise ValueError("cuda_graphs with a DSA (index_topk) model: its sparse attention runs eager only")
    if m.is_moe and m.moe_intermediate_size % pcp:
        raise ValueError(f"moe_intermediate_size {m.moe_intermediate_size} does not split over pcp={pcp} ranks")


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
