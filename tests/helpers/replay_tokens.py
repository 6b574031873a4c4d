"""The tokens a CPU replay generated, per request (``ReplayResult.steps``' verify rows, -1 padding dropped)."""

from __future__ import annotations


def replay_tokens(res) -> dict[str, list[int]]:
    """``{request id: tokens}`` of a ``pcpviz.vllm.replay`` result, in generation order."""
    out: dict[str, list[int]] = {}
    for step in res.steps:
        o = step[0]
        for i, rid in enumerate(o.req_ids):
            out.setdefault(rid, []).extend(int(x) for x in o.sampled[i] if x >= 0)
    return out
