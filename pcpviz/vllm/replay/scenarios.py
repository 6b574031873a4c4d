"""The replay's scripted scenarios: which requests arrive when, how their prompts are chunked,
and how many drafts each verification rejects. Plain data (no vLLM import).

``mixed`` with PCP=2, K=2: at step 0 ``d0`` (13 prompt tokens) and ``p1`` (26, chunked by 10)
prefill; from step 1 ``d0`` decodes with 2 drafts, and ``rejections[(1, "d0")] = 9`` rejects
all of them (clipped to the 2 scheduled), so step 2's CPU cursor for ``d0`` runs 2 ahead of the
GPU's (async scheduling).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["ScenarioRequest", "Scenario", "SCENARIOS"]


@dataclass(frozen=True)
class ScenarioRequest:
    """One scripted request: ``prompt_len`` prompt tokens, first scheduled at step ``arrive``,
    at most ``chunk`` prompt tokens a step (chunked prefill), last scheduled at ``finish``."""

    req_id: str
    prompt_len: int
    arrive: int = 0
    chunk: int | None = None
    finish: int | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    requests: tuple[ScenarioRequest, ...]
    num_steps: int
    # (step, req_id) -> drafts rejected when that step verifies (clipped to the drafts scheduled)
    rejections: Mapping[tuple[int, str], int] = field(default_factory=dict)
    drafter: str = "mtp"


SCENARIOS: dict[str, Scenario] = {
    "mixed": Scenario(
        "mixed",
        "fresh and chunked prefills next to decodes carrying K drafts, with full, partial and no "
        "rejections (docs/vllm-0.33-pcp-mtp.md's Scenario A over several steps)",
        (ScenarioRequest("d0", 13), ScenarioRequest("p1", 26, chunk=10), ScenarioRequest("d2", 5, arrive=1),
         ScenarioRequest("p3", 17, arrive=2), ScenarioRequest("d4", 7, arrive=3)),
        num_steps=5,
        rejections={(1, "d0"): 9, (2, "d0"): 1, (2, "d2"): 0, (3, "d0"): 0, (3, "d2"): 9, (3, "p1"): 1,
                    (4, "d0"): 1, (4, "d2"): 0, (4, "p1"): 9, (4, "p3"): 1},
    ),
    "decode_only": Scenario(
        "decode_only",
        "one prefill step, then decode-only steps with K drafts and rejections; requests finish until "
        "fewer decodes than ranks remain (a rank gets vLLM's zero-length placeholder row)",
        (ScenarioRequest("a0", 6), ScenarioRequest("a1", 3, finish=4), ScenarioRequest("a2", 9, finish=3)),
        num_steps=6,
        rejections={(1, "a0"): 1, (1, "a2"): 9, (2, "a1"): 1, (3, "a0"): 9, (3, "a1"): 0, (4, "a0"): 0,
                    (4, "a1"): 1, (5, "a0"): 1},
    ),
    "dspark": Scenario(
        "dspark",
        "the mixed batch with the replicated DSpark drafter's input preparation (block-table gather + "
        "prepare_dflash_inputs on the global batch), recorded with and without the gather",
        (ScenarioRequest("d0", 13), ScenarioRequest("p1", 26, chunk=10), ScenarioRequest("d2", 5, arrive=1),
         ScenarioRequest("p3", 17, arrive=2)),
        num_steps=4,
        rejections={(1, "d0"): 9, (2, "d0"): 1, (2, "d2"): 0, (3, "d0"): 0, (3, "d2"): 1, (3, "p1"): 1},
        drafter="dspark",
    ),
    "full_graphs": Scenario(
        "full_graphs",
        "five short prompts, then decode-only steps of 5 requests (and 4 after one finishes): with "
        "max_num_seqs=5 and K=2, vLLM's default capture sizes give the draft prefill a FULL graph for 5 "
        "requests and the draft decodes none (docs/findings/full-draft-prefill-state.md)",
        (ScenarioRequest("f0", 4), ScenarioRequest("f1", 5), ScenarioRequest("f2", 6), ScenarioRequest("f3", 7),
         ScenarioRequest("f4", 3, finish=2)),
        num_steps=4,
        rejections={(1, "f0"): 1, (1, "f3"): 9, (2, "f1"): 1, (3, "f2"): 9},
    ),
    "long_context": Scenario(
        "long_context",
        "chunked prompts of 72 and 67 tokens next to a short one, then decodes past position 64: the MoE + "
        "DSA checkpoint's indexer (index_topk 64) then selects a part of each context, not all of it",
        (ScenarioRequest("s0", 72, chunk=32), ScenarioRequest("s1", 67, arrive=1, chunk=40),
         ScenarioRequest("d2", 9, arrive=1)),
        num_steps=6,
        rejections={(2, "d2"): 1, (3, "s0"): 9, (4, "d2"): 0, (5, "s1"): 1},
    ),
    "one_decode": Scenario(
        "one_decode",
        "one prompt, then one decode with K drafts: with sharded decodes only its owner rank sees a "
        "uniform decode batch in the draft prefill dispatch",
        (ScenarioRequest("o0", 6),),
        num_steps=2,
    ),
}
