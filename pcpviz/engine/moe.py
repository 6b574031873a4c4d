"""DeepSeek-V3's MoE MLP (routed experts, sigmoid top-k routing, a shared expert), plain torch.

Re-derived from vLLM 0.33.0: ``DeepseekV2MoE`` (``model_executor/models/deepseek_v2.py:291-452``),
``grouped_topk`` (``model_executor/layers/fused_moe/router/grouped_topk_router.py:81-159``) and the
runner's PCP collectives (``fused_moe/runner/moe_runner.py:808-861``).

Routing of one token (``n_group`` = ``topk_group`` = 1, so the group step keeps every expert)::

    logits = x @ gate.weight.T                 # float32[E]  (router in float32)
    s      = sigmoid(logits)                   # the affinities
    ids    = topk(s + e_score_correction_bias, k)   # the bias only chooses (noaux_tc) ...
    w      = s[ids] / s[ids].sum() * routed_scaling_factor   # ... the weights use the raw scores
    y      = shared_expert(x) + sum_j w[j] * expert[ids[j]](x)

Worked example, 4 experts, top-2, scaling 2.5: ``s = [0.9, 0.2, 0.6, 0.5]`` and bias
``[-0.5, 0, 0, 0.2]`` give choice scores ``[0.4, 0.2, 0.6, 0.7]``, so ``ids = [3, 2]`` (expert 0,
the highest raw score, is passed over: its bias says it is overloaded) and
``w = [0.5, 0.6] / 1.1 * 2.5 = [1.136, 1.364]``.

The experts are computed densely (every expert on every row, then combined with weights that are
zero off the top-k): exact, since the unselected terms add 0.0, and one batched GEMM per
projection for training. ``shard=(lo, hi)`` computes only intermediate columns ``lo:hi`` of
every expert: the partial sums over the shards add up to the full output. That is how vLLM
runs MoE under PCP without expert parallelism: the PCP ranks are flattened into the MoE's
tensor-parallel group (``fused_moe/config.py:1106-1114``), each rank all-gathers the rows and
router logits, computes its shard over all rows and reduce-scatters (sums, then splits by rows).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pcpviz.engine.model_config import TinyDSV3Config

__all__ = ["MoE", "Gate", "Routing", "route"]


class Routing(NamedTuple):
    weights: torch.Tensor  # float32[T, k]  (routed_scaling_factor included)
    ids: torch.Tensor  # int64[T, k]


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, *, renormalize: bool = True,
          scaling: float = 1.0) -> Routing:
    """Top-k routing of float32[T, E] router logits, DeepSeek-V3 ``noaux_tc`` with one group.

    >>> r = route(torch.logit(torch.tensor([[0.9, 0.2, 0.6, 0.5]])), torch.tensor([-0.5, 0, 0, 0.2]), 2,
    ...           scaling=2.5)
    >>> r.ids.tolist(), [round(v, 3) for v in r.weights[0].tolist()]
    ([[3, 2]], [1.136, 1.364])
    """
    scores = logits.float().sigmoid()  # float32[T, E]
    # grouped_topk_router.py:121-126: the bias enters the choice only; with n_group = 1 the
    # group mask keeps every expert (lines 127-145 reduce to nothing)
    ids = torch.topk(scores + bias.float(), k=top_k, dim=-1).indices  # int64[T, k]
    w = scores.gather(1, ids)  # float32[T, k]
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)  # grouped_topk_router.py:153-154
    return Routing(w * scaling, ids)


class Gate(nn.Module):
    """``mlp.gate``: the router's weight [E, hidden] and its ``e_score_correction_bias`` float32[E]
    (a buffer: set by the load-balancing update, not by gradients; DeepSeek-V3 sec. 2.1.2)."""

    def __init__(self, cfg: TinyDSV3Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32[T, E] router logits (``moe_router_dtype: float32``, ``deepseek_v2.py:135-145``)."""
        return F.linear(x.float(), self.weight.float())


class Expert(nn.Module):
    """One SwiGLU expert (``gate_proj``, ``up_proj``, ``down_proj``) of width ``inter``."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """``mlp`` of a MoE layer: ``gate``, ``experts.{e}``, ``shared_experts``.

    ``last_load`` (set in training mode): float32[E], how many (token, slot) pairs each expert
    received in the last forward, for the bias update (``tools.train.objective``).
    """

    def __init__(self, cfg: TinyDSV3Config):
        super().__init__()
        self.cfg = cfg
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Gate(cfg)
        self.experts = nn.ModuleList(Expert(d, inter) for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(d, inter * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.last_load: Optional[torch.Tensor] = None

    def routing(self, logits: torch.Tensor) -> Routing:
        c = self.cfg
        return route(logits, self.gate.e_score_correction_bias, c.num_experts_per_tok,
                     renormalize=c.norm_topk_prob, scaling=c.routed_scaling_factor)

    def routed(self, x: torch.Tensor, logits: torch.Tensor, shard: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """The routed experts' weighted sum [T, hidden] of rows ``x`` [T, hidden] with router logits
        float32[T, E]; ``shard=(lo, hi)``: intermediate columns ``lo:hi`` only (a partial sum)."""
        r = self.routing(logits)
        if self.training:
            self.last_load = torch.bincount(r.ids.reshape(-1), minlength=len(self.experts)).float().detach()
        T, E = x.shape[0], len(self.experts)
        combine = torch.zeros(T, E, dtype=torch.float32, device=x.device).scatter(1, r.ids, r.weights)  # [T, E]
        lo, hi = shard or (0, self.cfg.moe_intermediate_size)
        g = torch.stack([e.gate_proj.weight[lo:hi] for e in self.experts])  # [E, I', d]
        u = torch.stack([e.up_proj.weight[lo:hi] for e in self.experts])  # [E, I', d]
        dn = torch.stack([e.down_proj.weight[:, lo:hi] for e in self.experts])  # [E, d, I']
        h = F.silu(torch.einsum("td,eid->tei", x, g)) * torch.einsum("td,eid->tei", x, u)  # [T, E, I']
        y = torch.einsum("tei,edi->ted", h, dn)  # [T, E, d]
        return torch.einsum("ted,te->td", y, combine.to(y.dtype))

    def forward(self, x: torch.Tensor, comm=None) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]. ``comm``: the PCP group (``all_gather``/``reduce_scatter``
        along dim 0, equal row counts on every rank); each rank then computes its
        ``1/world_size`` of the experts' intermediate columns over every rank's rows."""
        logits = self.gate(x)  # float32[T, E]
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if comm is None or comm.world_size == 1:
            routed = self.routed(x, logits)
        else:
            # moe_runner.py:824-829: all-gather rows and router logits over PCP (rank-major)
            xs, ls = comm.all_gather(x), comm.all_gather(logits)
            n, r = comm.world_size, comm.rank
            inter = self.cfg.moe_intermediate_size
            if inter % n:
                raise ValueError(f"moe_intermediate_size {inter} does not split over {n} PCP ranks")
            part = self.routed(xs, ls, shard=(r * inter // n, (r + 1) * inter // n))
            routed = comm.reduce_scatter(part)  # moe_runner.py:853-861: sum, this rank's rows
        # moe_runner.py:789-792: shared output + routed output
        return routed if shared is None else shared + routed
