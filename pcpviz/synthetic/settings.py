"""What a synthetic run is given: the requests (``RequestSpec``), the checked settings of a
``generate`` call (``Settings``) and the seeded oracle of true tokens and drafts.

No model runs: a request's true token at a position is its prompt's, then a seeded hash; draft
position j guesses it right with probability ``accept_prob[j]`` (a seeded coin per request,
position and draft step). PCP=2, K=2, seed 0: the same request and position always give the
same token and the same coin, so a run is reproducible and two runs of one seed equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from pcpviz.faults import SYNTHETIC, validate_faults

__all__ = ["RequestSpec", "Req", "Settings", "check_settings", "mix"]


_M64 = (1 << 64) - 1


def mix(*xs: int) -> int:
    """A 64-bit hash of a few ints (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h + (int(x) & _M64) + 0x9E3779B97F4A7C15) & _M64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
        h ^= h >> 31
    return h


@dataclass(frozen=True)
class RequestSpec:
    """One synthetic request: its prompt length, how many tokens to generate, and the
    first step at which the scheduler may admit it."""

    req_id: str
    prompt_len: int
    max_new_tokens: int
    arrival_step: int = 0


@dataclass
class Req:
    """A request's state during the simulation: its two cursors, last token, drafts and output."""

    spec: RequestSpec
    key: int
    prompt: np.ndarray  # int64[prompt_len]
    slot: int
    computed: int = 0  # GPU cursor
    lag: int = 0  # CPU cursor - GPU cursor (the last step's rejected drafts)
    last_token: int = -1
    drafts: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.spec.prompt_len


@dataclass(frozen=True)
class Settings:
    """``generate``'s arguments, checked: N (``pcp``), K, block size, DCP and the decode placement."""

    pcp: int
    k: int
    block_size: int
    dcp: int
    shard: bool
    probs: tuple[float, ...]  # acceptance probability per draft position, float[K]
    vocab_size: int
    seed: int
    max_num_batched_tokens: int
    max_num_reqs: int
    graph_pad: int | None
    timestamps: bool
    reverse_rows: bool
    faults: frozenset[str]  # specs as given: NAME or NAME@STEP
    dcp_interleave: int = 1  # cp_kv_cache_interleave_size

    @property
    def dcp_kw(self) -> dict:
        """The DCP-sharded slot-mapping arguments for DCP rank 0 (empty without DCP)."""
        return dict(cp_size=self.dcp, cp_rank=0, cp_interleave=self.dcp_interleave) if self.dcp > 1 else {}

    def token(self, req: Req, pos: int) -> int:
        """The true token at ``pos``: the prompt's, then a seeded hash."""
        if pos < req.spec.prompt_len:
            return int(req.prompt[pos])
        return mix(self.seed, req.key, pos, 1) % self.vocab_size

    def draft(self, req: Req, pos: int, j: int) -> int:
        """Draft position ``j``'s guess for ``pos``: the true token with probability ``probs[j]``."""
        true = self.token(req, pos)
        coin = (mix(self.seed, req.key, pos, j, 2) >> 11) / float(1 << 53)
        return true if coin < self.probs[j] else (true + 1 + j) % self.vocab_size


def check_settings(requests: Sequence[RequestSpec], *, pcp: int, num_speculative_tokens: int, block_size: int,
              dcp: int, shard_decode_requests: bool | None, accept_prob: float | Sequence[float],
              faults: Iterable[str], **rest) -> Settings:
    faults = validate_faults(faults, producer=SYNTHETIC)
    n, k, bs = int(pcp), int(num_speculative_tokens), int(block_size)
    if n < 1 or k < 0 or bs < 1 or dcp < 1:
        raise ValueError("pcp, block_size, dcp must be >= 1 and num_speculative_tokens >= 0")
    if bs % int(rest.get("dcp_interleave", 1)):
        raise ValueError(f"dcp_interleave={rest.get('dcp_interleave')} must divide block_size={bs}")
    shard = (n > 1 and dcp == 1) if shard_decode_requests is None else bool(shard_decode_requests)
    probs = [float(accept_prob)] * k if np.isscalar(accept_prob) else [float(p) for p in accept_prob]
    if len(probs) != k:
        raise ValueError(f"accept_prob needs {k} entries, got {len(probs)}")
    ids = [r.req_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    return Settings(pcp=n, k=k, block_size=bs, dcp=dcp, shard=shard, probs=tuple(probs), faults=faults, **rest)
