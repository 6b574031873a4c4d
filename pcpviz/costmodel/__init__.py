"""When do PCP and MTP pay off? A cost model of one serving step, fitted to measured points.

    from pcpviz.costmodel import H200, deepseek_v3, tiny_model, load_fit, pcp_prefill_speedup
    systems = load_fit("data/bench/costmodel_fit.json")
    pcp_prefill_speedup(deepseek_v3(), H200, systems["vllm-graphs"], tokens=131072, pcp=2, tp=8)

``specs`` (hardware, model shapes, a system's free parameters), ``step`` (the cost of a prefill
or decode step, term by term), ``points`` (the measured points in data/bench/), ``fit`` (least
squares on log time), ``answers`` (break-even context, MTP tables). docs/cost-model.md.
"""

from pcpviz.costmodel.answers import mtp_grid, pcp_breakeven, pcp_curve
from pcpviz.costmodel.fit import PRIORS, Fit, fit, format_fit, load_fit, predict_case, systems_from, write_fit
from pcpviz.costmodel.points import Case, MeasuredPoint, Points, RatioPoint, load_points
from pcpviz.costmodel.specs import H200, Hardware, ModelSpec, System, deepseek_v3, model_by_name, tiny_model
from pcpviz.costmodel.step import (StepCost, causal_pairs, conditional_from_vllm, decode_step,
                                   decode_time_per_token, expected_accepted_tokens, geometric_acceptance,
                                   moe_pcp_bytes, mtp_speedup, pcp_prefill_speedup, prefill_step,
                                   prefill_time, seconds_text)

__all__ = ["H200", "Hardware", "ModelSpec", "System", "deepseek_v3", "tiny_model", "model_by_name",
           "StepCost", "causal_pairs", "prefill_step", "prefill_time", "decode_step", "decode_time_per_token",
           "expected_accepted_tokens", "conditional_from_vllm", "geometric_acceptance", "mtp_speedup",
           "pcp_prefill_speedup", "Case", "MeasuredPoint", "RatioPoint", "Points", "load_points", "PRIORS",
           "Fit", "fit", "format_fit", "load_fit", "predict_case", "systems_from", "write_fit", "pcp_breakeven",
           "pcp_curve", "mtp_grid", "seconds_text", "moe_pcp_bytes"]
