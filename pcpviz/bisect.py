"""``bisect``: which configuration knob flips acceptance or tokens. Same prompts, a ladder of
configurations that each differ from a base in one knob; every rung is run and recorded, then
compared with the base: generated tokens (``pcpviz.analysis.parity.generated_tokens``, common
prefix per request), acceptance per draft position (``pcpviz.analysis.acceptance``), and for a
rung that flips either, the first divergent view (``pcpviz.analysis.diff.diff_traces``).

It drives producers and analysis, so it sits above both (producers never import analysis).

Producers and their knobs (the others are reported as not available there):

=============  ===============================================================================
``replay``     vLLM 0.33.0's own classes on CPU (``pcpviz.vllm.replay``, tiny-model weights):
               ``pcp`` (N <-> 1), ``graph_mode`` (NONE / PIECEWISE / FULL_AND_PIECEWISE),
               ``k``, ``chunked_prefill`` (the scenario's chunks on/off), ``decodes`` (sharded /
               replicated: the DCP-style placement)
``engine``     the pcpviz engine (``pcpviz.run``, CPU or CUDA ranks): ``pcp``, ``k``,
               ``max_num_batched_tokens`` (the chunked-prefill budget: base <-> 2048)
``vllm``       real vLLM 0.33.0 on GPUs (``pcpviz.vllm.run``, the plugin recording): ``pcp``,
               ``graph_mode`` (its ``cudagraph_mode``), ``k``, ``max_num_batched_tokens``
               (base <-> 256, with ``max_num_seqs`` 16 so vLLM accepts the small budget) and
               ``prefix_caching`` (``enable_prefix_caching``)
=============  ===============================================================================

Prefix caching has no switch in the replay or the engine (reported as not available there). A
rung the machine cannot run (``pcp=2`` on one GPU) is reported as an error line, not a flip.
A bug planted with ``python -m pcpviz.analysis.mutations NAME DIR`` runs in every engine rung
when bisect itself runs with ``PYTHONPATH=DIR`` (the ranks inherit it): the chunked-prefill
bug ``must_sample_a_chunk_early`` flips only ``max_num_batched_tokens=2048``
(``tests/engine/test_bisect_engine.py``).

The PIECEWISE finding on the replay, base PCP=2, K=2, PIECEWISE::

    report = bisect("replay", base={"pcp": 2, "k": 2, "graph_mode": "PIECEWISE"}, out_dir="runs/bisect")
    [r.rung.name for r in report.flips()]     # ['pcp=1', 'graph_mode=NONE']
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pcpviz.analysis.acceptance import acceptance
from pcpviz.analysis.checks import run_checks
from pcpviz.analysis.diff import diff_traces
from pcpviz.analysis.exposure import parse_fixes
from pcpviz.analysis.parity import generated_tokens
from pcpviz.trace import open as open_trace

__all__ = ["BISECT_PRODUCERS", "KNOBS", "Rung", "RungResult", "BisectReport", "ladder", "bisect"]

BISECT_PRODUCERS = ("replay", "engine", "vllm")
KNOBS = {
    "replay": ("pcp", "graph_mode", "k", "chunked_prefill", "decodes"),
    "engine": ("pcp", "k", "max_num_batched_tokens"),
    "vllm": ("pcp", "graph_mode", "k", "max_num_batched_tokens", "prefix_caching"),
}
_ALL_KNOBS = ("pcp", "graph_mode", "k", "chunked_prefill", "max_num_batched_tokens", "prefix_caching", "decodes")
_DEFAULTS = {
    "replay": {"pcp": 2, "k": 2, "graph_mode": "NONE", "chunked_prefill": True, "decodes": "sharded",
               "scenario": "mixed"},
    "engine": {"pcp": 2, "k": 2, "max_num_batched_tokens": 16, "device": "cpu", "max_new_tokens": 12},
    "vllm": {"pcp": 2, "k": 2, "graph_mode": "FULL_AND_PIECEWISE", "max_num_batched_tokens": 2048,
             "prefix_caching": False, "max_new_tokens": 32},
}
VLLM_SMALL_BUDGET = 256
"""The ``max_num_batched_tokens`` rung of a vLLM base budget above it (and the base budget's rung
below it is 2048): vLLM wants the budget at least ``max_num_seqs``, which the vLLM rungs set to 16."""
_GRAPH_MODES = ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE")
_ENGINE_PROMPTS = ("def read_config(path):\n    with open(path) as f:\n        return json",
                   "class Stack:\n    def __init__(self):\n        self.items = []\n",
                   "import os\nimport sys\n\nfor name in sorted(os.listdir(")
_VLLM_PROMPTS = _ENGINE_PROMPTS + ("".join(f"def scale_{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(40)),)
"""The vLLM rungs' prompts: the engine's, and one longer than the 256-token budget rung (it chunks there)."""


@dataclass(frozen=True)
class Rung:
    """One configuration: the base with ``knob`` set to ``value`` (the base itself: knob None)."""

    name: str
    knob: str | None
    value: Any
    options: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class RungResult:
    rung: Rung
    trace_path: str | None
    acceptance: tuple[float, ...]  # rate per draft position (NaN: nothing drafted there)
    tokens_equal: bool  # every request's generated tokens equal the base's on their common prefix
    token_divergence: str | None  # "request d0 token 3: 101 (base) vs 32"
    acceptance_flip: str | None  # "position 0: 0.89 (base) vs 0.26"
    first_divergence: str | None  # diff's first divergent view (flips only)
    error: str | None = None  # the rung could not run (one line)
    acceptance_delta: float = 0.0  # the largest |rate - base rate| over the common positions
    check: str | None = None  # "passes" or "fails <check> at <where>" (pcpviz check on the rung's trace)

    @property
    def flips(self) -> bool:
        return self.error is None and (not self.tokens_equal or self.acceptance_flip is not None)

    def to_dict(self) -> dict[str, Any]:
        return {"rung": self.rung.name, "knob": self.rung.knob, "value": self.rung.value,
                "options": self.rung.options, "trace": self.trace_path,
                "acceptance_rate_per_pos": [None if math.isnan(x) else x for x in self.acceptance],
                "tokens_equal": self.tokens_equal, "token_divergence": self.token_divergence,
                "acceptance_flip": self.acceptance_flip, "acceptance_delta": self.acceptance_delta,
                "flips": self.flips,
                "first_divergence": self.first_divergence, "check": self.check, "error": self.error}


@dataclass(frozen=True)
class BisectReport:
    producer: str
    base: RungResult
    rungs: tuple[RungResult, ...]
    unavailable: tuple[str, ...]  # knobs this producer cannot switch (with why)
    tolerance: float

    def flips(self) -> list[RungResult]:
        return [r for r in self.rungs if r.flips]

    def to_dict(self) -> dict[str, Any]:
        return {"producer": self.producer, "tolerance": self.tolerance, "base": self.base.to_dict(),
                "rungs": [r.to_dict() for r in self.rungs], "flips": [r.rung.name for r in self.flips()],
                "unavailable": list(self.unavailable)}

    def format(self) -> str:
        """The report as text: the base, one line per rung, then each flip with its first divergent view."""
        lines = [f"bisect on {self.producer}, base {_opts(self.base.rung.options)}: acceptance "
                 f"{_rates(self.base.acceptance)}; check {self.base.check}"]
        for r in self.rungs:
            verdict = ("ERROR " + r.error if r.error else "FLIPS" if r.flips else "same")
            lines.append(f"  {r.rung.name:<28} acceptance {_rates(r.acceptance):<18} tokens "
                         f"{'equal' if r.tokens_equal else 'DIFFER'}  {verdict}")
            if r.check and r.check != self.base.check:
                lines.append(f"  {'':<28} check {r.check}")
        flips = self.flips()
        if not flips:
            lines.append("no knob flips acceptance (tolerance %.2f) or tokens" % self.tolerance)
        if flips:
            top = max(r.acceptance_delta for r in flips)
            strongest = [r.rung.name for r in flips if r.acceptance_delta >= top - 1e-9]
            lines.append(f"largest acceptance change ({top:.2f}): {', '.join(strongest)}")
        for r in flips:
            what = "; ".join(x for x in (r.token_divergence, r.acceptance_flip and "acceptance " + r.acceptance_flip)
                             if x)
            lines.append(f"{r.rung.name} flips: {what}")
            lines.append(f"  first divergent view: {r.first_divergence or 'none recorded'}")
        for u in self.unavailable:
            lines.append(f"not available: {u}")
        return "\n".join(lines)


def _opts(options: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in options.items()
                    if k not in ("device", "max_new_tokens", "scenario", "model", "engine_args"))


def _rates(rates: Sequence[float]) -> str:
    return " / ".join("-" if math.isnan(x) else f"{x:.2f}" for x in rates) or "-"


def ladder(producer: str, base: dict[str, Any], knobs: Sequence[str] | None = None) -> tuple[list[Rung], list[str]]:
    """The rungs (one knob changed each) and the knobs not available on ``producer``.

        >>> [r.name for r in ladder("replay", {"pcp": 2, "k": 2, "graph_mode": "PIECEWISE"}, ["pcp", "graph_mode"])[0]]
        ['pcp=1', 'graph_mode=NONE', 'graph_mode=FULL_AND_PIECEWISE']
    """
    if producer not in BISECT_PRODUCERS:
        raise ValueError(f"producer must be one of {', '.join(BISECT_PRODUCERS)}, got {producer!r}")
    opts = {**_DEFAULTS[producer], **base}
    wanted = list(KNOBS[producer]) if knobs is None else list(knobs)
    bad = [k for k in wanted if k not in _ALL_KNOBS]
    if bad:
        raise ValueError(f"unknown knob {bad[0]!r}; knobs: {', '.join(_ALL_KNOBS)}")
    rungs, unavailable = [], []
    for knob in wanted:
        if knob not in KNOBS[producer]:
            unavailable.append(f"{knob} (no switch in the {producer})")
            continue
        for value in _values(knob, opts[knob], producer):
            rungs.append(Rung(f"{knob}={value}", knob, value, {**opts, knob: value}))
    if knobs is None and "prefix_caching" not in KNOBS[producer]:
        unavailable.append(f"prefix_caching (no switch in the {producer})")
    return rungs, unavailable


def _values(knob: str, base: Any, producer: str = "engine") -> list[Any]:
    if knob == "pcp":
        return [1] if base > 1 else [2]
    if knob == "k":
        return [1] if base > 1 else [2]
    if knob == "graph_mode":
        return [m for m in _GRAPH_MODES if m != base]
    if knob in ("chunked_prefill", "prefix_caching"):
        return [not base]
    if knob == "decodes":
        return ["replicated" if base == "sharded" else "sharded"]
    if knob == "max_num_batched_tokens":
        small = VLLM_SMALL_BUDGET if producer == "vllm" else 16
        return [2048] if base < 2048 else [small]
    raise ValueError(f"unknown knob {knob!r}")


def _run_replay(options: dict[str, Any], trace_dir: Path, *, fixes: str | None) -> Path:
    from pcpviz.vllm import replay as replay_module  # imports vLLM (~15 s): only when the replay is bisected

    res = replay_module.replay(pcp=options["pcp"], mtp=options["k"], trace_dir=trace_dir,
                               scenario=options["scenario"], graph_mode=options["graph_mode"],
                               chunked_prefill=options["chunked_prefill"], decodes=options["decodes"],
                               overwrite=True, dummy=False, fixes=fixes or "")
    return Path(res.trace_path)


def _run_engine(options: dict[str, Any], trace_dir: Path, *, inject: Sequence[str],
                prompts: Sequence[str]) -> Path:
    from pcpviz.engine.launch import run as engine_run

    engine_run(list(prompts), pcp=options["pcp"], num_speculative_tokens=options["k"], device=options["device"],
               max_new_tokens=options["max_new_tokens"], max_num_batched_tokens=options["max_num_batched_tokens"],
               trace_dir=str(trace_dir), inject=list(inject), progress=False, overwrite=True)
    return trace_dir


def _run_vllm(options: dict[str, Any], trace_dir: Path, *, prompts: Sequence[str], fixes: str | None) -> Path:
    """One rung on real vLLM 0.33.0 (``pcpviz.vllm.run`` in a child process, the plugin recording)."""
    from pcpviz.vllm.launch import run as vllm_run  # pure until it launches: no vLLM import here

    engine_args = {**options.get("engine_args", {}), "max_num_batched_tokens": options["max_num_batched_tokens"],
                   "enable_prefix_caching": bool(options["prefix_caching"])}
    engine_args.setdefault("max_num_seqs", 16)
    vllm_run(options.get("model") or default_vllm_model(), list(prompts), pcp=options["pcp"],
             num_speculative_tokens=options["k"], trace_dir=trace_dir, max_tokens=options["max_new_tokens"],
             cudagraph_mode=options["graph_mode"], extra_engine_args=engine_args, progress=False, fixes=fixes)
    return trace_dir


def default_vllm_model() -> str:
    """The shipped tiny MTP model (``data/models/pcpviz-tiny-dsv3``), the vLLM rungs' default."""
    return str(Path(__file__).resolve().parents[1] / "data" / "models" / "pcpviz-tiny-dsv3")


def _check(path: Path) -> str:
    """``pcpviz check`` on a rung's trace, as one phrase: which configuration's own views are wrong."""
    report = run_checks(open_trace(path))
    v = report.first_violation
    if v is not None:
        return f"fails {v.check} at {v.where()}"
    return "passes" if report.ok else "does not pass (" + report.counts_line() + ")"


def _compare(base_path: Path, path: Path, base_acc: tuple[float, ...], rung: Rung, *,
             tolerance: float) -> RungResult:
    trace = open_trace(path)
    acc = acceptance(trace).rate_per_position
    tok_a, tok_b = generated_tokens(open_trace(base_path)), generated_tokens(trace)
    token_div = None
    for rid in sorted(set(tok_a) & set(tok_b)):
        a, b = tok_a[rid], tok_b[rid]
        i = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), None)
        if i is not None:
            token_div = f"request {rid} token {i}: {a[i]} (base) vs {b[i]}"
            break
    acc_flip, delta = None, 0.0
    for pos in range(min(len(base_acc), len(acc))):
        x, y = base_acc[pos], acc[pos]
        if math.isnan(x) or math.isnan(y):
            continue
        delta = max(delta, abs(x - y))
        if acc_flip is None and abs(x - y) > tolerance:
            acc_flip = f"position {pos}: {x:.2f} (base) vs {y:.2f}"
    first = None
    if token_div is not None or acc_flip is not None:
        report = diff_traces(base_path, path, max_divergences=1)
        first = None if report.first is None else report.first.describe()
    return RungResult(rung, str(path), tuple(acc), token_div is None, token_div, acc_flip, first,
                      acceptance_delta=round(delta, 6), check=_check(path))


def bisect(producer: str = "replay", *, out_dir: str | os.PathLike, base: dict[str, Any] | None = None,
           knobs: Sequence[str] | None = None, tolerance: float = 0.1, inject: Sequence[str] = (),
           fixes: str | None = None, prompts: Sequence[str] | None = None,
           progress: Callable[[str], None] | None = None) -> BisectReport:
    """Run the base configuration and one rung per knob value into ``out_dir/<rung>``, and report
    the rungs that flip tokens or acceptance (a rate per position moving by more than ``tolerance``).
    ``inject`` plants engine faults (every rung); ``fixes`` names ``pcpviz.vllm.fixes`` for every
    replay rung, or every vLLM rung (the plugin applies them there: ``PCPVIZ_FIXES``, and records
    them in run.json's ``vllm_fixes``). Raises ValueError for a bad producer, knob or option."""
    if inject and producer != "engine":
        raise ValueError("inject plants engine faults: it needs --producer engine")
    if fixes and producer == "engine":
        raise ValueError("fixes patch vLLM's code: they need --producer replay or vllm")
    parse_fixes(fixes)  # ValueError names an unknown one
    rungs, unavailable = ladder(producer, base or {}, knobs)
    if prompts is None:
        prompts = _VLLM_PROMPTS if producer == "vllm" else _ENGINE_PROMPTS
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    opts = {**_DEFAULTS[producer], **(base or {})}

    def run(rung: Rung) -> Path:
        d = out / rung.name.replace("=", "-")
        if progress is not None:
            progress(f"running {rung.name}: {_opts(rung.options)}")
        if producer == "replay":
            return _run_replay(rung.options, d, fixes=fixes)
        if producer == "vllm":
            return _run_vllm(rung.options, d, prompts=prompts, fixes=fixes)
        return _run_engine(rung.options, d, inject=inject, prompts=prompts)

    base_rung = Rung("base", None, None, opts)
    base_path = run(base_rung)
    base_acc = tuple(acceptance(open_trace(base_path)).rate_per_position)
    base_res = RungResult(base_rung, str(base_path), base_acc, True, None, None, None, check=_check(base_path))
    results = []
    for rung in rungs:
        try:
            path = run(rung)
        except (ValueError, RuntimeError) as e:  # a configuration the producer refuses: said, not fatal
            results.append(RungResult(rung, None, (), True, None, None, None, error=" ".join(str(e).split())))
            continue
        results.append(_compare(base_path, path, base_acc, rung, tolerance=tolerance))
    return BisectReport(producer, base_res, tuple(results), tuple(unavailable), tolerance)
