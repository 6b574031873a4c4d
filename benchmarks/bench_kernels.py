"""Kernel benchmark: pcpviz_kernels against their torch references and the measured HBM bandwidth.

    python benchmarks/bench_kernels.py --out data/bench/kernels_h200.json     # one GPU
    python benchmarks/bench_kernels.py --quick                                  # fewer configs

Every figure comes from this one invocation:
* ``copy_bandwidth_GBps``: a large device-to-device ``torch`` copy, counted as bytes read +
  bytes written over time (the ceiling the kernels are measured against);
* per kernel: median time (``torch.cuda.Event``, warm-up first, median of N), the time of its
  torch reference, the speedup, the bytes it must touch at least / time, and that bandwidth as a
  fraction of the copy bandwidth.
The headline is paged MLA decode at 32k context, batch 16: it must read 16 x 32768 x 576 x 4
bytes of fp32 latent (1.2 GB; a bf16 cache halves that, measured too). Attention is swept over
launch configs (tile of keys, warps, pipeline stages), ``tl.dot`` precisions and KV split counts;
the best of each is reported along with every point of the sweep. The JSON is rewritten after
each case, so a run cut short keeps what it measured.

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

import torch  # noqa: E402

import pcpviz_kernels as K  # noqa: E402
from pcpviz_kernels import paged_mla  # noqa: E402

R, DR = 512, 64


def cuda_time(fn, warmup=3, iters=20, max_s=None) -> float:
    """Median seconds of ``fn()`` by CUDA events (each iteration timed on its own)."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return max(time.perf_counter() - t, 1e-9)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    t_end = None if max_s is None else time.perf_counter() + max_s
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
        if t_end is not None and time.perf_counter() > t_end and len(times) >= 3:
            break
    return statistics.median(times)


class Report:
    def __init__(self, path: str) -> None:
        self.path = path
        self.data: dict = {"kernels": {}, "sweeps": {}, "errors": {}}

    def save(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1, sort_keys=False)

    def kernel(self, name, t_kernel, t_ref, nbytes, copy_bw, **extra):
        bw = nbytes / t_kernel / 1e9
        row = {"time_us": round(t_kernel * 1e6, 2),
               "ref_time_us": None if t_ref is None else round(t_ref * 1e6, 2),
               "speedup_vs_torch": None if t_ref is None else round(t_ref / t_kernel, 2),
               "bytes": int(nbytes), "bandwidth_GBps": round(bw, 1),
               "fraction_of_copy_bw": round(bw / copy_bw, 3), **extra}
        self.data["kernels"][name] = row
        self.save()
        ref = "" if t_ref is None else f"  torch {t_ref * 1e6:9.1f} us  x{t_ref / t_kernel:6.2f}"
        print(f"{name:38s} {t_kernel * 1e6:9.1f} us  {bw:7.0f} GB/s  {bw / copy_bw:5.1%} of copy{ref}",
              flush=True)
        return row


def copy_bandwidth(dev) -> float:
    n = 1 << 28 if not SMOKE else 1 << 20  # 1 GiB of fp32
    src = torch.empty(n, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), warmup=3, iters=20)
    del src, dst
    return 2 * n * 4 / t / 1e9


def attention_case(dev, batch, ctx, heads, block_size, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    width = -(-ctx // block_size)
    num_blocks = batch * width + 1
    perm = torch.randperm(num_blocks - 1, generator=g)[: batch * width] + 1  # block 0 = null
    bt = perm.view(batch, width).to(torch.int32).to(dev)
    cache = torch.randn(num_blocks * block_size, R + DR, device=dev).to(dtype)
    return bt, cache


def bench_decode(rep, dev, copy_bw, *, batch, ctx, heads, block_size, dtype, precisions, configs,
                 splits_list, label, ref=True, configs_by_precision=None):
    bt, cache = attention_case(dev, batch, ctx, heads, block_size, dtype)
    q_lat = torch.randn(batch, heads, R, device=dev)
    q_pe = torch.randn(batch, heads, DR, device=dev)
    qsl = torch.arange(batch + 1, device=dev)
    seq = torch.full((batch,), ctx, device=dev, dtype=torch.int64)
    pos = seq - 1
    scale = 1.0 / (R + DR) ** 0.5
    elt = cache.element_size()
    nbytes = paged_mla.bytes_touched(batch, heads, R, DR, batch * ctx, elt) + bt.numel() * 4
    args = (q_lat, q_pe, cache, bt, qsl, pos, seq, block_size, scale)
    want = K.paged_mla_attention_ref(*args) if ref else None
    t_ref = cuda_time(lambda: K.paged_mla_attention_ref(*args), warmup=1, iters=5) if ref else None
    sweep = []
    best = None
    for prec in precisions:
        for cfg in (configs_by_precision or {}).get(prec, configs):
            for splits in splits_list:
                key = (f"{prec} {cfg.get('KERNEL', 'n')} N{cfg['BLOCK_N']} w{cfg['num_warps']} "
                       f"s{cfg['num_stages']} reload={int(cfg.get('RELOAD', True))} splits={splits}")
                try:
                    fn = lambda: K.paged_mla_attention(*args, max_query_len=1, max_seq_len=ctx,  # noqa: E731
                                                       num_splits=splits, input_precision=prec, config=cfg)
                    got = fn()
                    err = None if want is None else float((got - want).abs().max())
                    t = cuda_time(fn, warmup=2, iters=15)
                except Exception as e:  # noqa: BLE001 - a config the GPU cannot hold, a compile error
                    sweep.append({"config": key, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                point = {"config": key, "cfg": dict(cfg, precision=prec), "time_us": round(t * 1e6, 2),
                         "fraction_of_copy_bw": round(nbytes / t / 1e9 / copy_bw, 3), "max_abs_err": err}
                sweep.append(point)
                if best is None or t < best[0]:
                    best = (t, key, err, dict(cfg, precision=prec, num_splits=splits))
    rep.data["sweeps"][label] = sweep
    if best is None:
        rep.data["errors"][label] = "no config ran"
        rep.save()
        print(f"{label}: no config ran", flush=True)
        return None
    splits_used = paged_mla.plan(heads, batch, 1, ctx, dev, best[3]["num_splits"])[4]
    return rep.kernel(label, best[0], t_ref, nbytes, copy_bw, best_config=best[1], max_abs_err_vs_ref=best[2],
                      config=best[3], splits_used=splits_used, batch=batch, context=ctx, heads=heads,
                      block_size=block_size, cache_dtype=str(dtype))


def bench_prefill(rep, dev, copy_bw, *, q_len, heads, block_size, precisions, block_ms, label):
    """One DualChunkSwap rank's prefill: PCP=2, rank 0 holds chunks 0 and 3 of a 2*q_len prompt."""
    total = 2 * q_len
    chunk = q_len // 2
    bt, cache = attention_case(dev, 1, total, heads, block_size, torch.float32)
    bt = bt.repeat(2, 1)  # two local rows (head chunk, tail chunk) of the same request
    pos = torch.cat([torch.arange(0, chunk), torch.arange(total - chunk, total)]).to(dev)
    qsl = torch.tensor([0, chunk, 2 * chunk], device=dev)
    seq = torch.tensor([chunk, total], device=dev)
    q_lat = torch.randn(2 * chunk, heads, R, device=dev)
    q_pe = torch.randn(2 * chunk, heads, DR, device=dev)
    scale = 1.0 / (R + DR) ** 0.5
    args = (q_lat, q_pe, cache, bt, qsl, pos, seq, block_size, scale)
    want = K.paged_mla_attention_ref(*args)
    t_ref = cuda_time(lambda: K.paged_mla_attention_ref(*args), warmup=1, iters=3)
    # causal pairs (query, key) and the flops of the absorbed form: 2*(R+DR) + 2*R per pair and head
    pairs = chunk * (chunk + 1) // 2 + sum(range(total - chunk + 1, total + 1))
    flops = pairs * heads * (2 * (R + DR) + 2 * R)
    sweep, best = [], None
    for prec in precisions:
        for bm in block_ms:
            key = f"{prec} block_m={bm}"
            try:
                fn = lambda: K.paged_mla_attention(*args, max_query_len=chunk, max_seq_len=total,  # noqa: E731
                                                   input_precision=prec, block_m=bm)
                err = float((fn() - want).abs().max())
                t = cuda_time(fn, warmup=1, iters=5)
            except Exception as e:  # noqa: BLE001
                sweep.append({"config": key, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            sweep.append({"config": key, "time_us": round(t * 1e6, 2), "TFLOPS": round(flops / t / 1e12, 1),
                          "max_abs_err": err})
            if best is None or t < best[0]:
                best = (t, key, err)
    rep.data["sweeps"][label] = sweep
    if best is None:
        rep.data["errors"][label] = "no config ran"
        return None
    nbytes = paged_mla.bytes_touched(2 * chunk, heads, R, DR, total, 4)
    return rep.kernel(label, best[0], t_ref, nbytes, copy_bw, best_config=best[1], max_abs_err_vs_ref=best[2],
                      TFLOPS=round(flops / best[0] / 1e12, 1), query_tokens=2 * chunk, context=total,
                      heads=heads, note="compute-bound: bandwidth figures are not the goal here")


def run_case(rep, label, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - keep measuring the other kernels
        rep.data["errors"][label] = f"{type(e).__name__}: {e}"
        rep.save()
        print(f"{label}: FAILED {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "data", "bench", "kernels_h200.json"))
    ap.add_argument("--quick", action="store_true", help="a smaller config sweep")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16, help="heads per GPU (DeepSeek-V3 128 heads / TP 8)")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: interpreted kernels, tiny sizes")
    args = ap.parse_args()
    if SMOKE:
        dev = torch.device("cpu")
        args.context, args.batch, args.quick = 80, 2, True
        if args.out == ap.get_default("out"):
            args.out = os.path.join("/tmp", "bench_kernels_smoke.json")
    elif not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (or --smoke for a CPU dry run)")
    else:
        dev = torch.device("cuda")
    big = not SMOKE  # full sizes for the small kernels
    import triton

    rep = Report(args.out)
    rep.data["meta"] = {
        "command": "python benchmarks/bench_kernels.py " + " ".join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(0) if big else "cpu (smoke)",
        "sms": torch.cuda.get_device_properties(0).multi_processor_count if big else 0,
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "timing": "torch.cuda.Event per iteration, warm-up first, median",
    }
    t0 = time.perf_counter()
    copy_bw = copy_bandwidth(dev)
    rep.data["copy_bandwidth_GBps"] = round(copy_bw, 1)
    rep.save()
    print(f"HBM copy bandwidth (read + write): {copy_bw:.0f} GB/s", flush=True)

    # Chosen from sm_90 compiles (shared memory <= 227 KB, little or no spilling); see paged_mla._configs.
    # KERNEL "n": query-head rows as the MMA's M; "t": keys as M (transposed products).
    n_cfg = lambda bn, w, st, reload=True: {"BLOCK_N": bn, "num_warps": w, "num_stages": st,  # noqa: E731
                                            "RELOAD": reload, "KERNEL": "n"}
    t_cfg = lambda bn, w, st, reload=False: {"BLOCK_N": bn, "num_warps": w, "num_stages": st,  # noqa: E731
                                             "RELOAD": reload, "KERNEL": "t"}
    configs = [n_cfg(32, 4, 2), n_cfg(64, 8, 1), n_cfg(32, 8, 2), n_cfg(16, 8, 2), n_cfg(16, 4, 1),
               t_cfg(32, 8, 2), t_cfg(32, 4, 2), t_cfg(32, 8, 1, True), t_cfg(32, 8, 3)]
    bf16_configs = [n_cfg(32, 8, 2), n_cfg(64, 8, 3), t_cfg(32, 8, 2), t_cfg(32, 4, 2), t_cfg(64, 8, 2)]
    if args.quick:
        configs, bf16_configs = configs[:2] + configs[5:6], bf16_configs[:1] + bf16_configs[2:3]
    b, ctx, h = args.batch, args.context, args.heads

    def headline():
        # The precision x config sweep at the default split count, then split counts for the best
        # config of each precision. ieee (exact fp32 FMA dots) spills registers: one config only.
        label = f"paged_mla_decode_fp32_b{b}_ctx{ctx}_h{h}_sweep"
        row = bench_decode(rep, dev, copy_bw, batch=b, ctx=ctx, heads=h, block_size=64, dtype=torch.float32,
                           precisions=["tf32x3", "tf32", "ieee"], configs=configs, splits_list=[None],
                           configs_by_precision={"ieee": [n_cfg(16, 8, 2)]}, label=label)
        if row is None:
            return
        rep.data["best_decode_config"] = row["config"]
        rep.data["best_decode_config_by_precision"] = {}
        for p in ("tf32x3", "tf32", "ieee"):
            pts = [x for x in rep.data["sweeps"][label] if "time_us" in x and x["cfg"]["precision"] == p]
            if not pts:
                continue
            cfg = {k: v for k, v in min(pts, key=lambda x: x["time_us"])["cfg"].items() if k != "precision"}
            rep.data["best_decode_config_by_precision"][p] = cfg
            bench_decode(rep, dev, copy_bw, batch=b, ctx=ctx, heads=h, block_size=64, dtype=torch.float32,
                         precisions=[p], configs=[cfg], splits_list=[None, 8, 16, 32, 64],
                         label=f"paged_mla_decode_fp32_{p}_b{b}_ctx{ctx}_h{h}")
        fp32 = {k: v for k, v in rep.data["kernels"].items() if k.startswith("paged_mla_decode_fp32_")}
        rep.data["headline"] = {
            "kernel": f"paged MLA decode, fp32 latent cache, batch {b}, context {ctx}, {h} heads",
            "fraction_of_copy_bw_by_precision": {
                p: fp32[f"paged_mla_decode_fp32_{p}_b{b}_ctx{ctx}_h{h}"]["fraction_of_copy_bw"]
                for p in ("tf32x3", "tf32", "ieee") if f"paged_mla_decode_fp32_{p}_b{b}_ctx{ctx}_h{h}" in fp32},
            "goal": 0.6,
        }
        rep.save()

    run_case(rep, "decode_headline", headline)
    run_case(rep, "decode_bf16", lambda: bench_decode(
        rep, dev, copy_bw, batch=b, ctx=ctx, heads=h, block_size=64, dtype=torch.bfloat16, precisions=["tf32"],
        configs=bf16_configs, splits_list=[None, 16],
        label=f"paged_mla_decode_bf16_b{b}_ctx{ctx}_h{h}"))
    cfg = rep.data.get("best_decode_config_by_precision", {}).get("tf32x3", n_cfg(32, 4, 2))
    prec = "tf32x3"  # the engine's default precision
    cfg = {k: v for k, v in cfg.items() if k not in ("precision", "num_splits")}
    run_case(rep, "decode_b1", lambda: bench_decode(
        rep, dev, copy_bw, batch=1, ctx=ctx, heads=h, block_size=64, dtype=torch.float32, precisions=[prec],
        configs=[cfg], splits_list=[None, 64, 128], label=f"paged_mla_decode_fp32_b1_ctx{ctx}_h{h}"))
    run_case(rep, "decode_tiny_model", lambda: bench_decode(
        rep, dev, copy_bw, batch=b, ctx=ctx, heads=4, block_size=16, dtype=torch.float32, precisions=[prec],
        configs=[cfg], splits_list=[None, 32], label=f"paged_mla_decode_fp32_b{b}_ctx{ctx}_h4_bs16"))
    run_case(rep, "prefill", lambda: bench_prefill(
        rep, dev, copy_bw, q_len=4096 if big else 32, heads=h, block_size=64, precisions=["tf32x3", "tf32"],
        block_ms=[16, 32], label=f"paged_mla_prefill_dualchunk_q4096_ctx8192_h{h}"))

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
        rep.kernel("kv_write_fp32_M65536", t, t_ref, 2 * written * width * 4 + m * 8, copy_bw, rows=m,
                   pad_fraction=0.1)

    def block_table():
        rows, width = (1024, 2048) if big else (64, 100)
        table = torch.randint(1, 1 << 20, (rows, width), device=dev, dtype=torch.int32)
        idx = torch.randperm(rows, device=dev)[:256 if big else 16]
        nb = torch.randint(0, width + 1, (rows,), device=dev, dtype=torch.int32)
        t = cuda_time(lambda: K.gather_block_table_rows(table, idx, 512, nb))
        t_ref = cuda_time(lambda: K.gather_block_table_rows_ref(table, idx, 512, nb))
        assert torch.equal(K.gather_block_table_rows(table, idx, 512, nb),
                           K.gather_block_table_rows_ref(table, idx, 512, nb))
        rep.kernel("gather_block_table_rows_256of1024x2048", t, t_ref, (256 + 512) * 2048 * 4, copy_bw)

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
        rep.kernel("compute_slot_mapping_T32768_R64", cuda_time(fn), cuda_time(ref), tokens * (8 + 8 + 4),
                   copy_bw)
        n = 65536 if big else 256
        glob = torch.randint(0, 1 << 24, (tokens,), device=dev)
        gidx = torch.randint(0, tokens, (n,), device=dev)
        mask = torch.rand(n, device=dev) < 0.95
        fn = lambda: K.gathered_slot_mapping(glob, gidx, mask)  # noqa: E731
        ref = lambda: K.gathered_slot_mapping_ref(glob, gidx, mask)  # noqa: E731
        assert torch.equal(fn(), ref())
        rep.kernel("gathered_slot_mapping_NP65536", cuda_time(fn), cuda_time(ref), n * (8 + 8 + 1 + 8),
                   copy_bw)

    def restore():
        n_p, hidden, t = (2 * 16384, 7168, 32000) if big else (64, 96, 50)
        gathered = torch.randn(n_p, hidden, device=dev, dtype=torch.bfloat16)
        idx = torch.randperm(n_p, device=dev)[:t]
        fn = lambda: K.restore_hidden(gathered, idx)  # noqa: E731
        ref = lambda: K.restore_hidden_ref(gathered, idx)  # noqa: E731
        assert torch.equal(fn(), ref())
        rep.kernel("restore_hidden_bf16_T32000_H7168", cuda_time(fn), cuda_time(ref), 2 * t * hidden * 2,
                   copy_bw)

    for name, fn in (("kv_write", kv_write), ("block_table", block_table), ("slot_mapping", slot_mapping),
                     ("restore", restore)):
        run_case(rep, name, fn)
    rep.data["meta"]["wall_s"] = round(time.perf_counter() - t0, 1)
    rep.save()
    print(f"wrote {args.out} ({rep.data['meta']['wall_s']} s)")


if __name__ == "__main__":
    main()
