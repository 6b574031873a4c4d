"""Continuous batching with chunked prefill and MTP drafts (the "EngineCore" side).

Runs on rank 0 only; each step it emits a ``SchedulerOutput`` that is broadcast
to every PCP rank, as vLLM's engine core does to its workers. It decides *how
many* tokens each request runs and which KV blocks it owns; the token ids of
decodes and drafts and the true positions live on the workers (their
``RequestState``), exactly the split that lets ranks fork silently when one of
them accepts a different number of drafts.

Policy (a compact version of vLLM's):
* running requests first, in arrival order, then waiting ones while a request
  slot and token budget (``max_num_batched_tokens``) remain;
* a prefill gets ``min(remaining prompt, budget)`` tokens (chunked prefill);
* a decode gets ``1 + K`` tokens (the last sampled token and K drafts) once
  it has drafts, else 1;
* the scheduler's cursor is optimistic: it assumes every scheduled token is
  kept, and is corrected by the rejected count rank 0 reports back.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import numpy as np

from pcpviz.reference.blocks import BlockAllocator

__all__ = ["SchedRequest", "ScheduledRow", "SchedulerOutput", "Scheduler"]


@dataclass
class SchedRequest:
    req_id: str
    prompt: list[int]
    max_new_tokens: int
    slot: int = -1
    num_computed: int = 0  # tokens whose KV is valid (corrected after verification)
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    has_drafts: bool = False
    finished: bool = False

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt, dtype=np.int64)  # int64[prompt_len], sent once

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)


@dataclass(frozen=True)
class ScheduledRow:
    req_id: str
    slot: int  # request-state index = block-table row
    num_tokens: int
    is_prefilling: bool
    prompt_start: int  # a prefill chunk is prompt[prompt_start : prompt_start + num_tokens]
    prompt_len: int
    new_blocks: tuple[int, ...]  # blocks appended to the request's row this step
    is_new: bool  # first time scheduled: the worker creates its request state
    # int64[prompt_len] on a new row only, None after (vLLM's NewRequestData carries the prompt
    # once; the workers keep it in their request state)
    prompt_token_ids: np.ndarray | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class SchedulerOutput:
    step: int
    rows: tuple[ScheduledRow, ...]  # in vLLM's global batch order
    finished: tuple[tuple[str, int], ...]  # (req_id, slot) freed before this step

    def to_json(self) -> dict:
        """Plain JSON data (what rank 0 broadcasts; no pickle)::

            {"step": 3, "finished": [["req1", 1]],
             "rows": [{"req_id": "req0", "slot": 0, ..., "prompt": "AQAAAA..."}]}

        A new row's prompt travels once, as base64 of little-endian int32 (a 32k-token prompt is
        171 kB of text, encoded and decoded in well under a millisecond)."""
        rows = []
        for r in self.rows:
            d = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(r).items() if k != "prompt_token_ids"}
            if r.prompt_token_ids is not None:
                d["prompt"] = base64.b64encode(r.prompt_token_ids.astype("<i4").tobytes()).decode("ascii")
            rows.append(d)
        return {"step": self.step, "finished": [list(f) for f in self.finished], "rows": rows}

    @classmethod
    def from_json(cls, doc: dict) -> "SchedulerOutput":
        """The inverse of ``to_json`` (ValueError/KeyError/TypeError on a malformed document)."""
        rows = []
        for r in doc["rows"]:
            prompt = None
            if r.get("prompt") is not None:
                prompt = np.frombuffer(base64.b64decode(r["prompt"], validate=True), dtype="<i4").astype(np.int64)
                if prompt.shape[0] != int(r["prompt_len"]):
                    raise ValueError(f"{r['req_id']}: prompt of {prompt.shape[0]} tokens, prompt_len {r['prompt_len']}")
            rows.append(ScheduledRow(
                req_id=str(r["req_id"]), slot=int(r["slot"]), num_tokens=int(r["num_tokens"]),
                is_prefilling=bool(r["is_prefilling"]), prompt_start=int(r["prompt_start"]),
                prompt_len=int(r["prompt_len"]),
                new_blocks=tuple(int(b) for b in r["new_blocks"]), is_new=bool(r["is_new"]), prompt_token_ids=prompt))
        return cls(int(doc["step"]), tuple(rows), tuple((str(a), int(b)) for a, b in doc["finished"]))


class Scheduler:
    def __init__(self, prompts: list[list[int]], max_new_tokens: int, *, num_speculative_tokens: int,
                 block_size: int, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_id: int | None = None) -> None:
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.eos = eos_token_id
        self.requests = [SchedRequest(f"req{i}", list(p), max_new_tokens) for i, p in enumerate(prompts)]
        for r in self.requests:
            if len(r.prompt) + max_new_tokens + self.k > max_model_len:
                raise ValueError(
                    f"{r.req_id}: prompt of {len(r.prompt)} tokens + {max_new_tokens} new tokens "
                    f"(+{self.k} drafts) exceeds the model's context of {max_model_len}"
                )
            if not r.prompt:
                raise ValueError(f"{r.req_id}: empty prompt")
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.running: list[SchedRequest] = []
        self.waiting: list[SchedRequest] = list(self.requests)
        self.step = 0
        self._to_free: list[tuple[str, int]] = []

    @property
    def done(self) -> bool:
        return not self.running and not self.waiting

    def schedule(self) -> SchedulerOutput:
        budget = self.budget
        picked: list[tuple[SchedRequest, int, bool]] = []
        for req in self.running:
            n = (1 + self.k if req.has_drafts else 1) if not req.is_prefilling else \
                min(len(req.prompt) - req.num_computed, budget)
            if n <= 0 or n > budget:
                continue
            picked.append((req, n, False))
            budget -= n
        while self.waiting and self.free_slots and budget > 0:
            req = self.waiting.pop(0)
            req.slot = self.free_slots.pop()
            self.running.append(req)
            n = min(len(req.prompt), budget)
            picked.append((req, n, True))
            budget -= n
        rows = []
        for req, n, is_new in picked:
            # K lookahead slots: the replicated draft decodes write KV past the last token.
            need = self.allocator.blocks_needed(req.num_computed + n + self.k) - len(req.blocks)
            new_blocks = self.allocator.allocate(max(need, 0))
            req.blocks += new_blocks
            rows.append(ScheduledRow(
                req_id=req.req_id, slot=req.slot, num_tokens=n, is_prefilling=req.is_prefilling,
                prompt_start=req.num_computed if req.is_prefilling else 0,
                prompt_len=len(req.prompt), new_blocks=tuple(new_blocks), is_new=is_new,
                prompt_token_ids=req.prompt_ids if is_new else None,
            ))
        # vLLM's sort_batch_req_ids: requests with drafts, then decode-sized, then by length.
        dq = 1 + self.k
        rows.sort(key=lambda r: (not (not r.is_prefilling and r.num_tokens > 1), r.num_tokens != dq, r.num_tokens))
        out = SchedulerOutput(self.step, tuple(rows), tuple(self._to_free))
        self._to_free = []
        self.step += 1
        return out

    def update(self, sched: SchedulerOutput, results: dict[str, tuple[list[int], int]]) -> None:
        """Apply rank 0's verification: per request (sampled tokens, num_rejected)."""
        by_id = {r.req_id: r for r in self.running}
        for row in sched.rows:
            req = by_id[row.req_id]
            sampled, rejected = results[row.req_id]
            req.num_computed += row.num_tokens - rejected
            if req.is_prefilling:
                continue  # a partial prefill chunk samples nothing
            req.has_drafts = self.k > 0
            for tok in sampled:
                if len(req.output) >= req.max_new_tokens:
                    break
                req.output.append(int(tok))
                if self.eos is not None and tok == self.eos:
                    req.finished = True
                    break
            if len(req.output) >= req.max_new_tokens:
                req.finished = True
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            self.allocator.free(req.blocks)
            req.blocks = []
            self.free_slots.append(req.slot)
            self._to_free.append((req.req_id, req.slot))
