"""The schema versions this pcpviz reads, and how a record of an older one reads today.

A trace is judged by the rules of the version that wrote it (``Trace.version``, from run.json;
every rank file must carry the same). Bump ``schema.SCHEMA_VERSION`` for any change an older
reader would misread, add the version here with what it changed, and teach ``upgrade_views``
how the older version's records read in the new meaning: the one place that knows.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["SCHEMA_VERSIONS", "upgrade_views"]

SCHEMA_VERSIONS: dict[int, str] = {
    1: "the first format; verify sampled_token_ids past num_sampled hold whatever vLLM's buffer "
       "held (the plugin did not mask them yet)",
    2: "verify sampled_token_ids hold -1 past num_sampled, from every producer",
}
"""Every version this pcpviz reads, with what it changed. A trace is read by the rules of the
version that wrote it: ``upgrade_views`` turns an older version's records into the current
meaning (the one place that knows the differences)."""


def upgrade_views(version: int, phase: str, views: Mapping[str, Any]) -> Mapping[str, Any]:
    """The views of one record of a ``version`` trace, in the current version's meaning.

    Version 1 left ``sampled_token_ids`` past ``num_sampled`` unspecified (a PCP=2 vLLM trace
    showed a rejected draft there); version 2 holds -1. A version 1 verify record
    ``sampled_token_ids [[5, 9, 7]]`` with ``num_sampled [1]`` reads as ``[[5, -1, -1]]``.
    A malformed record is returned as is (the checks report it)."""
    if version >= 2 or phase != "verify" or "sampled_token_ids" not in views \
            or "num_sampled" not in views:
        return views
    sampled, ns = np.asarray(views["sampled_token_ids"]), np.asarray(views["num_sampled"])
    if (sampled.ndim != 2 or ns.shape != sampled.shape[:1] or sampled.dtype.kind not in "iu"
            or ns.dtype.kind not in "iu"):
        return views
    masked = np.where(np.arange(sampled.shape[1])[None, :] < ns[:, None], sampled, -1).astype(sampled.dtype)
    masked.flags.writeable = False
    return {**views, "sampled_token_ids": masked}
