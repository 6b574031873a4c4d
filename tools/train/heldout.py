"""Held-out evaluation of the tiny model: windowed losses and agreement, and loss by position.

``evaluate`` scores consecutive non-overlapping windows of the held-out stream (main / MTP loss,
top-1 accuracy, how often the MTP layer's greedy token equals the main model's next one);
``evaluate_long`` scores long sequences bucket by position (how far past its training windows
a model holds up). ``tools.train.train`` writes both into ``training.json``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pcpviz.engine.model import TinyDSV3
from tools.train.objective import window_losses

__all__ = ["evaluate", "evaluate_long", "LONG_SHORT_BUCKET", "LONG_FAR_BUCKET"]


@torch.no_grad()
def evaluate(model: TinyDSV3, stream: torch.Tensor, seq_len: int, *, max_tokens: int, device,
             autocast) -> dict:
    """Held-out metrics over consecutive non-overlapping windows of the held-out stream."""
    model.eval()
    L2 = seq_len + 2
    n_win = max(1, min(max_tokens // seq_len, (stream.numel() - 2) // seq_len))
    tot = {"main": 0.0, "mtp": 0.0, "n": 0, "agree_main": 0, "agree_true": 0, "main_acc": 0, "n_agree": 0}
    bs = 8
    for s in range(0, n_win, bs):
        idx = [i * seq_len for i in range(s, min(n_win, s + bs)) if i * seq_len + L2 <= stream.numel()]
        if not idx:
            break
        w = torch.stack([stream[i:i + L2] for i in idx]).to(device)
        with autocast():
            _, main, mtp, lg, mlg = window_losses(model, w, mtp_weight=0.0)
        n = w.shape[0] * seq_len
        tot["main"] += main.item() * n
        tot["mtp"] += mtp.item() * n
        tot["n"] += n
        g_main = lg.argmax(-1)  # predicts t_{p+1}
        g_mtp = mlg.argmax(-1)  # predicts t_{p+2}
        tot["agree_main"] += (g_mtp[:, :-1] == g_main[:, 1:]).sum().item()
        tot["agree_true"] += (g_mtp == w[:, 2:]).sum().item()
        tot["main_acc"] += (g_main == w[:, 1:seq_len + 1]).sum().item()
        tot["n_agree"] += g_mtp[:, :-1].numel()
    model.train()
    n = max(1, tot["n"])
    return {
        "tokens": tot["n"],
        "main_loss": tot["main"] / n,
        "mtp_loss": tot["mtp"] / n,
        "main_top1_acc": tot["main_acc"] / n,
        "mtp_top1_acc": tot["agree_true"] / n,
        "mtp_agrees_with_main_greedy": tot["agree_main"] / max(1, tot["n_agree"]),
    }


LONG_SHORT_BUCKET = (0, 2048)  # "below 2k"
LONG_FAR_BUCKET = (8192, 32768)  # "8k-32k": the long-context target is far/short <= 1.10


@torch.no_grad()
def evaluate_long(model: TinyDSV3, stream: torch.Tensor, length: int, *, device, autocast,
                  num_seqs: int = 1) -> dict:
    """Main/MTP held-out loss by position bucket, averaged over ``num_seqs`` long sequences.

    Sequence i is the held-out stream's tokens ``[i*(length+2), (i+1)*(length+2))`` at positions
    ``0..length-1`` (several held-out modules concatenated, as a long prompt would be). Buckets
    double from 1024 (``0-1024``, ``1024-2048``, ``2048-4096``, ...). Averaging over several
    sequences keeps one easy or hard module from deciding a bucket. The summary compares
    ``LONG_FAR_BUCKET`` with ``LONG_SHORT_BUCKET``: e.g. ``{"below_2k": 1.31, "8k_32k": 1.38,
    "far_over_short": 1.05}`` for a 32768-token evaluation.
    """
    model.eval()
    length = min(length, stream.numel() - 2)
    num_seqs = max(1, min(num_seqs, stream.numel() // (length + 2)))
    main_sum = torch.zeros(length, dtype=torch.float64)
    mtp_sum = torch.zeros(length, dtype=torch.float64)
    for i in range(num_seqs):
        w = stream[i * (length + 2):(i + 1) * (length + 2)].unsqueeze(0).to(device)
        with autocast():
            _, _, _, lg, mlg = window_losses(model, w, mtp_weight=0.0)
        main_sum += F.cross_entropy(lg[0].float(), w[0, 1:length + 1], reduction="none").double().cpu()
        mtp_sum += F.cross_entropy(mlg[0].float(), w[0, 2:], reduction="none").double().cpu()
        del lg, mlg
    main, mtp = main_sum / num_seqs, mtp_sum / num_seqs
    out: dict = {"sequences": num_seqs, "length": length, "buckets": {}}
    a, b = 0, 1024
    while a < length:
        hi = min(b, length)
        out["buckets"][f"{a}-{hi}"] = {"main": round(main[a:hi].mean().item(), 4),
                                       "mtp": round(mtp[a:hi].mean().item(), 4)}
        a, b = hi, b * 2
    lo, hi = LONG_SHORT_BUCKET
    short = main[lo:min(hi, length)].mean().item()
    summary = {"below_2k": round(short, 4)}
    flo, fhi = LONG_FAR_BUCKET
    if length > flo:
        far = main[flo:min(fhi, length)].mean().item()
        summary.update({"8k_32k": round(far, 4), "far_over_short": round(far / short, 4)})
    out["summary"] = summary
    model.train()
    return out
