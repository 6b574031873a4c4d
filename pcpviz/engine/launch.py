"""``pcpviz.run``: launch a PCP + MTP run of the tiny model on N ranks.

    import pcpviz
    res = pcpviz.run(["def fib(n):"], pcp=2, num_speculative_tokens=2, device="cpu",
                     max_new_tokens=32, trace_dir="runs/demo")
    res.output_token_ids, res.acceptance_rate_per_pos, res.trace_path

Each rank is its own process (``python -m pcpviz.engine.rank_main``), joined
through env:// (gloo on CPU, NCCL on CUDA). The launcher shows progress, and if
any rank fails it stops the others and raises ``RankError`` naming the rank and
its error; a rank stuck on a dead peer gives up after ``timeout_s`` (the process
group's collective timeout). SIGINT or SIGTERM (Ctrl-C, ``kill``) stop the run
cleanly: the ranks finish the step in flight and close their trace files marked
``partial`` (``pcpviz.trace.completion``), then ``RunInterrupted`` is raised; a
second signal, or ranks still running after ``STOP_GRACE_S``, kill them.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from pcpviz.engine.prompt_budget import check_prompt_budget
from pcpviz.analysis.acceptance import json_ratio
from pcpviz.engine.stops import RunInterrupted, StopGuard
from pcpviz.engine.trace_dir import start_trace, trace_meta

__all__ = ["run", "RunResult", "RankError", "RunInterrupted", "build_config", "start_trace", "trace_meta"]


MAX_CPU_RANKS = 32
"""Most ranks (processes) a CPU run starts."""
MAX_BLOCK_SIZE = 4096
MAX_BATCHED_TOKENS = 1 << 20
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _ratio(x: float | None) -> float:
    """A ratio from a rank's result JSON: null (nothing drafted) is NaN (pcpviz.analysis.acceptance's policy)."""
    return math.nan if x is None else float(x)


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
    acceptance_rate_per_pos: list[float]  # pcpviz.analysis.acceptance: NaN where nothing was drafted
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


def _positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


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
                 time_phases: bool = False, profile_dir: str | None = None) -> dict:
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
    reason naming the option."""
    from pcpviz.faults import validate_faults
    from pcpviz.engine.checkpoint import check_model_dir
    from pcpviz.engine.model_config import default_model_dir
    from pcpviz.engine.tokenizer import EOS_ID, encode
    from pcpviz.trace.owner import check_target

    _positive("pcp", pcp)
    _positive("num_speculative_tokens", num_speculative_tokens, 0)
    _positive("max_new_tokens", max_new_tokens)
    _positive("block_size", block_size)
    _positive("max_num_seqs", max_num_seqs)
    _positive("max_num_batched_tokens", max_num_batched_tokens)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if cuda_graphs not in (None, True, False):
        raise ValueError(f"cuda_graphs must be True, False or None, got {cuda_graphs!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device == "cpu" and pcp > MAX_CPU_RANKS:
        raise ValueError(f"pcp={pcp} on CPU would start {pcp} processes; use at most {MAX_CPU_RANKS}")
    for name, value, hi in (("block_size", block_size, MAX_BLOCK_SIZE),
                            ("max_num_batched_tokens", max_num_batched_tokens, MAX_BATCHED_TOKENS),
                            ("max_num_seqs", max_num_seqs, 4096),
                            ("num_speculative_tokens", num_speculative_tokens, 64)):
        if value > hi:
            raise ValueError(f"{name}={value} is larger than pcpviz runs ({hi} at most)")
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
            or not math.isfinite(timeout_s) or not 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT_S}], got {timeout_s!r}")
    if trace_dir is not None:
        check_target(trace_dir, overwrite=overwrite)
    if profile_dir is not None:
        profile_dir = _profile_target(profile_dir)
    if device == "cuda" and count_local_devices:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < pcp:
            raise ValueError(f"device='cuda' with pcp={pcp} needs {pcp} GPUs, found {have}")
    faults = sorted(validate_faults(inject))
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
        "prompt_token_ids": ids, "eos_token_id": EOS_ID if stop_at_eos else None, "dtype": dtype,
        "overwrite": bool(overwrite),
        "cuda_graphs": None if cuda_graphs is None else bool(cuda_graphs),
        "time_phases": bool(time_phases or profile_dir), "profile_dir": profile_dir,
    }


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


_WORK_PREFIX = "pcpviz-run-"
_PEER_ERRORS = re.compile(r"connection closed by peer|connection reset|broken pipe|timed out|timeout|"
                          r"socket|recvbytes|sendbytes|remote process exited|peer", re.IGNORECASE)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale_work_dirs() -> None:
    """Remove the work directories of earlier runs whose launcher is gone (killed by SIGKILL
    before its ``finally``): ``pcpviz-run-<pid>-*`` of this user with no live ``<pid>``."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        m = re.match(rf"^{_WORK_PREFIX}(\d+)-", name)
        path = os.path.join(root, name)
        if not m or _alive(int(m.group(1))):
            continue
        try:
            if os.lstat(path).st_uid == os.getuid() and os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Ranks get SIGKILL when the launcher dies, so none outlives a killed launcher."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: ranks still stop on their collective timeout
        pass


def _rank_env(cfg: dict, rank: int, port: int) -> dict:
    """The rank's environment: env:// variables, this pcpviz first on the path (absolute, so
    the rank imports the launcher's package whatever its working directory holds)."""
    import pcpviz

    root = os.path.dirname(os.path.dirname(os.path.abspath(pcpviz.__file__)))
    paths = [root] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(cfg["pcp"]), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(cfg["pcp"]), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)), PCPVIZ_PROGRESS="pipe")
    # one host: gloo's sockets (the CPU group; on CUDA the plan's control group) on loopback only
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _proc_state(pid: int) -> str | None:
    """The kernel's state letter of ``pid`` (``T`` stopped, ``Z`` zombie, ...), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class _Rank:
    """One rank process and the tail of its stderr (drained so a chatty rank never blocks)."""

    def __init__(self, rank: int, proc: subprocess.Popen) -> None:
        self.rank, self.proc = rank, proc
        self.tail: collections.deque[str] = collections.deque(maxlen=64)
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.tail.append(line.rstrip("\n"))

    def error(self, work: str) -> str:
        """The rank's own one-line account of its failure."""
        self.thread.join(timeout=2)
        for line in reversed(self.tail):
            if line.startswith("PCPVIZ_ERROR "):
                return line[len("PCPVIZ_ERROR "):]
        try:
            with open(os.path.join(work, f"error_rank{self.rank}.txt")) as f:
                first = f.readline().strip()
            if first:
                return first
        except OSError:
            pass
        code = self.proc.returncode
        how = f"killed by {_signal_name(code)}" if code is not None and code < 0 else f"exited with code {code}"
        last = next((line for line in reversed(self.tail) if line.strip()), "")
        return f"process {how}" + (f": {last.strip()}" if last else "")


def _blame(ranks: list[_Rank], work: str) -> RankError:
    """The rank that caused a failure, with its real cause.

    A rank whose peer died or hung fails too, later or at the same moment, with a connection or
    timeout error; so: a failed rank with an error of its own first (a full disk, a bad step),
    then a rank that died without a word (a signal, ``os._exit``), then a rank still running
    while the others failed waiting for it (stopped or hung), then the first failure."""
    failed = [r for r in ranks if r.proc.returncode not in (None, 0)]
    errors = {r.rank: r.error(work) for r in failed}
    own = [r for r in failed if not _PEER_ERRORS.search(errors[r.rank])
           and not errors[r.rank].startswith("process ")]
    if own:
        return RankError(own[0].rank, errors[own[0].rank])
    silent = [r for r in failed if errors[r.rank].startswith("process ")]
    if silent:
        return RankError(silent[0].rank, errors[silent[0].rank])
    running = [r for r in ranks if r.proc.returncode is None]
    if running:
        r = running[0]
        state = "is stopped (SIGSTOP?)" if _proc_state(r.proc.pid) == "T" else "stopped responding"
        peers = ", ".join(str(f.rank) for f in failed)
        return RankError(r.rank, f"{state}; rank {peers} gave up waiting for it "
                                 f"({errors[failed[0].rank]})")
    return RankError(failed[0].rank, errors[failed[0].rank])


def _progress_bar(cfg: dict):
    from tqdm.auto import tqdm

    bar = tqdm(total=len(cfg["prompt_token_ids"]) * cfg["max_new_tokens"],
               desc=f"PCP={cfg['pcp']} K={cfg['num_speculative_tokens']}", unit="tok")
    bar.set_postfix_str(f"prefill 0/{sum(len(p) for p in cfg['prompt_token_ids'])}")
    return bar


def _launch(cfg: dict, progress: bool) -> dict:
    _clean_stale_work_dirs()
    work = tempfile.mkdtemp(prefix=f"{_WORK_PREFIX}{os.getpid()}-")
    cfg = dict(cfg, work_dir=work, store_file=os.path.join(work, "store"))
    cfg_path = os.path.join(work, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    port = _free_port()
    ranks: list[_Rank] = []
    bar = _progress_bar(cfg) if progress else None
    guard = StopGuard()  # SIGINT/SIGTERM: the ranks stop between two steps (pcpviz.engine.stops)
    try:
        for rank in range(cfg["pcp"]):
            # -P and cwd=work: a pcpviz/ folder in the caller's directory cannot shadow the package
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "pcpviz.engine.rank_main", cfg_path], env=_rank_env(cfg, rank, port),
                cwd=work, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True, preexec_fn=_die_with_parent,
            )
            ranks.append(_Rank(rank, proc))
            guard.add(proc)
        last = [0]

        def pump() -> None:  # rank 0's progress lines (rank_main.progress_line)
            for line in ranks[0].proc.stdout:
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
            codes = [r.proc.poll() for r in ranks]
            guard.wait(os.path.join(work, "result.json"))
            if any(c not in (None, 0) for c in codes):
                # Give the peers a moment to fail too, then blame the cause, not the first seen.
                grace = time.monotonic() + 2.0
                while time.monotonic() < grace and any(r.proc.poll() is None for r in ranks):
                    time.sleep(0.05)
                raise _blame(ranks, work)
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                r = next(r for r, c in zip(ranks, codes) if c is None)
                raise RankError(r.rank, "timed out")
            time.sleep(0.05)
        reader.join(timeout=5)
        with open(os.path.join(work, "result.json")) as f:
            result = json.load(f)
        guard.check(result, cfg.get("trace_dir"))
        digests = []
        for rank in range(cfg["pcp"]):
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
        if bar is not None:
            bar.close()
        shutil.rmtree(work, ignore_errors=True)


def run(prompts: Sequence[str | Sequence[int]], *, pcp: int = 1, num_speculative_tokens: int = 2,
        device: str = "cpu", max_new_tokens: int = 32, trace_dir: str | None = None,
        inject: Sequence[str] = (), progress: bool = True, **options) -> RunResult:
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
    """
    from pcpviz.engine.tokenizer import decode

    cfg = build_config(prompts, pcp=pcp, num_speculative_tokens=num_speculative_tokens, device=device,
                       max_new_tokens=max_new_tokens, trace_dir=trace_dir, inject=inject, **options)
    owner = start_trace(cfg) if cfg["trace_dir"] else None
    try:
        res = _launch(cfg, progress)
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
        trace_path=cfg["trace_dir"],
        kv_cache_digests=res["kv_cache_digests"],
        phases=res.get("phases") or {},
        graphs=res.get("graphs"),
        step_ms=[(str(k), float(t)) for k, t in res.get("step_ms", [])],
        config={k: v for k, v in cfg.items() if k != "prompt_token_ids"},
    )
