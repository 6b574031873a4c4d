"""``pcpviz.run``: launch a PCP + MTP run of the tiny model on N ranks.

    import pcpviz
    res = pcpviz.run(["def fib(n):"], pcp=2, num_speculative_tokens=2, device="cpu",
                     max_new_tokens=32, trace_dir="runs/demo")
    res.output_token_ids, res.acceptance_rate_per_pos, res.trace_path

Each rank is its own process (``python -m pcpviz.engine.rank_main``), joined
through env:// (gloo on CPU, NCCL on CUDA). The launcher shows progress, and if
any rank fails it stops the others and raises ``RankError`` naming the rank and
its error; a rank stuck on a dead peer gives up after ``timeout_s`` (the process
group's collective timeout).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["run", "RunResult", "RankError", "build_config"]


class RankError(RuntimeError):
    """A rank failed; ``.rank`` names it."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank


@dataclass(frozen=True)
class RunResult:
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    texts: list[str]
    num_accepted_tokens_per_pos: list[int]
    acceptance_rate_per_pos: list[float]
    acceptance_rate: float
    mean_acceptance_length: float
    num_drafts: int
    num_steps: int
    wall_s: float
    trace_path: str | None
    kv_cache_digests: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """The ``--json`` document: requests with their ids, acceptance overall and per position."""
        return {
            "requests": [
                {"prompt_token_ids": p, "output_token_ids": o, "text": t}
                for p, o, t in zip(self.prompt_token_ids, self.output_token_ids, self.texts)
            ],
            "acceptance_rate": self.acceptance_rate,
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
            "num_accepted_tokens_per_pos": self.num_accepted_tokens_per_pos,
            "mean_acceptance_length": self.mean_acceptance_length,
            "num_drafts": self.num_drafts,
            "num_steps": self.num_steps,
            "wall_s": self.wall_s,
            "trace": self.trace_path,
            "pcp": self.config.get("pcp"),
            "num_speculative_tokens": self.config.get("num_speculative_tokens"),
            "inject": self.config.get("inject"),
        }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def build_config(prompts: Sequence[str | Sequence[int]], *, pcp: int = 1, num_speculative_tokens: int = 2,
                 device: str = "cpu", max_new_tokens: int = 32, trace_dir: str | None = None,
                 inject: Sequence[str] = (), model_dir: str | None = None, block_size: int = 16,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 16, num_blocks: int | None = None,
                 shard_decode_requests: bool | None = None, seed: int = 0, timeout_s: float = 300.0,
                 stop_at_eos: bool = False, count_local_devices: bool = True) -> dict:
    """Validate the arguments and build the rank config (a JSON-able dict).

    ``count_local_devices=False`` skips "this host has ``pcp`` GPUs" for a config that torchrun
    starts on other hosts (``pcpviz run --write-config``). Raises ValueError with a one-line
    reason naming the option."""
    from pcpviz.engine.faults import validate_faults
    from pcpviz.engine.model import default_model_dir, read_config
    from pcpviz.engine.tokenizer import EOS_ID, encode

    _positive("pcp", pcp)
    _positive("num_speculative_tokens", num_speculative_tokens, 0)
    _positive("max_new_tokens", max_new_tokens)
    _positive("block_size", block_size)
    _positive("max_num_seqs", max_num_seqs)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and count_local_devices:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < pcp:
            raise ValueError(f"device='cuda' with pcp={pcp} needs {pcp} GPUs, found {have}")
    faults = sorted(validate_faults(inject))
    if not prompts:
        raise ValueError("no prompts given")
    model_dir = os.path.abspath(model_dir or default_model_dir())
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"model directory {model_dir} has no config.json")
    mcfg = read_config(model_dir)
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
    budget = max_num_batched_tokens
    if budget < 1 + num_speculative_tokens:
        raise ValueError(f"max_num_batched_tokens={budget} cannot fit one decode of 1+K="
                         f"{1 + num_speculative_tokens} tokens")
    if num_blocks is None:
        per_req = -(-(max(len(t) for t in ids) + max_new_tokens + 2 * num_speculative_tokens + 1) // block_size)
        num_blocks = 1 + per_req * min(max_num_seqs, len(ids))
    return {
        "pcp": pcp, "num_speculative_tokens": num_speculative_tokens, "device": device,
        "max_new_tokens": max_new_tokens, "trace_dir": os.path.abspath(trace_dir) if trace_dir else None,
        "inject": faults, "model_dir": model_dir, "block_size": block_size,
        "max_num_batched_tokens": budget, "max_num_seqs": max_num_seqs, "num_blocks": num_blocks,
        "shard_decode_requests": shard_decode_requests, "seed": seed, "timeout_s": float(timeout_s),
        "prompt_token_ids": ids, "eos_token_id": EOS_ID if stop_at_eos else None,
    }


def _write_meta(cfg: dict) -> None:
    from pcpviz.trace import write_run_meta

    meta = {
        "producer": "pcpviz-engine",
        "pcp": cfg["pcp"], "dcp": 1, "num_speculative_tokens": cfg["num_speculative_tokens"],
        "block_size": cfg["block_size"], "shard_decode_requests": cfg["shard_decode_requests"]
        if cfg["shard_decode_requests"] is not None else cfg["pcp"] > 1,
        "model": os.path.basename(cfg["model_dir"]), "device": cfg["device"], "inject": cfg["inject"],
        "max_num_batched_tokens": cfg["max_num_batched_tokens"], "seed": cfg["seed"],
        "num_requests": len(cfg["prompt_token_ids"]), "max_new_tokens": cfg["max_new_tokens"],
        "prompt_token_ids": cfg["prompt_token_ids"],
    }
    os.makedirs(cfg["trace_dir"], exist_ok=True)
    for name in os.listdir(cfg["trace_dir"]):
        if name.startswith("rank") and name.endswith(".arrow"):
            os.remove(os.path.join(cfg["trace_dir"], name))  # a re-run replaces the old trace
    write_run_meta(cfg["trace_dir"], meta)


def _launch(cfg: dict, progress: bool) -> dict:
    work = tempfile.mkdtemp(prefix="pcpviz-run-")
    cfg = dict(cfg, work_dir=work)
    cfg_path = os.path.join(work, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    port = _free_port()
    procs = []
    total = len(cfg["prompt_token_ids"]) * cfg["max_new_tokens"]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=f"PCP={cfg['pcp']} K={cfg['num_speculative_tokens']}", unit="tok")
        prompt_tokens = sum(len(p) for p in cfg["prompt_token_ids"])
        bar.set_postfix_str(f"prefill 0/{prompt_tokens}")
    try:
        for rank in range(cfg["pcp"]):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(cfg["pcp"]), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(cfg["pcp"]), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       PCPVIZ_PROGRESS="pipe")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "pcpviz.engine.rank_main", cfg_path], env=env,
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True,
            ))
        last = [0]

        def pump() -> None:  # rank 0's progress lines (rank_main.progress_line)
            for line in procs[0].stdout:
                if line.startswith("PCPVIZ_PROGRESS ") and bar is not None:
                    doc = json.loads(line.split(" ", 1)[1])
                    # a long prompt takes many chunked-prefill steps before its first token
                    done, todo = doc["prefill"]
                    bar.set_postfix_str(f"prefill {done}/{todo}" if done < todo else "", refresh=False)
                    bar.update(max(doc["tokens"] - last[0], 0))
                    bar.refresh()
                    last[0] = doc["tokens"]

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        deadline = time.monotonic() + cfg["timeout_s"] * 4 + 600
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # The first rank seen failing is the culprit: its peers only fail later, when
                # their collectives time out waiting for it.
                r = failed[0]
                err = os.path.join(work, f"error_rank{r}.txt")
                if os.path.exists(err):
                    msg = open(err).read().splitlines()[0]
                else:
                    tail = (procs[r].stderr.read() or "").strip().splitlines()
                    msg = f"process exited with code {codes[r]}" + (f": {tail[-1]}" if tail else "")
                raise RankError(r, msg)
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise RankError(next(r for r, c in enumerate(codes) if c is None), "timed out")
            time.sleep(0.05)
        reader.join(timeout=5)
        with open(os.path.join(work, "result.json")) as f:
            result = json.load(f)
        digests = []
        for rank in range(cfg["pcp"]):
            with open(os.path.join(work, f"rank{rank}.json")) as f:
                digests.append(json.load(f)["kv_cache_digest"])
        result["kv_cache_digests"] = digests
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if bar is not None:
            bar.close()
        shutil.rmtree(work, ignore_errors=True)


def run(prompts: Sequence[str | Sequence[int]], *, pcp: int = 1, num_speculative_tokens: int = 2,
        device: str = "cpu", max_new_tokens: int = 32, trace_dir: str | None = None,
        inject: Sequence[str] = (), progress: bool = True, **options) -> RunResult:
    """Run the tiny DeepSeek-V3 model on ``pcp`` ranks with MTP (K = ``num_speculative_tokens``).

    ``prompts`` are strings (byte-level tokenized, with BOS) or token-id lists.
    ``inject`` names faults from ``pcpviz.engine.faults.FAULTS``. Other options:
    ``model_dir``, ``block_size`` (16), ``max_num_batched_tokens`` (2048, chunked
    prefill budget), ``max_num_seqs``, ``num_blocks``, ``shard_decode_requests``,
    ``seed``, ``timeout_s``, ``stop_at_eos``.
    """
    from pcpviz.engine.tokenizer import decode

    cfg = build_config(prompts, pcp=pcp, num_speculative_tokens=num_speculative_tokens, device=device,
                       max_new_tokens=max_new_tokens, trace_dir=trace_dir, inject=inject, **options)
    if cfg["trace_dir"]:
        _write_meta(cfg)
    res = _launch(cfg, progress)
    outs = [r["output_token_ids"] for r in res["requests"]]
    return RunResult(
        prompt_token_ids=[r["prompt_token_ids"] for r in res["requests"]],
        output_token_ids=outs,
        texts=[decode(o) for o in outs],
        num_accepted_tokens_per_pos=res["num_accepted_tokens_per_pos"],
        acceptance_rate_per_pos=res["acceptance_rate_per_pos"],
        acceptance_rate=res["acceptance_rate"],
        mean_acceptance_length=res["mean_acceptance_length"],
        num_drafts=res["num_drafts"],
        num_steps=res["num_steps"],
        wall_s=res["wall_s"],
        trace_path=cfg["trace_dir"],
        kv_cache_digests=res["kv_cache_digests"],
        config={k: v for k, v in cfg.items() if k != "prompt_token_ids"},
    )
