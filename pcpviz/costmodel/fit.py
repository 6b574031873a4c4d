"""Fit the systems' free parameters to the measured points; check every point; read/write the fit.

Least squares on log time: each point contributes ``log(predicted / measured)`` (a ratio
point, ``log`` of the predicted ratio over the measured one); each parameter is pulled
toward a stated prior by ``PRIOR_WEIGHT x log(value / prior)`` (efficiencies: on the logit),
so a parameter no point constrains stays at its prior instead of wandering. Solved by a plain
Levenberg-Marquardt with finite-difference Jacobians from the priors: deterministic.

Parameters are shared where the mechanism is: vLLM eager and vLLM with CUDA graphs run the
same kernels (``vllm.attn_eff`` ...) and the same host code per token (``vllm.token_s``,
``vllm.pcp_token_s``); graphs change only the fixed costs (``step_s``, ``layer_s``,
``draft_s``).

Worked numbers: 22 measured times and 4 measured ratios for 27 parameters. The priors carry
the parameters the tiny model cannot reveal (every bandwidth efficiency: its decode steps
read ~6.5 MB, 1.4 us of HBM time inside a ~4 ms step), so the DeepSeek-V3 decode predictions
rest on stated bandwidth efficiencies, not fitted ones; ``Fit.constrained`` lists the rest.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from pcpviz.costmodel.points import Case, Points, load_points
from pcpviz.costmodel.specs import H200, Hardware, ModelSpec, System, tiny_model
from pcpviz.costmodel.step import decode_time_per_token, prefill_time
from pcpviz.io_guards import read_json_file
from pcpviz.trace.outputs import write_output

__all__ = ["PRIORS", "SYSTEM_KEYS", "Fit", "fit", "predict_case", "systems_from", "load_fit", "fit_to_json",
           "format_fit", "write_fit"]

PRIOR_WEIGHT = 0.1
OVERHEADS = ("step_s", "layer_s", "draft_s", "token_s", "pcp_token_s")
EFFS = ("attn_eff", "gemm_eff", "bw_eff")
SHARED_VLLM = ("token_s", "pcp_token_s") + EFFS

# Stated priors (seconds, fractions of peak) and why:
PRIORS = {
    "vllm-eager.step_s": 2e-3,     # a V1 engine-core step with 2 worker processes: schedule, broadcast, sample, output
    "vllm-eager.layer_s": 3e-4,    # eager: ~40 kernel launches a DeepSeek layer at ~7 us each
    "vllm-eager.draft_s": 1e-3,    # a draft forward's embedding, lm_head, sampling, metadata
    "vllm-graphs.step_s": 1e-3,
    "vllm-graphs.layer_s": 2e-5,   # a captured graph replays a layer's kernels back to back
    "vllm-graphs.draft_s": 3e-4,
    "vllm.token_s": 1e-7,          # vectorised batch building
    "vllm.pcp_token_s": 1e-7,
    "vllm.attn_eff": 0.5,          # FlashAttention-class prefill on Hopper
    "vllm.gemm_eff": 0.6,
    "vllm.bw_eff": 0.7,
    "engine.step_s": 2e-3,
    "engine.layer_s": 1e-3,        # eager torch with Python per layer
    "engine.draft_s": 2e-3,
    "engine.token_s": 1e-6,        # per-token Python on the hot path (issue: item 1)
    "engine.pcp_token_s": 1e-6,
    "engine.attn_eff": 0.03,       # kernels_h200.json: the DualChunkSwap prefill kernel at ~30 TFLOP/s
    "engine.gemm_eff": 0.5,
    "engine.bw_eff": 0.36,         # kernels_h200.json: paged MLA decode at 41% of the 4.19 TB/s copy rate
    # engine-v2: the engine after its performance work (h200x2.json): decode replays CUDA graphs,
    # prefill runs eager with the flash MLA kernel.
    "engine-v2.step_s": 1e-3,      # host schedule / batch / upload a step (packed uploads, async recorder)
    "engine-v2.layer_s": 2e-5,     # decode: a captured graph replays a layer's kernels back to back
    "engine-v2.draft_s": 3e-4,     # a graph-replayed draft forward's sampling and bookkeeping
    "engine-v2.token_s": 1e-7,     # vectorised batch building
    "engine-v2.pcp_token_s": 1e-7,
    "engine-v2.attn_eff": 0.42,    # kernels_h200.json: the engine's prefill attention, 1.37 TFLOP in 3.27 ms at 32k
    "engine-v2.gemm_eff": 0.5,
    "engine-v2.bw_eff": 0.48,      # kernels_h200.json: paged MLA bf16 decode at 55.5% of the 4.16 TB/s copy rate
}


def _keys(system: str) -> dict[str, str]:
    if system.startswith("vllm-"):
        return {f: (f"vllm.{f}" if f in SHARED_VLLM else f"{system}.{f}") for f in OVERHEADS + EFFS}
    return {f: f"{system}.{f}" for f in OVERHEADS + EFFS}


SYSTEM_KEYS = {s: _keys(s) for s in ("vllm-eager", "vllm-graphs", "engine", "engine-v2")}


def systems_from(values: dict[str, float]) -> dict[str, System]:
    """``System`` objects from a flat ``{key: value}`` table (missing keys: the priors)."""
    table = {**PRIORS, **values}
    return {s: System(name=s, **{f: table[key] for f, key in keys.items()}) for s, keys in SYSTEM_KEYS.items()}


def predict_case(case: Case, systems: dict[str, System], model: ModelSpec, *, hw: Hardware = H200) -> float:
    """Predicted seconds for one measured configuration."""
    sysm = systems[case.system]
    if case.kind == "decode_token":
        return decode_time_per_token(model, hw, sysm, batch=case.batch, context=case.tokens, k=case.k,
                                     acceptance=case.acceptance, pcp=case.pcp)
    return prefill_time(model, hw, sysm, tokens=case.tokens, chunk=case.chunk, pcp=case.pcp, k=case.k,
                        with_step=case.kind == "prefill")


@dataclasses.dataclass(frozen=True)
class Fit:
    values: dict[str, float]          # fitted parameters by key
    rows: tuple[dict, ...]            # one per point: name, source, kind, measured, predicted, factor
    unchecked: tuple[dict, ...]
    worst_factor: float               # max over points of max(pred/meas, meas/pred)
    rms_log_error: float
    iterations: int
    constrained: tuple[str, ...] = ()  # keys the data pull harder than their priors do

    @property
    def systems(self) -> dict[str, System]:
        return systems_from(self.values)


def _to_u(key: str, v: float) -> float:
    return math.log(v / (1 - v)) if key.endswith("_eff") else math.log(v)


def _from_u(key: str, u: float) -> float:
    return 1 / (1 + math.exp(-u)) if key.endswith("_eff") else math.exp(u)


def fit(points: Points | None = None, model: ModelSpec | None = None, hw: Hardware = H200,
        *, max_iter: int = 200) -> Fit:
    """Fit the parameters of every system that has points; the others keep their priors."""
    points = points or load_points()
    model = model or tiny_model()
    used = {p.case.system for p in points.measured} | {c.system for r in points.ratios for c in (r.num, r.den)}
    unknown = used - set(SYSTEM_KEYS)
    if unknown:
        raise ValueError(f"points name unknown systems: {', '.join(sorted(unknown))}")
    keys = sorted({SYSTEM_KEYS[s][f] for s in used for f in OVERHEADS + EFFS})
    u0 = np.array([_to_u(k, PRIORS[k]) for k in keys])

    def residuals(u: np.ndarray) -> np.ndarray:
        sysms = systems_from({k: _from_u(k, x) for k, x in zip(keys, u)})
        r = [math.log(predict_case(p.case, sysms, model, hw=hw) / p.seconds) for p in points.measured]
        r += [math.log(predict_case(q.num, sysms, model, hw=hw) / predict_case(q.den, sysms, model, hw=hw) / q.value)
              for q in points.ratios]
        return np.concatenate([np.array(r), PRIOR_WEIGHT * (u - u0)])

    u, lam, it = u0.copy(), 1e-2, 0
    r = residuals(u)
    cost = float(r @ r)
    for it in range(1, max_iter + 1):
        jac = np.empty((r.size, u.size))
        for j in range(u.size):
            du = np.zeros_like(u)
            du[j] = 1e-6
            jac[:, j] = (residuals(u + du) - r) / 1e-6
        g, a = jac.T @ r, jac.T @ jac
        improved = False
        while lam < 1e12:
            step = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-12), -g)
            r_new = residuals(u + step)
            c_new = float(r_new @ r_new)
            if c_new < cost:
                u, r, improved = u + step, r_new, True
                lam = max(lam / 3, 1e-9)
                done = cost - c_new < 1e-12 * max(cost, 1e-30)
                cost = c_new
                break
            lam *= 4
        if not improved or done:
            break
    values = {k: _from_u(k, x) for k, x in zip(keys, u)}
    n_data = r.size - u.size
    # A parameter the data pull harder than its prior (finite-difference Jacobian at the fit).
    pulled = []
    for j, key in enumerate(keys):
        du = np.zeros_like(u)
        du[j] = 1e-6
        col = (residuals(u + du)[:n_data] - r[:n_data]) / 1e-6
        if float(np.linalg.norm(col)) > PRIOR_WEIGHT:
            pulled.append(key)
    return _summarise(values, points, model, hw=hw, it=it, constrained=tuple(pulled))


def _summarise(values: dict[str, float], points: Points, model: ModelSpec, *, hw: Hardware, it: int,
               constrained: tuple[str, ...]) -> Fit:
    sysms = systems_from(values)
    rows = []
    for p in points.measured:
        pred = predict_case(p.case, sysms, model, hw=hw)
        rows.append({"name": p.name, "source": p.source, "system": p.case.system, "kind": p.case.kind,
                     "tokens": p.case.tokens, "pcp": p.case.pcp, "k": p.case.k, "measured": p.seconds,
                     "predicted": pred, "factor": max(pred / p.seconds, p.seconds / pred), "note": p.note})
    for q in points.ratios:
        pred = predict_case(q.num, sysms, model, hw=hw) / predict_case(q.den, sysms, model, hw=hw)
        rows.append({"name": q.name, "source": q.source, "system": q.num.system, "kind": "ratio",
                     "measured": q.value, "predicted": pred, "factor": max(pred / q.value, q.value / pred),
                     "note": q.note})
    logs = [math.log(r["factor"]) for r in rows]
    return Fit(values=values, rows=tuple(rows),
               unchecked=tuple({"name": u.name, "source": u.source, "why": u.why} for u in points.unchecked),
               worst_factor=max(r["factor"] for r in rows),
               rms_log_error=math.sqrt(sum(x * x for x in logs) / len(logs)), iterations=it,
               constrained=constrained)


def format_fit(f: Fit) -> str:
    """The fit as text: one line per point (factor, measured, predicted, name, source), the
    unchecked figures, the summary, the parameters by system."""
    from pcpviz.costmodel.step import seconds_text

    lines = []
    for row in f.rows:
        unit = (lambda x: f"{x:.3f}") if row["kind"] == "ratio" else seconds_text
        lines.append(f"{row['factor']:5.2f}x  measured {unit(row['measured']):>9}  predicted "
                     f"{unit(row['predicted']):>9}  {row['name']}  [{row['source']}]")
    lines += [f"  unchecked: {u['name']}: {u['why']}" for u in f.unchecked]
    lines.append(f"{len(f.rows)} points, worst factor {f.worst_factor:.2f}, rms log error {f.rms_log_error:.3f}, "
                 f"{f.iterations} iterations")
    for s in sorted({k.split(".")[0] for k in f.values}):
        vals = "  ".join(f"{k.split('.')[1]}={v:.3g}" for k, v in sorted(f.values.items()) if k.startswith(s + "."))
        lines.append(f"  {s}: {vals}")
    lines.append(f"  pulled by the data more than by their priors: {', '.join(f.constrained) or 'none'}")
    return "\n".join(lines)


def fit_to_json(f: Fit, hw: Hardware = H200) -> dict:
    def rnd(x):
        return float(f"{x:.6g}") if isinstance(x, float) else x

    return {
        "what": "pcpviz.costmodel fitted to every measured point (python -m pcpviz.costmodel fit)",
        "hardware": dataclasses.asdict(hw),
        "prior_weight": PRIOR_WEIGHT,
        "priors": PRIORS,
        "systems": {s: {k: rnd(v) for k, v in dataclasses.asdict(sysm).items()} for s, sysm in f.systems.items()},
        "fitted_keys": sorted(f.values),
        "constrained_by_data": sorted(f.constrained),
        "worst_factor": rnd(f.worst_factor),
        "rms_log_error": rnd(f.rms_log_error),
        "iterations": f.iterations,
        "points": [{k: rnd(v) for k, v in row.items()} for row in f.rows],
        "unchecked": list(f.unchecked),
    }


def load_fit(path: str) -> dict[str, System]:
    """The systems of a fit file written by ``fit_to_json``; ValueError naming the file."""
    doc = read_json_file(path, "--fit")
    try:
        return {name: System(**{**d, "name": name}) for name, d in doc["systems"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"--fit {path}: not a cost-model fit ({' '.join(str(e).split())})") from None


def write_fit(f: Fit, path: str, hw: Hardware = H200) -> None:
    write_output(path, json.dumps(fit_to_json(f, hw), indent=1) + "\n", option="--out")
