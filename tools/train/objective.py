"""The training objective of the tiny model: main next-token loss plus the MTP layer's.

``loss = CE(main, t_{p+1}) + mtp_weight * CE(mtp, t_{p+2})``: the MTP layer at position p sees
the main model's final hidden h_p and the embedding of t_{p+1} (zeroed at position 0, as vLLM
does at inference). ``tools.train.train`` minimises it, ``tools.train.heldout`` reports it
on held-out text.

The MoE + DSA model (``TinyDSV32``) adds its indexer loss ``L_I`` (``tools.train.objective_v32``:
the KL to the main attention, dense or sparse stage by ``dsa_sparse``): ``loss += L_I``, which
trains the indexer's weights only; ``stats["indexer_kl"]`` reports it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pcpviz.engine.model import TinyDSV3, causal_attention
from pcpviz.engine.model_v32 import TinyDSV32
from tools.train.objective_v32 import DSATrainAttention

__all__ = ["window_losses"]


def window_losses(model: TinyDSV3, windows: torch.Tensor, *, mtp_weight: float, positions=None,
                  dsa_sparse: bool = True, stats: dict | None = None):
    """windows [B, L+2] -> (total, main CE, MTP CE, main logits [B,L,V], mtp logits [B,L,V]).

    ``positions`` [B, L] (increasing along L) default to ``0..L-1`` in every window.
    ``dsa_sparse``: the DSA model attends to its indexer's top-k (False: the dense warm-up).
    """
    B, L2 = windows.shape
    L = L2 - 2
    ids = windows[:, :L].reshape(-1)
    if positions is None:
        pos = torch.arange(L, device=windows.device).repeat(B)
    else:
        pos = positions.reshape(-1).to(windows.device)
    qsl = [i * L for i in range(B + 1)]
    dsa = DSATrainAttention(model, B, L, sparse=dsa_sparse) if isinstance(model, TinyDSV32) else None
    attn = dsa or causal_attention(model, query_start_loc=qsl)
    h = model.forward_hidden(ids, pos, attn)
    logits = model.logits(h)
    main = F.cross_entropy(logits.float(), windows[:, 1:L + 1].reshape(-1))
    mh = model.mtp_forward(windows[:, 1:L + 1].reshape(-1), pos, h, attn=attn)
    mlogits = model.mtp_logits(mh)
    mtp = F.cross_entropy(mlogits.float(), windows[:, 2:].reshape(-1))
    total = main + mtp_weight * mtp
    if dsa is not None:
        kl = dsa.indexer_loss()
        total = total + kl
        if stats is not None:
            stats["indexer_kl"] = kl.detach()
    return total, main, mtp, logits.view(B, L, -1), mlogits.view(B, L, -1)
