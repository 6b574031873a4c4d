"""Per-row fingerprints of the hidden states at every hand-off: which views carry them, and a
self-consistent set of them for synthetic traces.

Both producers compute each one on the device without a host sync (``row_fingerprints``: int64
per row, the row's float32 bits times fixed weights, summed; the engine in ``pcpviz.engine.record``,
the vLLM plugin at vLLM's own hand-offs, ``pcpviz.vllm.recording.fingerprints``); the checks
(``pcpviz.analysis.checks.handoff_checks``) prove data movement with them: restore, the draft
prefill reading the target's rows, each draft step reading what the one before handed on.

PCP=2 example (6 prefill tokens, rank 0 holding tokens 0, 1, 4, 5): ``target.hidden_fp`` is
``[a0 .. a5]``, rank 0's ``hidden_local_fp`` ``[a0 a1 a4 a5]`` and ``draft_0.hidden_in_fp`` the same.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FINGERPRINT_ROWS", "FINGERPRINT_SPEC", "row_fingerprints", "row_fingerprints_host",
           "row_fingerprints_host_at",
           "synthetic_fingerprints"]

_FP = "per-row fingerprint (pcpviz.trace.fingerprints.row_fingerprints)"
FINGERPRINT_ROWS: dict[str, list[tuple]] = {
    "target": [
        ("hidden_local_fp", "int64", "[P]", f"{_FP} of this rank's target hidden states before the restore"),
        ("hidden_fp", "int64", "[T]", f"{_FP} of the restored hidden states (global order, the same on every rank)"),
    ],
    "draft_0": [
        ("hidden_in_fp", "int64", "[P]", f"{_FP} of the hidden states the draft prefill read (the target's rows)"),
        ("mtp_local_fp", "int64", "[P]", f"{_FP} of the MTP layer's rank-local output"),
        ("hidden_last_fp", "int64", "[R]", f"{_FP} of the restored MTP output at draft_last_token_indices"),
        ("hidden_out_fp", "int64", "[R]", f"{_FP} of the hidden state handed to draft_1"),
    ],
    "draft_k": [
        ("hidden_in_fp", "int64", "[R]", f"{_FP} of the hidden state draft step k read", dict(align=("req", 0))),
        ("hidden_out_fp", "int64", "[R]", f"{_FP} of the hidden state draft step k hands on", dict(align=("req", 0))),
    ],
}
"""Phase class -> the schema rows (name, dtype, shape, meaning[, extra]) of its fingerprint views
(``pcpviz.trace.schema`` declares them with ``FINGERPRINT_SPEC``)."""
FINGERPRINT_SPEC = dict(scope="rank", run_specific="float reductions differ across PCP sizes")


_WEIGHTS: dict[tuple[str, int], object] = {}


def row_fingerprints(t):
    """int64[rows] fingerprints of a float tensor ``[rows, H]`` (torch, any device), computed
    where the tensor lives without a host sync: the sum over the row of its float32 bits (as
    int32) times fixed weights below 2**16 (no overflow for H < 2**16). Equal rows give equal
    fingerprints whatever buffer holds them, so a check proves a hand-off moved the right rows
    (``hidden_in_fp == hidden_local_fp``); bf16 rows are widened exactly first.

        >>> import torch
        >>> a = torch.arange(6.0).reshape(3, 2)
        >>> bool((row_fingerprints(a[[2, 0]]) == row_fingerprints(a)[[2, 0]]).all())
        True
    """
    import torch  # noqa: PLC0415 - the trace package itself does not need torch

    x = t if t.dtype == torch.float32 else t.float()
    h = x.shape[-1] if x.ndim else 1
    key = (x.device, h)
    w = _WEIGHTS.get(key)
    if w is None:
        w = _WEIGHTS[key] = torch.from_numpy(_host_weights(h)).to(x.device)
    # int32 bits times int64 weights multiply in int64 (type promotion): four calls, two kernels
    return (x.detach().reshape(-1, h).view(torch.int32) * w).sum(dim=-1)


_HOST_WEIGHTS: dict[int, np.ndarray] = {}


def _host_weights(h: int) -> np.ndarray:
    """int64[h]: the fixed weights of ``row_fingerprints`` (odd, below 2**16; the same everywhere)."""
    w = _HOST_WEIGHTS.get(h)
    if w is None:
        import torch  # noqa: PLC0415 - the trace package itself does not need torch

        g = torch.Generator().manual_seed(0x9C9F17)
        w = _HOST_WEIGHTS[h] = (torch.randint(1, 2**16, (h,), generator=g, dtype=torch.int64) | 1).numpy()
    return w


def row_fingerprints_host(x: np.ndarray) -> tuple[np.ndarray]:
    """``row_fingerprints`` of a host copy of the rows ``[rows, H]`` (any float dtype; bf16 rows
    arrive widened exactly to float32), computed off the step's path: ``(int64[rows],)``, equal
    to what the device computes from the same rows.

        >>> import torch
        >>> a = torch.randn(3, 5)
        >>> bool((row_fingerprints_host(a.numpy())[0] == row_fingerprints(a).numpy()).all())
        True
    """
    x = np.ascontiguousarray(x, dtype=np.float32)  # float32[rows, H]
    h = x.shape[-1] if x.ndim else 1
    bits = x.reshape(-1, h).view(np.int32).astype(np.int64)
    return ((bits * _host_weights(h)).sum(axis=-1),)


def row_fingerprints_host_at(x: np.ndarray, index: np.ndarray) -> tuple[np.ndarray]:
    """``row_fingerprints_host(x[index])``: rows picked on the host (``last_token_indices``)."""
    return row_fingerprints_host(np.asarray(x)[np.asarray(index, dtype=np.int64)])


def _vfp(tag: int, *xs: np.ndarray) -> np.ndarray:
    """int64 fingerprints of rows keyed by a few integer arrays (a vectorised multiply-xor mix)."""
    h = np.full(np.shape(xs[0]), 0x9E3779B97F4A7C15 ^ tag, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for x in xs:
            h = (h ^ np.asarray(x).astype(np.uint64)) * np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(29)
    return (h >> np.uint64(2)).astype(np.int64)


def synthetic_fingerprints(phases: dict, rank: int, layout, *, positions, input_ids, global_ids, last_idx,
                           n: int) -> None:
    """Add consistent fingerprint views to one rank's synthetic ``phases``: global token g's target
    hidden state is ``_vfp(1, position, id)``, its MTP output ``_vfp(3, hidden, draft id)``; padding
    rows get rank-specific values; each draft step hands on ``_vfp(5 + k, ...)`` of what it read."""
    pgi = layout.padded_gather_idx
    p = pgi.shape[0] // max(n, 1)
    hidden = _vfp(1, positions, input_ids)  # [T]
    rows = pgi[rank * p:(rank + 1) * p]
    real = np.arange(p) < layout.per_rank_num_tokens[rank]
    pad = _vfp(2, np.full(p, rank), np.arange(p))
    target = phases["target"]
    target["hidden_fp"] = hidden
    target["hidden_local_fp"] = np.where(real, hidden[rows], pad)
    if "draft_0" not in phases:
        return
    mtp = _vfp(3, hidden, global_ids)  # [T]
    d0 = phases["draft_0"]
    d0["hidden_in_fp"] = target["hidden_local_fp"]
    d0["mtp_local_fp"] = np.where(real, mtp[rows], _vfp(4, pad))
    d0["hidden_last_fp"] = mtp[last_idx]
    out = d0["hidden_out_fp"] = _vfp(5, d0["hidden_last_fp"])
    k = 1
    while f"draft_{k}" in phases:
        dk = phases[f"draft_{k}"]
        dk["hidden_in_fp"] = out
        out = dk["hidden_out_fp"] = _vfp(5 + k, out, dk["draft_tokens"])
        k += 1
