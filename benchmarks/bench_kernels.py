"""Kernel benchmark: pcpviz_kernels against their torch references, the HBM copy bandwidth and
the bf16 tensor-core peak.

    python benchmarks/bench_kernels.py --out data/bench/kernels_h200.json     # one GPU, ~3 min
    python benchmarks/bench_kernels.py --quick                                  # fewer configs
    python benchmarks/bench_kernels.py --smoke                                  # CPU dry run (interpreter)

Every figure comes from this one invocation:
* ``copy_bandwidth_GBps``: a large device-to-device ``torch`` copy, counted as bytes read +
  bytes written over time (the ceiling the decode kernels are measured against);
* paged MLA decode (memory-bound): median time (``torch.cuda.Event``, warm-up first), the torch
  reference's time, bytes it must touch at least / time, as a fraction of the copy bandwidth.
  Headline: batch 16 x 32k context, 16 heads, **bf16** latent cache (target >= 70%), swept over
  launch configs then KV split counts; the fp32 cache at tf32x3 / tf32 / ieee precision too;
* MLA prefill (compute-bound): the flash kernel on the engine's model shape (4 heads, Dn 128,
  Dr 64, Dv 128) for a 32k-token prompt at PCP=1 and the PCP=2 rank-local half (DualChunkSwap:
  rank 0's head and tail chunks), in TFLOP/s (visible causal pairs only) and as a fraction of the
  ~990 TFLOP/s dense bf16 peak of the H200; torch SDPA on the same PCP=1 problem for scale;
  then the engine's whole prefill attention path per layer (latent gather, up-projection,
  kernel: ``kv_cache.paged_mla_attention_kernels``), and the absorbed-vs-expanded crossover that
  sets ``decode_max_query_len``;
* the small kernels (KV write, block-table gather, slot mappings, hidden restore).
Each case is caught on its own: a failing one is recorded under ``errors`` and printed, the others
still run. ``--budget-s`` bounds the whole run (configs left when it is spent are recorded as
skipped). The JSON is rewritten after each case, and a compact summary is printed at the end.

Runs on torch 2.11-2.14 and triton 3.6-3.9 without installing the package: ``kernels/`` and the
repository root are put on ``sys.path`` here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "kernels"), ROOT]
SMOKE = "--smoke" in sys.argv  # CPU dry run of this script: interpreted kernels, tiny sizes
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import pcpviz_kernels as K  # noqa: E402
from pcpviz_kernels import paged_mla  # noqa: E402
from pcpviz_kernels.mla_prefill import prefill_flops  # noqa: E402

R, DR = 512, 64  # latent rank and rope width (DeepSeek-V3 and the shipped model)
DN, DV, MODEL_HEADS = 128, 128, 4  # the shipped model's per-head sizes
BF16_PEAK_TFLOPS = 989.4  # H200 dense bf16 tensor-core peak (SXM)
DEADLINE = [float("inf")]


def left_s() -> float:
    return DEADLINE[0] - time.perf_counter()


class OutOfTime(Exception):
    pass


def cuda_time(fn, warmup=2, iters=15, max_s=2.0) -> float:
    """Median seconds of ``fn()`` by CUDA events (each iteration timed on its own)."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return max(time.perf_counter() - t, 1e-9)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    t_end = time.perf_counter() + max_s
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
        if time.perf_counter() > t_end and len(times) >= 3:
            break
    return statistics.median(times)


class Report:
    def __init__(self, path: str) -> None:
        self.path = path
        self.data: dict = {"kernels": {}, "sweeps": {}, "errors": {}, "skipped": []}

    def save(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1, sort_keys=False)

    def row(self, name, t_kernel, *, t_ref=None, nbytes=None, copy_bw=None, flops=None, **extra):
        row = {"time_us": round(t_kernel * 1e6, 2),
               "ref_time_us": None if t_ref is None else round(t_ref * 1e6, 2),
               "speedup_vs_ref": None if t_ref is None else round(t_ref / t_kernel, 2)}
        msg = f"{name:44s} {t_kernel * 1e6:10.1f} us"
        if nbytes is not None:
            bw = nbytes / t_kernel / 1e9
            row.update(bytes=int(nbytes), bandwidth_GBps=round(bw, 1), fraction_of_copy_bw=round(bw / copy_bw, 3))
            msg += f"  {bw:7.0f} GB/s {bw / copy_bw:6.1%} of copy"
        if flops is not None:
            tf = flops / t_kernel / 1e12
            row.update(flops=int(flops), TFLOPS=round(tf, 1), fraction_of_bf16_peak=round(tf / BF16_PEAK_TFLOPS, 3))
            msg += f"  {tf:7.1f} TFLOP/s {tf / BF16_PEAK_TFLOPS:6.1%} of bf16 peak"
        if t_ref is not None:
            msg += f"  (ref {t_ref * 1e6:.1f} us, x{t_ref / t_kernel:.2f})"
        row.update(extra)
        self.data["kernels"][name] = row
        self.save()
        print(msg, flush=True)
        return row


def run_case(rep, label, fn, need_s=5.0):
    if left_s() < need_s:
        rep.data["skipped"].append(label)
        rep.save()
        print(f"{label}: skipped (time budget)", flush=True)
        return
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - keep measuring the other kernels
        rep.data["errors"][label] = f"{type(e).__name__}: {str(e)[:500]}"
        rep.save()
        print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        traceback.print_exc(limit=4)
    rep.data.setdefault("case_wall_s", {})[label] = round(time.perf_counter() - t0, 1)


def sweep(rep, label, points, measure):
    """``measure(point)`` -> (seconds, extra dict) for each point; errors and the budget recorded."""
    out, best = [], None
    for key, point in points:
        if left_s() < 3:
            out.append({"config": key, "skipped": "time budget"})
            continue
        try:
            t, extra = measure(point)
        except Exception as e:  # noqa: BLE001 - a config the GPU cannot hold, a compile error
            out.append({"config": key, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        out.append({"config": key, "point": point, "time_us": round(t * 1e6, 2), **extra})
        if best is None or t < best[0]:
            best = (t, key, point, extra)
    rep.data["sweeps"][label] = out
    rep.save()
    if best is None:
        raise RuntimeError(f"{label}: no config ran ({out[0] if out else 'none given'})")
    return best


# ------------------------------------------------------------------------------ cases
def copy_bandwidth(dev) -> float:
    n = 1 << 28 if not SMOKE else 1 << 20  # 1 GiB of fp32
    src = torch.empty(n, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), warmup=3, iters=20)
    src = dst = None  # free the 2 GiB before the next case
    return 2 * n * 4 / t / 1e9


def paged_case(dev, rows, ctx, block_size, dtype, seed=0):
    """A block table of ``rows`` x ``ctx`` tokens (distinct blocks, block 0 = null) and a cache."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    width = -(-ctx // block_size)
    num_blocks = rows * width + 1
    perm = torch.randperm(num_blocks - 1, generator=g)[: rows * width] + 1
    bt = perm.view(rows, width).to(torch.int32).to(dev)
    cache = torch.randn(num_blocks * block_size, R + DR, device=dev).to(dtype)
    return bt, cache


def bench_decode(rep, dev, copy_bw, *, batch, ctx, heads, block_size, dtype, precisions, configs, splits_list,
                 label, ref=True):
    """Paged MLA decode: configs x precisions at the default split count, then splits for the best."""
    bt, cache = paged_case(dev, batch, ctx, block_size, dtype)
    q_lat = torch.randn(batch, heads, R, device=dev)
    q_pe = torch.randn(batch, heads, DR, device=dev)
    qsl = torch.arange(batch + 1, device=dev)
    seq = torch.full((batch,), ctx, device=dev, dtype=torch.int64)
    args = (q_lat, q_pe, cache, bt, qsl, seq - 1, seq, block_size, 1.0 / (R + DR) ** 0.5)
    nbytes = paged_mla.bytes_touched(batch, heads, R, DR, batch * ctx, cache.element_size()) + bt.numel() * 4
    want = K.paged_mla_attention_ref(*args) if ref else None
    t_ref = cuda_time(lambda: K.paged_mla_attention_ref(*args), warmup=1, iters=3) if ref else None

    def measure(point):
        prec, cfg, splits = point
        fn = lambda: K.paged_mla_attention(*args, max_query_len=1, max_seq_len=ctx, num_splits=splits,  # noqa: E731
                                           input_precision=prec, config=cfg)
        err = None if want is None else float((fn() - want).abs().max())
        t = cuda_time(fn)
        return t, {"fraction_of_copy_bw": round(nbytes / t / 1e9 / copy_bw, 3), "max_abs_err": err}

    name = lambda p, c, s: (f"{p} N{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']} "  # noqa: E731
                            f"reload={int(c.get('RELOAD', True))} splits={s}")
    pts = [(name(p, c, None), (p, c, None)) for p in precisions for c in configs]
    t, key, (prec, cfg, _), extra = sweep(rep, label + "_configs", pts, measure)
    if len(splits_list) > 1:
        pts = [(name(prec, cfg, s), (prec, cfg, s)) for s in splits_list]
        t, key, (prec, cfg, splits), extra = sweep(rep, label + "_splits", pts, measure)
    else:
        splits = splits_list[0]
    used = paged_mla.plan(heads, batch, 1, ctx, dev, splits)[4]
    return rep.row(label, t, t_ref=t_ref, nbytes=nbytes, copy_bw=copy_bw, best_config=key,
                   config=dict(cfg, precision=prec, num_splits=splits), splits_used=used,
                   max_abs_err_vs_ref=extra["max_abs_err"], batch=batch, context=ctx, heads=heads,
                   block_size=block_size, cache_dtype=str(dtype))


def prefill_rows(total, pcp, rank):
    """(positions range, context length) of each row a rank holds for a fresh ``total``-token prompt:
    PCP=1 one row; PCP>1 DualChunkSwap: chunks ``rank`` and ``2*pcp - 1 - rank`` of ``2*pcp``."""
    if pcp == 1:
        return [(range(0, total), total)]
    c = total // (2 * pcp)
    return [(range(i * c, (i + 1) * c), (i + 1) * c) for i in (rank, 2 * pcp - 1 - rank)]


def flat_prefill_case(dev, rows, dtype, seed=0):
    """Kernel arguments of ``rows`` with flat K/V, longest context first (as the engine orders them)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    qlens = [len(p) for p, _ in rows]
    qsl = torch.tensor([0] + list(np.cumsum(qlens)), device=dev)
    pos = torch.cat([torch.arange(p.start, p.stop) for p, _ in rows]).to(dev)
    order = sorted(range(len(rows)), key=lambda i: -rows[i][1])
    lens = [rows[i][1] for i in order]
    starts = [0] + list(np.cumsum(lens)[:-1])
    nq, nk = int(sum(qlens)), int(sum(lens))
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(dev)  # noqa: E731
    kv = rnd(nk, MODEL_HEADS, DN + DV)  # k_nope and v as strided views, as the engine's up-projection gives
    return dict(q_nope=rnd(nq, MODEL_HEADS, DN), q_pe=rnd(nq, MODEL_HEADS, DR), k_nope=kv[..., :DN],
                k_pe=rnd(nk, DR), v=kv[..., DN:], query_start_loc=qsl, positions=pos,
                kv_start_loc=torch.tensor(starts, device=dev), kv_lens=torch.tensor(lens, device=dev),
                scale=1.0 / (DN + DR) ** 0.5, rows=torch.tensor(order, device=dev)), max(qlens)


def check_rows(case, got, tail=256):
    """Max |kernel - reference| over the last ``tail`` queries of each row (the most keys)."""
    qsl = case["query_start_loc"].tolist()
    idx = torch.cat([torch.arange(max(a, b - tail), b) for a, b in zip(qsl[:-1], qsl[1:])])
    sub_qsl, n = [0], 0
    for a, b in zip(qsl[:-1], qsl[1:]):
        n += b - max(a, b - tail)
        sub_qsl.append(n)
    dev = got.device
    sub = dict(case, q_nope=case["q_nope"][idx.to(dev)], q_pe=case["q_pe"][idx.to(dev)],
               positions=case["positions"][idx.to(dev)], query_start_loc=torch.tensor(sub_qsl, device=dev))
    want = K.mla_prefill_attention_ref(**sub)
    return float((got[idx.to(dev)] - want).abs().max())


def bench_prefill(rep, dev, *, total, pcp, dtype, precision, configs, label, sdpa=False):
    rows = prefill_rows(total, pcp, 0)
    case, max_q = flat_prefill_case(dev, rows, dtype)
    flops = prefill_flops([p for p, _ in rows], [n for _, n in rows], MODEL_HEADS, DN, DR, DV)
    out = torch.zeros(case["q_nope"].shape[0], MODEL_HEADS, DV, device=dev)

    def measure(cfg):
        fn = lambda: K.mla_prefill_attention(**case, out=out, max_query_len=max_q,  # noqa: E731
                                             input_precision=precision, config=cfg)
        fn()
        t = cuda_time(fn, warmup=1, iters=7)
        return t, {"TFLOPS": round(flops / t / 1e12, 1)}

    key = lambda c: f"M{c['BLOCK_M']} N{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}"  # noqa: E731
    t, best_key, cfg, _ = sweep(rep, label + "_configs", [(key(c), c) for c in configs], measure)
    K.mla_prefill_attention(**case, out=out, max_query_len=max_q, input_precision=precision, config=cfg)
    err = check_rows(case, out)
    t_ref = None
    if sdpa and pcp == 1 and not SMOKE:
        t_ref = sdpa_time(case, total)
    return rep.row(label, t, t_ref=t_ref, flops=flops, best_config=best_key, config=cfg,
                   max_abs_err_vs_ref=err, query_tokens=int(case["q_nope"].shape[0]), context=total, pcp=pcp,
                   heads=MODEL_HEADS, dtype=str(dtype), precision=None if dtype != torch.float32 else precision,
                   ref="torch SDPA (causal, same problem)" if t_ref else None)


def sdpa_time(case, total):
    import torch.nn.functional as F

    h = MODEL_HEADS
    q = torch.cat([case["q_nope"], case["q_pe"]], -1).transpose(0, 1)[None]  # [1, H, T, 192]
    k = torch.cat([case["k_nope"], case["k_pe"][:, None].expand(total, h, DR)], -1).transpose(0, 1)[None]
    v = case["v"].transpose(0, 1)[None].contiguous()
    try:
        return cuda_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), warmup=1, iters=5)
    except RuntimeError:  # a backend wanting one head size: pad V (as FA-based MLA prefill does)
        v = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
        return cuda_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), warmup=1, iters=5)


def engine_inputs(dev, rows, dtype, block_size=16, seed=1):
    """The engine's attention inputs for ``rows`` (positions, context) of one request."""
    ctx = max(n for _, n in rows)
    bt, cache = paged_case(dev, 1, ctx, block_size, dtype, seed)
    g = torch.Generator(device="cpu").manual_seed(seed)
    qlens = [len(p) for p, _ in rows]
    nq = sum(qlens)
    rnd = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(dtype).to(dev)  # noqa: E731
    qsl_h = np.array([0] + list(np.cumsum(qlens)), np.int64)
    seq_h = np.array([n for _, n in rows], np.int64)
    pos = torch.cat([torch.arange(p.start, p.stop) for p, _ in rows]).to(dev)
    return dict(q_nope=rnd(nq, MODEL_HEADS, DN), q_pe=rnd(nq, MODEL_HEADS, DR), cache=cache,
                block_rows=bt.repeat(len(rows), 1), query_start_loc=torch.from_numpy(qsl_h).to(dev), positions=pos,
                seq_lens=torch.from_numpy(seq_h).to(dev), w_uk=rnd(MODEL_HEADS, DN, R, sc=R ** -0.5),
                w_uv=rnd(MODEL_HEADS, DV, R, sc=R ** -0.5), block_size=block_size, scale=1.0 / (DN + DR) ** 0.5,
                max_query_len=max(qlens), max_seq_len=ctx, host_lens=(qsl_h, seq_h))


def bench_engine_prefill(rep, dev, *, total, pcp, dtype, label):
    """The engine's prefill attention per layer: gather + up-projection + flash kernel."""
    from pcpviz.engine import kv_cache

    rows = prefill_rows(total, pcp, 0)
    kw = engine_inputs(dev, rows, dtype)
    flops = prefill_flops([p for p, _ in rows], [n for _, n in rows], MODEL_HEADS, DN, DR, DV)
    fn = lambda: kv_cache.paged_mla_attention_kernels(**kw, kernels=K, decode_max=16)  # noqa: E731
    fn()
    t = cuda_time(fn, warmup=1, iters=7)
    return rep.row(label, t, flops=flops, context=total, pcp=pcp, dtype=str(dtype),
                   note="per layer; TFLOP/s counts the attention only (gather and up-projection are the rest)")


def bench_crossover(rep, dev, *, ctx, q_lens, dtype, label):
    """Rows of q queries at the end of a ``ctx`` context: absorbed kernel vs gather + expanded kernel."""
    from pcpviz.engine import kv_cache

    res = []
    for q in q_lens:
        if left_s() < 5:
            res.append({"q_len": q, "skipped": "time budget"})
            continue
        rows = [(range(ctx - q, ctx), ctx)] * 4
        kw = engine_inputs(dev, rows, dtype, seed=q)
        t = {}
        for name, dm in (("absorbed", 1 << 30), ("expanded", 0)):
            fn = lambda dm=dm: kv_cache.paged_mla_attention_kernels(**kw, kernels=K, decode_max=dm)  # noqa: E731
            fn()
            t[name] = cuda_time(fn, warmup=1, iters=7)
        res.append({"q_len": q, "absorbed_us": round(t["absorbed"] * 1e6, 1),
                    "expanded_us": round(t["expanded"] * 1e6, 1)})
        print(f"  crossover q={q:4d}: absorbed {t['absorbed'] * 1e6:8.1f} us, expanded {t['expanded'] * 1e6:8.1f} us",
              flush=True)
    faster = [r["q_len"] for r in res if "expanded_us" in r and r["expanded_us"] < r["absorbed_us"]]
    rep.data["crossover"] = {"label": label, "context": ctx, "rows": 4, "dtype": str(dtype), "points": res,
                             "expanded_faster_from_q_len": min(faster) if faster else None}
    rep.save()


def bench_small(rep, dev, copy_bw, big):
    def kv_write():
        m, width, num_slots = (65536, R + DR, 1 << 20) if big else (64, R + DR, 256)
        cache = torch.zeros(num_slots, width, device=dev)
        slots = torch.randperm(num_slots, device=dev)[:m]
        slots[torch.rand(m, device=dev) < 0.1] = -1
        lat = torch.randn(m, width, device=dev)
        written = int((slots >= 0).sum())
        t = cuda_time(lambda: K.write_kv_cache(cache, slots, lat))
        t_ref = cuda_time(lambda: K.write_kv_cache_ref(cache, slots, lat))
        ref = torch.zeros_like(cache)
        K.write_kv_cache_ref(ref, slots, lat)
        K.write_kv_cache(cache.zero_(), slots, lat)
        assert torch.equal(cache, ref)
        rep.row("kv_write_fp32_M65536", t, t_ref=t_ref, nbytes=2 * written * width * 4 + m * 8, copy_bw=copy_bw)

    def block_table():
        rows, width = (1024, 2048) if big else (64, 100)
        table = torch.randint(1, 1 << 20, (rows, width), device=dev, dtype=torch.int32)
        idx = torch.randperm(rows, device=dev)[:256 if big else 16]
        nb = torch.randint(0, width + 1, (rows,), device=dev, dtype=torch.int32)
        t = cuda_time(lambda: K.gather_block_table_rows(table, idx, 512, nb))
        t_ref = cuda_time(lambda: K.gather_block_table_rows_ref(table, idx, 512, nb))
        assert torch.equal(K.gather_block_table_rows(table, idx, 512, nb),
                           K.gather_block_table_rows_ref(table, idx, 512, nb))
        rep.row("gather_block_table_rows_256of1024x2048", t, t_ref=t_ref, nbytes=(256 + 512) * 2048 * 4,
                copy_bw=copy_bw)

    def slot_mapping():
        bs, num_reqs, tokens = (16, 64, 32768) if big else (16, 4, 128)
        table = torch.randint(1, 1 << 20, (1024, 4096), device=dev, dtype=torch.int32)
        idx = torch.randperm(1024, device=dev)[:num_reqs]
        lens = torch.full((num_reqs,), tokens // num_reqs, device=dev)
        qsl = torch.cat([torch.zeros(1, device=dev, dtype=torch.int64), lens.cumsum(0)])
        pos = torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(range(0, num_reqs * 900, 900),
                                                                               lens.tolist())])
        fn = lambda: K.compute_slot_mapping(table, bs, idx, qsl, pos, tokens + 64)  # noqa: E731
        ref = lambda: K.compute_slot_mapping_ref(table, bs, idx, qsl, pos, tokens + 64)  # noqa: E731
        assert torch.equal(fn(), ref())
        rep.row("compute_slot_mapping_T32768_R64", cuda_time(fn), t_ref=cuda_time(ref), nbytes=tokens * 20,
                copy_bw=copy_bw)
        n = 65536 if big else 256
        glob = torch.randint(0, 1 << 24, (tokens,), device=dev)
        gidx = torch.randint(0, tokens, (n,), device=dev)
        mask = torch.rand(n, device=dev) < 0.95
        fn = lambda: K.gathered_slot_mapping(glob, gidx, mask)  # noqa: E731
        ref = lambda: K.gathered_slot_mapping_ref(glob, gidx, mask)  # noqa: E731
        assert torch.equal(fn(), ref())
        rep.row("gathered_slot_mapping_NP65536", cuda_time(fn), t_ref=cuda_time(ref), nbytes=n * 25,
                copy_bw=copy_bw)

    def restore():
        n_p, hidden, t = (2 * 16384, 7168, 32000) if big else (64, 96, 50)
        gathered = torch.randn(n_p, hidden, device=dev, dtype=torch.bfloat16)
        idx = torch.randperm(n_p, device=dev)[:t]
        fn = lambda: K.restore_hidden(gathered, idx)  # noqa: E731
        ref = lambda: K.restore_hidden_ref(gathered, idx)  # noqa: E731
        assert torch.equal(fn(), ref())
        rep.row("restore_hidden_bf16_T32000_H7168", cuda_time(fn), t_ref=cuda_time(ref), nbytes=2 * t * hidden * 2,
                copy_bw=copy_bw)

    for name, fn in (("kv_write", kv_write), ("block_table", block_table), ("slot_mapping", slot_mapping),
                     ("restore", restore)):
        run_case(rep, name, fn, need_s=3)


def summary(rep) -> None:
    k = rep.data["kernels"]
    print("\n== summary ==")
    for name, row in k.items():
        if name.startswith(("paged_mla_decode", "mla_prefill", "engine_prefill")):
            figs = [f"{row['time_us'] / 1e3:8.3f} ms"]
            if "fraction_of_copy_bw" in row:
                figs.append(f"{row['fraction_of_copy_bw']:6.1%} of copy bw")
            if "TFLOPS" in row:
                figs.append(f"{row['TFLOPS']:6.1f} TFLOP/s ({row['fraction_of_bf16_peak']:.1%} of bf16 peak)")
            if row.get("max_abs_err_vs_ref") is not None:
                figs.append(f"err {row['max_abs_err_vs_ref']:.1e}")
            print(f"{name:44s} " + "  ".join(figs))
    for key, val in rep.data.get("targets", {}).items():
        print(f"{key}: {val}")
    if "crossover" in rep.data:
        print(f"crossover: expanded (prefill) kernel faster from q_len "
              f"{rep.data['crossover']['expanded_faster_from_q_len']} at context {rep.data['crossover']['context']}")
    for label, err in rep.data["errors"].items():
        print(f"ERROR {label}: {err[:160]}")
    if rep.data["skipped"]:
        print(f"skipped (time budget): {', '.join(rep.data['skipped'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "data", "bench", "kernels_h200.json"))
    ap.add_argument("--quick", action="store_true", help="a smaller config sweep")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16, help="decode heads per GPU (DeepSeek-V3 128 heads / TP 8)")
    ap.add_argument("--prefill-tokens", type=int, default=32768)
    ap.add_argument("--budget-s", type=float, default=170.0, help="stop starting new configs after this long")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: interpreted kernels, tiny sizes")
    args = ap.parse_args()
    if SMOKE:
        dev = torch.device("cpu")
        args.context, args.batch, args.prefill_tokens, args.quick = 80, 2, 64, True
        if args.out == ap.get_default("out"):
            args.out = os.path.join("/tmp", "bench_kernels_smoke.json")
    elif not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (or --smoke for a CPU dry run)")
    else:
        dev = torch.device("cuda")
    big = not SMOKE
    import triton

    t0 = time.perf_counter()
    DEADLINE[0] = t0 + args.budget_s
    rep = Report(args.out)
    rep.data["meta"] = {
        "command": "python benchmarks/bench_kernels.py " + " ".join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(0) if big else "cpu (smoke)",
        "sms": torch.cuda.get_device_properties(0).multi_processor_count if big else 0,
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "timing": "torch.cuda.Event per iteration, warm-up first, median",
        "bf16_peak_TFLOPS": BF16_PEAK_TFLOPS,
    }
    copy_bw = copy_bandwidth(dev)
    rep.data["copy_bandwidth_GBps"] = round(copy_bw, 1)
    rep.save()
    print(f"HBM copy bandwidth (read + write): {copy_bw:.0f} GB/s", flush=True)
    b, ctx, h, T = args.batch, args.context, args.heads, args.prefill_tokens
    d = lambda n, w, st, reload=True: {"BLOCK_N": n, "num_warps": w, "num_stages": st, "RELOAD": reload}  # noqa: E731
    p = lambda m, n, w, st: {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st}  # noqa: E731
    if SMOKE:
        bf16_dec = fp32_dec = [d(16, 4, 1)]
        bf16_pre = fp32_pre = [p(16, 16, 4, 1)]
    else:
        bf16_dec = [d(32, 8, 2), d(32, 4, 3, False), d(32, 8, 3, False), d(64, 4, 2, False), d(64, 8, 2, False),
                    d(32, 4, 4), d(64, 8, 2), d(16, 4, 4, False)]
        fp32_dec = [d(32, 8, 2), d(32, 4, 2), d(16, 4, 1)]
        bf16_pre = [p(128, 64, 8, 3), p(128, 64, 8, 2), p(128, 128, 8, 2), p(64, 64, 4, 3), p(128, 32, 4, 3),
                    p(64, 128, 4, 2)]
        fp32_pre = [p(64, 32, 4, 2), p(64, 64, 4, 2), p(128, 32, 8, 2)]
        if args.quick:
            bf16_dec, fp32_dec, bf16_pre, fp32_pre = bf16_dec[:3], fp32_dec[:1], bf16_pre[:2], fp32_pre[:1]
    splits = [None] if SMOKE else [None, 16, 33, 66, 132]
    bf16 = torch.bfloat16
    dec_bf16 = f"paged_mla_decode_bf16_b{b}_ctx{ctx}_h{h}"
    pre1, pre2 = f"mla_prefill_bf16_T{T}_pcp1", f"mla_prefill_bf16_T{T}_pcp2_rank0"

    # 1. the headline of each kernel first, so a short budget still measures them
    run_case(rep, "decode_bf16", lambda: bench_decode(
        rep, dev, copy_bw, batch=b, ctx=ctx, heads=h, block_size=64, dtype=bf16, precisions=["tf32"],
        configs=bf16_dec, splits_list=splits, label=dec_bf16))
    run_case(rep, "prefill_bf16_pcp1", lambda: bench_prefill(
        rep, dev, total=T, pcp=1, dtype=bf16, precision="tf32", configs=bf16_pre, label=pre1, sdpa=True))
    best_pre = rep.data["kernels"].get(pre1, {}).get("config")
    run_case(rep, "prefill_bf16_pcp2", lambda: bench_prefill(
        rep, dev, total=T, pcp=2, dtype=bf16, precision="tf32",
        configs=([best_pre] if best_pre else []) + [c for c in bf16_pre[:3] if c != best_pre], label=pre2))
    run_case(rep, "engine_prefill_bf16", lambda: [bench_engine_prefill(
        rep, dev, total=T, pcp=pcp, dtype=bf16, label=f"engine_prefill_bf16_T{T}_pcp{pcp}") for pcp in (1, 2)])
    run_case(rep, "prefill_fp32_tf32x3_pcp1", lambda: bench_prefill(
        rep, dev, total=T, pcp=1, dtype=torch.float32, precision="tf32x3", configs=fp32_pre,
        label=f"mla_prefill_fp32_tf32x3_T{T}_pcp1"))
    run_case(rep, "engine_prefill_fp32", lambda: [bench_engine_prefill(
        rep, dev, total=T, pcp=pcp, dtype=torch.float32, label=f"engine_prefill_fp32_T{T}_pcp{pcp}")
        for pcp in (1, 2)])
    kk = rep.data["kernels"]
    tg = rep.data.setdefault("targets", {})
    if dec_bf16 in kk:
        tg["decode_bf16_fraction_of_copy_bw (>= 0.70)"] = kk[dec_bf16]["fraction_of_copy_bw"]
    if pre1 in kk and pre2 in kk:
        tg["prefill_kernel_pcp2_over_pcp1 (<= 0.55)"] = round(kk[pre2]["time_us"] / kk[pre1]["time_us"], 3)
    e1, e2 = f"engine_prefill_bf16_T{T}_pcp1", f"engine_prefill_bf16_T{T}_pcp2"
    if e1 in kk and e2 in kk:
        tg["engine_prefill_attention_pcp2_over_pcp1 (<= 0.55)"] = round(kk[e2]["time_us"] / kk[e1]["time_us"], 3)
        tg["engine_prefill_attention_ms_per_step_pcp1 (2 layers)"] = round(2 * kk[e1]["time_us"] / 1e3, 2)
    rep.save()

    # 2. the absorbed-vs-expanded crossover (sets kv_cache.decode_max_query_len)
    run_case(rep, "crossover", lambda: bench_crossover(
        rep, dev, ctx=8192 if big else 64, q_lens=[4, 8, 16, 32, 64, 128] if big else [2, 8], dtype=bf16,
        label="rows of q queries at the end of the context, 4 rows"))

    # 3. fp32 decode (the engine's default dtype) at each precision, batch 1 and the tiny model's shape
    for prec in ("tf32x3", "tf32", "ieee"):
        run_case(rep, f"decode_fp32_{prec}", lambda prec=prec: bench_decode(
            rep, dev, copy_bw, batch=b, ctx=ctx, heads=h, block_size=64, dtype=torch.float32, precisions=[prec],
            configs=fp32_dec if prec != "ieee" else [d(16, 8, 2)], splits_list=[None] if SMOKE else [None, 16, 64],
            label=f"paged_mla_decode_fp32_{prec}_b{b}_ctx{ctx}_h{h}", ref=prec == "tf32x3"), need_s=15)
    cfg = (rep.data["kernels"].get(f"paged_mla_decode_fp32_tf32x3_b{b}_ctx{ctx}_h{h}", {}).get("config")
           or d(32, 8, 2))
    cfg = {k: v for k, v in cfg.items() if k not in ("precision", "num_splits")}
    run_case(rep, "decode_b1", lambda: bench_decode(
        rep, dev, copy_bw, batch=1, ctx=ctx, heads=h, block_size=64, dtype=torch.float32, precisions=["tf32x3"],
        configs=[cfg], splits_list=[None] if SMOKE else [None, 64, 128],
        label=f"paged_mla_decode_fp32_b1_ctx{ctx}_h{h}"))
    run_case(rep, "decode_tiny_model_bf16", lambda: bench_decode(
        rep, dev, copy_bw, batch=b, ctx=ctx, heads=MODEL_HEADS, block_size=16, dtype=bf16, precisions=["tf32"],
        configs=[{k: v for k, v in rep.data["kernels"].get(dec_bf16, {}).get("config", d(32, 8, 2)).items()
                  if k not in ("precision", "num_splits")}],
        splits_list=[None], label=f"paged_mla_decode_bf16_b{b}_ctx{ctx}_h4_bs16", ref=False))

    # 4. the small kernels
    bench_small(rep, dev, copy_bw, big)
    rep.data["meta"]["wall_s"] = round(time.perf_counter() - t0, 1)
    rep.save()
    summary(rep)
    print(f"wrote {args.out} ({rep.data['meta']['wall_s']} s)")


if __name__ == "__main__":
    main()
