"""``pcpviz layout``: a batch's PCP layout (DualChunkSwap rows, the maps, the write mask), drawn
as text or printed as JSON.

    pcpviz layout --pcp 2 --batch p13,d1,d4
    pcpviz layout --pcp 2 --batch p13,d1 --json
"""

from __future__ import annotations

import argparse
import json

from pcpviz.cli.guard import EXIT_OK, UsageError, bounded_int
from pcpviz.limits import MAX_LAYOUT_ROWS, MAX_LAYOUT_SLOTS, MAX_LAYOUT_TOKENS, MAX_LAYOUT_WORLD

__all__ = ["add_layout"]


def _check_products(pcp: int, pad: int | None, rows: int, tokens: int) -> None:
    """UsageError naming the options when their product, not one of them, is too large: the
    gather map holds N*P slots (``--pcp 1024 --pad 65536``: 67,108,864) and each rank lists every
    row's segments, so each value within its own limit can still ask for gigabytes."""
    per_rank = max(pad or 0, -(-tokens // pcp) * 2)  # DualChunkSwap pads each rank to 2 chunks
    for what, value in ((f"--pcp {pcp} x --pad {pad}" if pad else f"--pcp {pcp} x --batch's {tokens} tokens",
                         pcp * per_rank), (f"--pcp {pcp} x --batch's {rows} rows", pcp * rows)):
        if value > MAX_LAYOUT_SLOTS:
            raise UsageError(f"pcpviz layout: {what} asks for {value:,} slots; the layout command "
                             f"holds at most {MAX_LAYOUT_SLOTS:,} (give a smaller --pcp, --pad or --batch)")


def _cmd_layout(args: argparse.Namespace) -> int:
    from pcpviz.reference.batchspec import DEFAULT_DECODE_CURSOR, parse_batch_spec, row_name
    from pcpviz.views.diagram import render_layout
    from pcpviz.reference.layout import plan_layout

    try:
        spec = parse_batch_spec(args.batch)
        if len(spec.kinds) > MAX_LAYOUT_ROWS or sum(spec.num_scheduled_tokens) > MAX_LAYOUT_TOKENS:
            raise ValueError(f"{len(spec.kinds)} rows, {sum(spec.num_scheduled_tokens)} tokens: the "
                             f"layout command draws at most {MAX_LAYOUT_ROWS} rows and "
                             f"{MAX_LAYOUT_TOKENS} tokens")
        _check_products(args.pcp, args.pad, len(spec.kinds), sum(spec.num_scheduled_tokens))
        shard = None if args.decodes == "auto" else args.decodes == "sharded"
        plan = lambda pad: plan_layout(  # noqa: E731
            spec.num_scheduled_tokens, spec.is_prefilling, args.pcp,
            shard_decode_requests=shard, dcp_world_size=args.dcp, padded_num_tokens=pad)
        layout = plan(None)
    except ValueError as e:
        batch = args.batch if len(args.batch) <= 60 else f"{args.batch[:40]}... ({len(args.batch)} characters)"
        raise UsageError(f"pcpviz layout: --batch {batch!r}: {e}") from None
    if args.pad is not None:  # a --pad too small for this batch is --pad's fault, not --batch's
        try:
            layout = plan(args.pad)
        except ValueError as e:
            raise UsageError(f"pcpviz layout: --pad {args.pad}: {e}") from None
    names = [row_name(i) for i in range(len(spec.kinds))]  # A, B, ...: 'd1' would read as a decode
    specs = [f"{k}{q}" + ("" if c == (0 if k == "p" else DEFAULT_DECODE_CURSOR) else f"@{c}")
             for k, q, c in zip(spec.kinds, spec.num_scheduled_tokens, spec.num_computed_tokens)]
    if args.json:
        doc = {
            "pcp": layout.pcp_world_size,
            "dcp": layout.dcp_world_size,
            "shard_decode_requests": layout.shard_decode_requests,
            "req_ids": names,
            "rows": specs,
            "segments_by_rank": [
                [dict(global_req_idx=s.global_req_idx, global_start=s.global_start,
                      global_stop=s.global_stop, local_start=s.local_start, local_stop=s.local_stop)
                 for s in segs]
                for segs in layout.segments_by_rank
            ],
            "per_rank_num_tokens": list(layout.per_rank_num_tokens),
            "padded_num_tokens": layout.padded_num_tokens,
            "padded_gather_idx": layout.padded_gather_idx.tolist(),
            "hidden_restore_idx": layout.hidden_restore_idx.tolist(),
            "kv_write_mask": layout.kv_write_mask.tolist(),
        }
        print(json.dumps(doc, indent=1))
    else:
        print(render_layout(layout, names, row_specs=specs))
    return EXIT_OK


def add_layout(sub) -> None:
    p = sub.add_parser("layout", help="draw the PCP layout of a batch",
                       description="How vLLM 0.33.0 splits one batch over PCP ranks (DualChunkSwap): "
                                   "each rank's rows, the all-gather and restore maps, the KV write "
                                   "mask. Requests are named A, B, ... in the order of --batch.")
    p.add_argument("--pcp", type=bounded_int(1, MAX_LAYOUT_WORLD), required=True, help="PCP world size N")
    p.add_argument("--batch", required=True,
                   help="rows like p13,p10@12,d4@20: p<tokens> a prefill (@ = tokens already computed), "
                        "d<tokens> a decode of 1 + drafts (@ = its position)")
    p.add_argument("--dcp", type=bounded_int(1, MAX_LAYOUT_WORLD), default=1, help="DCP world size")
    p.add_argument("--decodes", choices=["auto", "sharded", "replicated"], default="auto",
                   help="decode placement; auto = vLLM's default (sharded iff DCP == 1)")
    p.add_argument("--pad", type=bounded_int(1, MAX_LAYOUT_TOKENS), default=None,
                   help="CUDA-graph token count P per rank (default: the largest rank's tokens)")
    p.add_argument("--json", action="store_true", help="print the layout as JSON")
    p.set_defaults(func=_cmd_layout)
