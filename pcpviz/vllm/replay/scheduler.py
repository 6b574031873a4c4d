"""The replay's scripted scheduler: vLLM ``SchedulerOutput``s for a ``Scenario``.

Deterministic: prompts chunked when the scenario asks, decodes with K drafts once a request has
sampled, async scheduling (the CPU cursor sent runs ahead of the GPU cursor by the drafts
rejected in the previous step), one block allocator for all ranks. Scenario ``mixed``, K=2,
block size 4: at step 0 ``d0`` is scheduled its 13 prompt tokens and gets blocks ``[1, 2, 3, 4]``
(room for 13 + K tokens: ``ceil(15 / 4) = 4``), then ``p1`` 10 of its 26 and blocks ``[5, 6, 7]``
(block 0 is vLLM's null block).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from pcpviz.vllm.replay.ranks import ReplayConfig
from pcpviz.vllm.replay.scenarios import Scenario
from pcpviz.vllm.replay.tiny import tiny_prompts

__all__ = ["ScriptedScheduler"]


class ScriptedScheduler:
    """Deterministic scheduler: prompts (chunked when asked), decodes with K drafts once a
    request has sampled, async scheduling (the CPU cursor it sends runs ahead of the GPU
    cursor by the drafts rejected in the previous step), one block allocator for all ranks."""

    def __init__(self, scenario: Scenario, c: ReplayConfig) -> None:
        self.s, self.c = scenario, c
        self.reqs = {r.req_id: r for r in scenario.requests}
        if c.models == "tiny":  # Python source, byte-tokenized (the model's domain)
            texts = tiny_prompts([r.prompt_len for r in scenario.requests])
            self.prompts = {r.req_id: p for r, p in zip(scenario.requests, texts)}
        else:
            self.prompts = {r.req_id: [int(1 + (17 * i + 5 * j) % (c.vocab - 1)) for j in range(r.prompt_len)]
                            for i, r in enumerate(scenario.requests)}
        self.computed: dict[str, int] = {}  # GPU truth: tokens computed and kept
        self.lag: dict[str, int] = {}  # rejected drafts the scheduler has not seen yet
        self.sampled: dict[str, bool] = {}  # sampled in the previous step (so it has drafts)
        self.blocks: dict[str, list[int]] = {}
        self.next_block = 1  # block 0 is the null block
        self.finished: set[str] = set()

    @property
    def num_slots(self) -> int:
        total = sum(-(-(r.prompt_len + (self.s.num_steps + 1) * (self.c.k + 1) + self.c.k) // self.c.block_size)
                    for r in self.s.requests)
        return (total + 2) * self.c.block_size

    def _active(self, step: int) -> list[str]:
        return [r.req_id for r in self.s.requests
                if r.arrive <= step and (r.finish is None or step <= r.finish)]

    def schedule(self, step: int, drafts: bool) -> tuple[SchedulerOutput, dict[str, int]]:
        """The step's SchedulerOutput and the drafts scheduled per request."""
        c = self.c
        out = SchedulerOutput.make_empty()
        cached = CachedRequestData.make_empty()
        num_drafts: dict[str, int] = {}
        finished = {rid for rid, r in self.reqs.items()
                    if r.finish is not None and step == r.finish + 1 and rid not in self.finished}
        self.finished |= finished
        out.finished_req_ids = finished
        for rid in self._active(step):
            r = self.reqs[rid]
            new = rid not in self.computed
            done = self.computed.get(rid, 0)
            if done < r.prompt_len:
                q = r.prompt_len - done if r.chunk is None else min(r.chunk, r.prompt_len - done)
                nd = 0
            else:
                nd = c.k if (drafts and self.sampled.get(rid, False)) else 0
                q = 1 + nd
            cpu_cursor = done + self.lag.get(rid, 0)
            need = -(-(cpu_cursor + q + c.k) // c.block_size)
            have = self.blocks.setdefault(rid, [])
            fresh = list(range(self.next_block, self.next_block + max(0, need - len(have))))
            self.next_block += len(fresh)
            have.extend(fresh)
            out.num_scheduled_tokens[rid] = q
            if nd:
                out.scheduled_spec_decode_tokens[rid] = [-1] * nd
                num_drafts[rid] = nd
            if new:
                out.scheduled_new_reqs.append(NewRequestData(
                    req_id=rid, prompt_token_ids=self.prompts[rid], mm_features=[], sampling_params=None,
                    pooling_params=None, block_ids=(list(have),), num_computed_tokens=0, lora_request=None,
                    prefill_token_ids=self.prompts[rid]))
            else:
                cached.req_ids.append(rid)
                cached.num_computed_tokens.append(cpu_cursor)
                cached.new_block_ids.append((fresh,) if fresh else None)
                cached.num_output_tokens.append(0)
        out.scheduled_cached_reqs = cached
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.num_spec_tokens_to_schedule = c.k if drafts else 0
        return out, num_drafts

    def rejected(self, step: int, rid: str, num_drafts: int) -> int:
        return min(int(self.s.rejections.get((step, rid), 0)), num_drafts)

    def update(self, out: SchedulerOutput, req_ids: Sequence[str], *, num_sampled: np.ndarray,
               num_rejected: np.ndarray) -> None:
        for i, rid in enumerate(req_ids):
            q = out.num_scheduled_tokens[rid]
            self.computed[rid] = self.computed.get(rid, 0) + q - int(num_rejected[i])
            self.lag[rid] = int(num_rejected[i])
            self.sampled[rid] = bool(num_sampled[i] > 0)
