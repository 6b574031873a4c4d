"""The training objective of the tiny model: main next-token loss plus the MTP layer's.

``loss = CE(main, t_{p+1}) + mtp_weight * CE(mtp, t_{p+2})``: the MTP layer at position p sees
the main model's final hidden h_p and the embedding of t_{p+1} (zeroed at position 0, as vLLM
does at inference). ``tools.train.train`` minimises it, ``tools.train.heldout`` reports it
on held-out text.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pcpviz.engine.model import TinyDSV3, causal_attention

__all__ = ["window_losses"]


def window_losses(model: TinyDSV3, windows: torch.Tensor, *, mtp_weight: float, positions=None):
    """windows [B, L+2] -> (total, main CE, MTP CE, main logits [B,L,V], mtp logits [B,L,V]).

    ``positions`` [B, L] (increasing along L) default to ``0..L-1`` in every window.
    """
    B, L2 = windows.shape
    L = L2 - 2
    ids = windows[:, :L].reshape(-1)
    if positions is None:
        pos = torch.arange(L, device=windows.device).repeat(B)
    else:
        pos = positions.reshape(-1).to(windows.device)
    qsl = [i * L for i in range(B + 1)]
    attn = causal_attention(model, query_start_loc=qsl)
    h = model.forward_hidden(ids, pos, attn)
    logits = model.logits(h)
    main = F.cross_entropy(logits.float(), windows[:, 1:L + 1].reshape(-1))
    mh = model.mtp_forward(windows[:, 1:L + 1].reshape(-1), pos, h, attn=attn)
    mlogits = model.mtp_logits(mh)
    mtp = F.cross_entropy(mlogits.float(), windows[:, 2:].reshape(-1))
    return main + mtp_weight * mtp, main, mtp, logits.view(B, L, -1), mlogits.view(B, L, -1)
