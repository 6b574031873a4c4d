"""The measured points the cost model is fitted to and checked against, read from the repo.

Sources (all 2 x H200, the shipped tiny model):

* ``data/bench/vllm_h200x2.json`` and ``vllm_h200x2_run1.json`` (``benchmarks/bench_vllm.py``,
  real vLLM 0.33.0): a 16,384-token prefill at PCP=1 and 2 (``generate`` with
  ``max_tokens=1``, K=2: one step, the draft included) and decode ms per token at batch 1,
  K=0 and K=2. Runs with the recording plugin on are left out (the model has no recording
  term); a run with ``enforce_eager`` off is system ``vllm-graphs``; a decode run may record
  its own ``acceptance_rate_per_pos`` (vLLM's per-position rates).
* ``data/bench/h200x2_engine_v1.json`` (``benchmarks/bench_engine.py``, this repo's engine before
  its performance work: eager decode, torch prefill attention; system ``engine``): the target
  forward of a 32,000-token prefill at PCP=1 and 2 (the second, warm step) and decode
  tokens/s at batch 1, K=0 and K=2.
* ``data/bench/h200x2.json`` (the same bench after the performance work: decode from CUDA
  graphs at PCP=1, the flash MLA prefill kernel; system ``engine-v2``): the same two prefill
  target forwards (20.6 and 31.0 ms: PCP=2 is slower) and, from its ``derived`` block, the
  steady-state decode ms per token at batch 1, PCP=1, K=0 (1.201) and K=2 (0.773, 2.228
  tokens a step). Its wall-time ``decode_tok_s`` include one-time Triton JIT compilation and
  are not used.
* ``data/bench/reported_h200x2.json``: figures quoted in the project's performance issue whose
  raw output is not in the repo (vLLM 30k-token prefill, CUDA-graph decode, the engine's
  re-run), with the assumptions each needs.

No vLLM file records acceptance, so its K=2 decode points use the engine's acceptance on
held-out source (``h200x2_engine_v1.json``, 0.873 / 0.349 per position, L = 2.22): the same model with
greedy sampling, and the parity table of docs/figures.md shows vLLM and the engine agreeing
(0.89 / 0.29 vs 0.90 / 0.30 on the same prompts).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from pcpviz.costmodel.specs import repo_root
from pcpviz.io_guards import read_json_file

__all__ = ["Case", "MeasuredPoint", "RatioPoint", "Unchecked", "Points", "load_points", "DEFAULT_SOURCES"]

KINDS = ("prefill", "prefill_forward", "decode_token")
DEFAULT_SOURCES = ("data/bench/vllm_h200x2.json", "data/bench/vllm_h200x2_run1.json",
                   "data/bench/h200x2_engine_v1.json", "data/bench/h200x2.json", "data/bench/reported_h200x2.json")
DECODE_CONTEXT = 384  # a 256-token prompt plus half of the 256 decoded tokens (mean position)


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration to predict. ``kind``: ``prefill`` (whole steps, the draft included),
    ``prefill_forward`` (the target forward alone), ``decode_token`` (seconds per emitted token
    of one request). ``tokens`` is the prompt length (prefill) or the context (decode)."""

    system: str
    kind: str
    tokens: int
    pcp: int = 1
    k: int = 0
    batch: int = 1
    chunk: int | None = None
    acceptance: tuple[float, ...] = ()   # conditional, per draft position

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r} (choose from {', '.join(KINDS)})")


@dataclasses.dataclass(frozen=True)
class MeasuredPoint:
    name: str
    source: str
    case: Case
    seconds: float
    note: str = ""


@dataclasses.dataclass(frozen=True)
class RatioPoint:
    """A measured time ratio ``num / den`` whose absolute times are not recorded."""

    name: str
    source: str
    num: Case
    den: Case
    value: float
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Unchecked:
    """A figure that exists but cannot be predicted, and why."""

    name: str
    source: str
    why: str


@dataclasses.dataclass(frozen=True)
class Points:
    measured: tuple[MeasuredPoint, ...]
    ratios: tuple[RatioPoint, ...]
    unchecked: tuple[Unchecked, ...]
    engine_acceptance: tuple[float, ...]   # conditional, K=2


def _num(x: Any, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
        raise ValueError(f"{where}: expected a positive number, got {x!r}")
    return float(x)


def _engine_acceptance(doc: dict, where: str) -> tuple[float, ...]:
    from pcpviz.costmodel.step import conditional_from_vllm

    try:
        per_pos = doc["acceptance_rate_per_pos"]["k2"]["per_pos"]
    except (KeyError, TypeError):
        raise ValueError(f"{where}: no acceptance_rate_per_pos.k2.per_pos") from None
    return conditional_from_vllm([float(x) for x in per_pos])


def _vllm(doc: dict, src: str, acceptance: tuple[float, ...]) -> list[MeasuredPoint]:
    from pcpviz.costmodel.step import conditional_from_vllm

    out = []
    runs = doc.get("runs")
    if not isinstance(runs, dict):
        raise ValueError(f"{src}: no 'runs' object")
    for name, run in runs.items():
        if not isinstance(run, dict) or "error" in run or "config" not in run:
            continue
        cfg = run["config"]
        if cfg.get("trace"):
            continue  # the recording plugin's overhead is not modelled
        kw = cfg.get("llm_kwargs", {})
        system = "vllm-eager" if kw.get("enforce_eager", False) else "vllm-graphs"
        pcp, k = int(cfg["pcp"]), int(cfg.get("k", 0))
        if "prefill_s" in run:
            tokens = int(run.get("prefill_tokens", doc["prefill_tokens"]))
            budget = kw.get("max_num_batched_tokens")
            chunk = int(budget) if budget and int(budget) < tokens else None
            case = Case(system, "prefill", tokens, pcp=pcp, k=k, chunk=chunk)
            out.append(MeasuredPoint(f"{name} prefill {tokens}", src, case,
                                     _num(run["prefill_s"], f"{src}: runs.{name}.prefill_s")))
        if "decode_ms_per_token" in run:
            own = run.get("acceptance_rate_per_pos")  # vLLM's per-position rates, if a run records them
            acc = conditional_from_vllm([float(x) for x in own]) if own else (acceptance if k else ())
            case = Case(system, "decode_token", DECODE_CONTEXT, pcp=pcp, k=k, acceptance=acc[:k])
            note = "acceptance: the engine's (same model)" if k and not own else ""
            out.append(MeasuredPoint(f"{name} decode", src, case,
                                     _num(run["decode_ms_per_token"], f"{src}: runs.{name}.decode_ms_per_token") / 1e3,
                                     note))
    return out


def _engine_prefill(doc: dict, src: str, system: str) -> list[MeasuredPoint]:
    """The target forward of the second (warm) long-prompt step at PCP=1 and 2."""
    out = []
    tokens = int(doc["long_prompt_tokens"])
    for pcp in (1, 2):
        steps = doc.get("prefill_step_s", {}).get(f"pcp{pcp}")
        if steps:
            out.append(MeasuredPoint(f"{system} prefill {tokens} pcp{pcp}", src,
                                     Case(system, "prefill_forward", tokens, pcp=pcp),
                                     _num(steps[-1], f"{src}: prefill_step_s.pcp{pcp}[-1]"),
                                     "target forward of the second (warm) long-prompt step"))
    return out


def _engine(doc: dict, src: str, acceptance: tuple[float, ...]) -> list[MeasuredPoint]:
    out = _engine_prefill(doc, src, "engine")
    for k in (0, 2):
        tps = doc.get("decode_tok_s", {}).get(f"k{k}")
        if tps:
            out.append(MeasuredPoint(f"engine decode k{k}", src,
                                     Case("engine", "decode_token", DECODE_CONTEXT, k=k, acceptance=acceptance[:k]),
                                     1.0 / _num(tps, f"{src}: decode_tok_s.k{k}"),
                                     "loop wall time over tokens (one short prefill included)"))
    return out


def _engine_v2(doc: dict, src: str, acceptance: tuple[float, ...]) -> list[MeasuredPoint]:
    """The engine after its performance work (``h200x2.json``): prefill as for ``engine``;
    decode ms per token from the ``derived`` block (device time of the steady-state steps,
    CUDA graphs replayed, captures left out), never the wall-time ``decode_tok_s`` (they
    include one-time Triton JIT). The K=2 point keeps the engine's first-position acceptance
    and sets the second so that ``1 + a1 + a1 a2`` is the measured tokens a step: only that
    sum enters the prediction. PCP=2 example: none (decode was measured at PCP=1 only)."""
    out = _engine_prefill(doc, src, "engine-v2")
    derived = doc.get("derived")
    if not isinstance(derived, dict):
        raise ValueError(f"{src}: no 'derived' object (steady-state decode figures)")
    per_step = _num(derived.get("tokens_per_decode_step_k2"), f"{src}: derived.tokens_per_decode_step_k2")
    a1 = acceptance[0]
    a2 = (per_step - 1 - a1) / a1
    if not 0 <= a2 <= 1:
        raise ValueError(f"{src}: derived.tokens_per_decode_step_k2 {per_step} is not 1 + {a1:.3f} + {a1:.3f} x a2 "
                         f"for an acceptance a2 in [0, 1]")
    for k, acc in ((0, ()), (2, (a1, a2))):
        ms = _num(derived.get(f"decode_ms_per_token_k{k}"), f"{src}: derived.decode_ms_per_token_k{k}")
        note = "steady-state device time per step over tokens a step (derived)"
        out.append(MeasuredPoint(f"engine-v2 decode k{k}", src,
                                 Case("engine-v2", "decode_token", DECODE_CONTEXT, k=k, acceptance=acc),
                                 ms / 1e3, note + (f", {per_step} tokens a step" if k else "")))
    return out


def _case(d: dict, where: str, acceptance: tuple[float, ...]) -> Case:
    try:
        k = int(d.get("k", 0))
        acc = tuple(d["acceptance"]) if "acceptance" in d else acceptance[:k]
        return Case(d["system"], d["kind"], int(d["tokens"]), pcp=int(d.get("pcp", 1)), k=k,
                    batch=int(d.get("batch", 1)), chunk=d.get("chunk"), acceptance=acc)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: bad case ({e})") from None


def _reported(doc: dict, src: str, acceptance: tuple[float, ...]):
    measured, ratios, unchecked = [], [], []
    for i, p in enumerate(doc.get("points", [])):
        where = f"{src}: points[{i}]"
        measured.append(MeasuredPoint(p["name"], src, _case(p, where, acceptance),
                                      _num(p.get("seconds"), where), p.get("note", "")))
    for i, r in enumerate(doc.get("ratios", [])):
        where = f"{src}: ratios[{i}]"
        ratios.append(RatioPoint(r["name"], src, _case(r["num"], where, acceptance),
                                 _case(r["den"], where, acceptance), _num(r.get("value"), where),
                                 r.get("note", "")))
    for u in doc.get("unchecked", []):
        unchecked.append(Unchecked(u["name"], src, u["why"]))
    return measured, ratios, unchecked


def load_points(root: str | None = None, sources: tuple[str, ...] = DEFAULT_SOURCES) -> Points:
    """Every measured point in ``sources`` (paths relative to the repo ``root``); ValueError
    naming the file for a missing or malformed one. The engine's file (``h200x2_engine_v1.json``) must be
    among them: its K=2 acceptance is lent to decode points that record none."""
    root = root or repo_root()
    docs = {}
    for rel in sources:
        docs[rel] = read_json_file(os.path.join(root, rel), "points file")
        if not isinstance(docs[rel], dict):
            raise ValueError(f"points file {rel}: expected a JSON object")
    engine_rel = next((r for r in sources if os.path.basename(r) == "h200x2_engine_v1.json"), None)
    if engine_rel is None:
        raise ValueError("points: data/bench/h200x2_engine_v1.json (the engine's figures and acceptance) is required")
    acceptance = _engine_acceptance(docs[engine_rel], engine_rel)
    measured, ratios, unchecked = [], [], []
    for rel, doc in docs.items():
        try:
            if os.path.basename(rel).startswith("vllm_"):
                measured += _vllm(doc, rel, acceptance)
            elif rel == engine_rel:
                measured += _engine(doc, rel, acceptance)
            elif os.path.basename(rel) == "h200x2.json":
                measured += _engine_v2(doc, rel, acceptance)
            else:
                m, r, u = _reported(doc, rel, acceptance)
                measured, ratios, unchecked = measured + m, ratios + r, unchecked + u
        except (KeyError, TypeError) as e:
            raise ValueError(f"points file {rel}: missing or malformed field {e}") from None
    return Points(tuple(measured), tuple(ratios), tuple(unchecked), acceptance)
