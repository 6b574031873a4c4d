"""``pcpviz.run``: launch a PCP + MTP run of the tiny model on N ranks.

    import pcpviz
    res = pcpviz.run(["def fib(n):"], pcp=2, num_speculative_tokens=2, device="cpu",
                     max_new_tokens=32, trace_dir="runs/demo")
    res.output_token_ids, res.acceptance_rate_per_pos, res.trace_path

Each rank is its own process (``python -m pcpviz.engine.rank_main``), joined through env://
(gloo on CPU, NCCL on CUDA), its config built by ``pcpviz.engine.run_config``. The launcher
shows progress, and if any rank fails it stops the others and raises ``RankError`` naming the
rank and its error (``pcpviz.engine.rank_procs`` finds the cause); a rank stuck on a dead peer
gives up after ``timeout_s`` (the process group's collective timeout). SIGINT or SIGTERM (Ctrl-C, ``kill``) stop the run
cleanly: the ranks finish the step in flight and close their trace files marked
``partial`` (``pcpviz.trace.completion``), then ``RunInterrupted`` is raised; a
second signal, or ranks still running after ``STOP_GRACE_S``, kill them.
"""

from __future__ import annotations

import dataclasses
import json
import math
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

from pcpviz.trace.acceptance import json_ratio
from pcpviz.engine.rank_procs import (WORK_PREFIX, RankError, RankProcess, blame, clean_stale_work_dirs,
                                      die_with_parent, rank_env)
from pcpviz.engine.run_config import RunConfig, build_config
from pcpviz.engine.stops import RunInterrupted, StopGuard, redeliver
from pcpviz.engine.trace_dir import start_trace

__all__ = ["run", "RunResult", "RankError", "RunInterrupted"]


def _ratio(x: float | None) -> float:
    """A ratio from a rank's result JSON: null (nothing drafted) is NaN (pcpviz.trace.acceptance's policy)."""
    return math.nan if x is None else float(x)


@dataclass(frozen=True)
class RunResult:
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    texts: list[str]
    num_accepted_tokens_per_pos: list[int]
    acceptance_rate_per_pos: list[float]  # pcpviz.trace.acceptance: NaN where nothing was drafted
    acceptance_rate: float
    mean_acceptance_length: float
    num_drafts: int
    num_steps: int
    wall_s: float
    trace_path: str | None
    kv_cache_digests: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    phases: dict = field(default_factory=dict)  # rank 0's PhaseTimer.summary() (time_phases=True)
    graphs: dict | None = None  # {"mode", "captures", "replays"} when decode graphs were on
    # rank 0's wall time of every step, (kind, ms) with kind "prefill" (any prefill row) or
    # "decode": always measured (two clock reads a step); steady_decode_ms() reads it
    step_ms: list[tuple[str, float]] = field(default_factory=list)

    def steady_decode_ms(self, skip: int = 8) -> float | None:
        """Median wall time of a decode step after the first ``skip`` decode steps (which pay for
        Triton JIT, graph captures and allocator growth); None when no decode step is left."""
        import statistics

        ms = [t for kind, t in self.step_ms if kind == "decode"][skip:]
        return float(statistics.median(ms)) if ms else None

    def summary(self) -> dict:
        """The ``--json`` document: requests with their ids, acceptance overall and per position."""
        return {
            "requests": [
                {"prompt_token_ids": p, "output_token_ids": o, "text": t}
                for p, o, t in zip(self.prompt_token_ids, self.output_token_ids, self.texts)
            ],
            "acceptance_rate": json_ratio(self.acceptance_rate),
            "acceptance_rate_per_pos": [json_ratio(x) for x in self.acceptance_rate_per_pos],
            "num_accepted_tokens_per_pos": self.num_accepted_tokens_per_pos,
            "mean_acceptance_length": json_ratio(self.mean_acceptance_length),
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


def _progress_bar(cfg: RunConfig):
    from tqdm.auto import tqdm

    bar = tqdm(total=len(cfg.prompt_token_ids) * cfg.max_new_tokens,
               desc=f"PCP={cfg.pcp} K={cfg.num_speculative_tokens}", unit="tok")
    bar.set_postfix_str(f"prefill 0/{sum(len(p) for p in cfg.prompt_token_ids)}")
    return bar


_TIMEOUT_WORDS = ("timed out", "timeout", "time out")


def timeout_named(err: RankError, timeout_s: float) -> RankError:
    """``err`` with the setting that bounds the wait named when it is a timeout: a rank waiting on
    a stuck or dead peer gives up after the collective timeout, which ``pcpviz run --timeout``
    (``timeout_s=``) sets::

        rank 1 failed: ... timed out; the collective timeout is 300 s (pcpviz run --timeout SECONDS)
    """
    text = str(err)
    if not any(w in text.lower() for w in _TIMEOUT_WORDS) or "--timeout" in text:
        return err
    out = RankError(err.rank, text.split(": ", 1)[-1] + f"; the collective timeout is {timeout_s:g} s "
                    "(pcpviz run --timeout SECONDS, pcpviz.run(timeout_s=...))")
    return out


def _say_start(cfg: RunConfig, progress: bool) -> None:
    """One line while the ranks load the model (the progress bar starts at the first step)."""
    if progress:
        print(f"pcpviz run: starting {cfg.pcp} rank process{'es' * (cfg.pcp > 1)} (loading the model)...",
              file=sys.stderr, flush=True)


def _launch(cfg: RunConfig, progress: bool) -> dict:
    clean_stale_work_dirs()
    work = tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-")
    cfg = dataclasses.replace(cfg, work_dir=work, store_file=os.path.join(work, "store"))
    cfg_path = os.path.join(work, "config.json")
    cfg.to_json(cfg_path)
    port = _free_port()
    ranks: list[RankProcess] = []
    bars: list = []  # the progress bar, made at rank 0's first progress line: start-up is not token time
    _say_start(cfg, progress)
    guard = StopGuard()  # SIGINT/SIGTERM: the ranks stop between two steps (pcpviz.engine.stops)
    try:
        for rank in range(cfg.pcp):
            # -P and cwd=work: a pcpviz/ folder in the caller's directory cannot shadow the package
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "pcpviz.engine.rank_main", cfg_path], env=rank_env(cfg, rank, port),
                cwd=work, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True, preexec_fn=die_with_parent,
            )
            ranks.append(RankProcess(rank, proc))
            guard.add(proc)
        last = [0]

        def pump() -> None:  # rank 0's progress lines (rank_main.progress_line)
            for line in ranks[0].proc.stdout:
                if line.startswith("PCPVIZ_PROGRESS ") and progress:
                    if not bars:
                        bars.append(_progress_bar(cfg))
                    bar = bars[0]
                    doc = json.loads(line.split(" ", 1)[1])
                    # a long prompt takes many chunked-prefill steps before its first token
                    done, todo = doc["prefill"]
                    bar.set_postfix_str(f"prefill {done}/{todo}" if done < todo else "", refresh=False)
                    bar.update(max(doc["tokens"] - last[0], 0))
                    bar.refresh()
                    last[0] = doc["tokens"]

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        deadline = time.monotonic() + cfg.timeout_s * 4 + 600
        while True:
            codes = [r.proc.poll() for r in ranks]
            guard.wait(os.path.join(work, "result.json"))
            if any(c not in (None, 0) for c in codes):
                # Give the peers a moment to fail too, then blame the cause, not the first seen.
                grace = time.monotonic() + 2.0
                while time.monotonic() < grace and any(r.proc.poll() is None for r in ranks):
                    time.sleep(0.05)
                raise timeout_named(blame(ranks, work), cfg.timeout_s)
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                r = next(r for r, c in zip(ranks, codes) if c is None)
                raise timeout_named(RankError(r.rank, "timed out"), cfg.timeout_s)
            time.sleep(0.05)
        reader.join(timeout=5)
        with open(os.path.join(work, "result.json")) as f:
            result = json.load(f)
        guard.check(result, cfg.trace_dir)
        digests = []
        for rank in range(cfg.pcp):
            with open(os.path.join(work, f"rank{rank}.json")) as f:
                digests.append(json.load(f)["kv_cache_digest"])
        result["kv_cache_digests"] = digests
        return result
    finally:
        guard.close()
        for r in ranks:
            if r.proc.poll() is None:
                r.proc.kill()
        for r in ranks:
            try:
                r.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for bar in bars:
            bar.close()
        shutil.rmtree(work, ignore_errors=True)


def run(prompts: Sequence[str | Sequence[int]], *, pcp: int = 1, num_speculative_tokens: int = 2,
        device: str = "cpu", max_new_tokens: int = 32, trace_dir: str | None = None,
        inject: Sequence[str] = (), progress: bool = True, redeliver_stop: bool = True, **options) -> RunResult:
    """Run the tiny DeepSeek-V3 model on ``pcp`` ranks with MTP (K = ``num_speculative_tokens``).

    ``prompts`` are strings (byte-level tokenized, with BOS) or token-id lists.
    ``inject`` names faults from ``pcpviz.faults.faults_of(ENGINE)``. Other options:
    ``model_dir``, ``block_size`` (16), ``max_num_batched_tokens`` (2048, chunked
    prefill budget), ``max_num_seqs``, ``num_blocks``, ``shard_decode_requests``,
    ``seed``, ``timeout_s``, ``stop_at_eos``, ``overwrite`` (replace the trace in a non-empty
    ``trace_dir``; without it such a directory is refused, and one another run is writing is
    refused either way), ``cuda_graphs`` (decode steps from CUDA graphs; on for CUDA at
    PCP=1 by default), ``time_phases`` (``RunResult.phases``: where the loop's time goes),
    ``profile_dir`` (a torch.profiler profile per rank, see ``build_config``).

    SIGINT or SIGTERM stop the ranks between two steps and finalize the trace (marked partial);
    then the signal is re-delivered to this process, so the host's own handling of it happens
    (the default SIGTERM action ends it with 143; SIGINT raises ``KeyboardInterrupt``), and if
    the host's handler returns, ``RunInterrupted`` (a ``BaseException``) is raised.
    ``redeliver_stop=False`` (the CLI) only raises ``RunInterrupted``.
    """
    from pcpviz.engine.tokenizer import decode

    cfg = build_config(prompts, pcp=pcp, num_speculative_tokens=num_speculative_tokens, device=device,
                       max_new_tokens=max_new_tokens, trace_dir=trace_dir, inject=inject, **options)
    owner = start_trace(cfg) if cfg.trace_dir else None
    if owner is not None:
        cfg = dataclasses.replace(cfg, trace_owner=owner.token)
    try:
        res = _launch(cfg, progress)
    except RunInterrupted as stop:
        if owner is not None:
            owner.release()
            owner = None
        if redeliver_stop:
            redeliver(stop)  # the host's handling of the signal (pcpviz.engine.stops)
        raise
    finally:
        if owner is not None:
            owner.release()
    outs = [r["output_token_ids"] for r in res["requests"]]
    return RunResult(
        prompt_token_ids=[r["prompt_token_ids"] for r in res["requests"]],
        output_token_ids=outs,
        texts=[decode(o) for o in outs],
        num_accepted_tokens_per_pos=res["num_accepted_tokens_per_pos"],
        acceptance_rate_per_pos=[_ratio(x) for x in res["acceptance_rate_per_pos"]],
        acceptance_rate=_ratio(res["acceptance_rate"]),
        mean_acceptance_length=_ratio(res["mean_acceptance_length"]),
        num_drafts=res["num_drafts"],
        num_steps=res["num_steps"],
        wall_s=res["wall_s"],
        trace_path=cfg.trace_dir,
        kv_cache_digests=res["kv_cache_digests"],
        phases=res.get("phases") or {},
        graphs=res.get("graphs"),
        step_ms=[(str(k), float(t)) for k, t in res.get("step_ms", [])],
        config={k: v for k, v in cfg.to_dict().items() if k != "prompt_token_ids"},
    )
