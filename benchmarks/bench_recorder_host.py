"""What the vLLM plugin's recorder costs the step loop, on CPU (no GPU, no model): the recorder's real
hooks and sink (``pcpviz.vllm.recording``) fed views of a vLLM 0.33.0 decode step, inside a synthetic
step loop that stands in for vLLM's own (many small torch ops and some Python, ~2 ms a step).

    PYTHONPATH=. python benchmarks/bench_recorder_host.py --out data/bench/recorder_host_cpu.json

One step of the stand-in loop, in vLLM's order (MTP K=2, FULL_AND_PIECEWISE: the target and the
draft decode replay FULL graphs, the draft prefill runs ``_run_model``): ``prepare_inputs`` (PCP=1)
or the PCP manager's ``partition_batch`` / ``prepare_attn`` / ``prepare_slot_mappings`` (PCP=2),
the target forward, ``restore_for_sampling`` (PCP=2), ``postprocess_sampled`` (verify), ``propose``
(draft_0 forward, draft_1 FULL replay, the draft tokens; the step is handed to the sink). Each hook
is the recorder's own method on stand-in objects that hold tensors of vLLM's shapes and dtypes
(batch ``R`` decodes of 1 + K tokens, contexts of ``--context`` tokens, block size 16, rows of a
``max_model_len`` 32768 block table). Tensors live on the CPU, so "device" work is CPU work too.

Modes: ``off`` (no hook runs), ``record`` (every step to the rank file), ``flight`` (the last 64
steps kept, nothing written). The modes are interleaved (rotated each repeat), each repeat ``--steps``
steps, the sink drained between repeats; the figures are medians per step: the loop's wall time and
its ratio to ``off`` (what vLLM would see; on a machine with few, shared cores the writer's own CPU
time competes with the loop's), the step thread's CPU time and its ratio (``time.thread_time``: the
hooks' own cost, whatever else runs), and ``hook_us``, the wall time inside the hooks on the step
thread (``RankRecorder.seconds``; a writer thread's hold on the GIL shows here). The garbage
collector's heap is frozen after the warm-up, as vLLM's ``EngineCore`` freezes it after start-up
(``v1/engine/core.py:243``): without that, the young collections the hooks' allocations trigger
scan the whole unfrozen heap and cost the hooks more than everything else (1.3-1.8 ms a step here
against 0.4-0.6 ms frozen, 2026-12-03).
``PCPVIZ_WRITER=thread`` measures the writer thread instead of the writer process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("PCPVIZ_BENCH_TREE", str(ROOT)))  # --against: the tree whose recorder runs

import numpy as np  # noqa: E402
import torch  # noqa: E402

MODES = ("off", "record", "flight")
K = 2
BLOCK = 16
WIDTH = 32768 // BLOCK  # block-table row width (max_model_len / block_size)
MAX_REQS = 64
MAX_TOKENS = 16384
H = 64  # hidden size of the stand-in (fingerprints run over it)


def _ns(**kw) -> types.SimpleNamespace:
    return types.SimpleNamespace(**kw)


class Stage:
    """vLLM's persistent buffers for a decode batch of ``r`` requests (contexts of ``ctx`` tokens)."""

    def __init__(self, r: int, ctx: int, pcp: int, *, full_drafts: bool = True) -> None:
        t = r * (1 + K)
        self.r, self.t, self.pcp, self.full_drafts = r, t, pcp, full_drafts
        nb = -(-ctx // BLOCK)
        self.idx = torch.arange(MAX_REQS, dtype=torch.int32)
        self.num_blocks = torch.zeros(1, MAX_REQS, dtype=torch.int32)
        self.num_blocks[0, :r] = nb
        self.bt_gpu = torch.zeros(MAX_REQS, WIDTH, dtype=torch.int32)
        self.bt_gpu[:r, :nb] = torch.arange(1, r * nb + 1, dtype=torch.int32).view(r, nb)
        self.bt_gpu[:r, nb:nb + 3] = 7  # a previous occupant's tail
        self.input_bt = self.bt_gpu.clone()
        self.slots = torch.arange(MAX_TOKENS, dtype=torch.int64).view(1, -1).clone()
        self.positions = torch.arange(MAX_TOKENS, dtype=torch.int64)
        self.input_ids = torch.randint(0, 1000, (MAX_TOKENS,), dtype=torch.int32)
        self.qsl = torch.arange(MAX_REQS + 1, dtype=torch.int32) * (1 + K)
        self.seq_lens = torch.full((MAX_REQS,), ctx, dtype=torch.int32)
        self.logits_idx = torch.arange(t, dtype=torch.int64)
        self.hidden = torch.randn(t, H)
        self.sampled = torch.randint(0, 1000, (MAX_REQS, K + 1), dtype=torch.int64)
        self.num_sampled = torch.ones(MAX_REQS, dtype=torch.int32) * 2
        self.num_rejected = torch.ones(MAX_REQS, dtype=torch.int32)
        self.draft_tokens = torch.randint(0, 1000, (r, K), dtype=torch.int64)
        self.last_token_indices = torch.arange(r, dtype=torch.int64) * (1 + K) + K
        bs = _ns(block_sizes=[BLOCK], num_blocks=_ns(gpu=self.num_blocks), block_tables=[_ns(gpu=self.bt_gpu)],
                 input_block_tables=[self.input_bt], gather_block_tables=lambda *a, **k: None,
                 compute_slot_mappings=lambda *a, **k: self.slots[:, :r])
        self.block_tables = bs
        self.batch = self._batch(r, t, [f"req-{i:04d}-{'x' * 24}" for i in range(r)])
        self.runner = _ns(block_tables=bs, dcp_size=1, dcp_rank=0, cp_interleave=1)
        self.spec = _ns(block_tables=bs, num_speculative_steps=K, method="mtp", vllm_config=None, pcp_manager=None,
                        input_buffers=_ns(input_ids=self.input_ids, positions=self.positions, seq_lens=self.seq_lens),
                        last_token_indices=self.last_token_indices, kv_cache_config=None,
                        hidden_states=self.hidden, draft_attn_layer_names=set())
        if pcp > 1:
            self._pcp_manager()
        self.draft_graphs = _ns(name="speculator decode graphs")  # a SpeculatorCudaGraphManager stand-in
        self._capture_draft_graphs()

    def _capture_draft_graphs(self) -> None:
        """What vLLM's capture hands the drafter's model (noted by the recorder, ``consumed.note_capture``):
        views of the speculator's persistent buffers at each replayed size."""
        try:
            from pcpviz.vllm.recording.consumed import capturing, note_capture
        except ImportError:  # an older recorder (--against): the replays read the speculator's buffers
            return
        for n in {self.local.num_tokens if self.pcp > 1 else self.t, self.r}:
            with capturing(self.draft_graphs):
                note_capture((), {"input_ids": self.input_ids[:n], "positions": self.positions[:n],
                                  "hidden_states": self.hidden[:n]}, {"layer.0": self.slots[0, :n]})

    def _batch(self, r: int, t: int, req_ids: list[str]) -> types.SimpleNamespace:
        return _ns(num_reqs=r, num_tokens=t, req_ids=req_ids, idx_mapping=self.idx,
                   num_scheduled_tokens=np.full(r, 1 + K, dtype=np.int32),
                   num_computed_tokens_np=np.full(r, 256, dtype=np.int32), query_start_loc=self.qsl,
                   positions=self.positions, input_ids=self.input_ids, seq_lens=self.seq_lens,
                   is_prefilling_np=np.zeros(r, dtype=bool), prefill_len_np=np.full(r, 256, dtype=np.int32),
                   logits_indices=self.logits_idx, num_draft_tokens_per_req=np.full(r, K, dtype=np.int32),
                   num_reqs_after_padding=r, num_tokens_after_padding=t,
                   is_padding=torch.zeros(t, dtype=torch.bool), is_prefilling=None)

    def _pcp_manager(self) -> None:
        """PCP=2 (decodes sharded): this rank holds half the requests; the layout's segments."""
        r, t = self.r, self.t
        lr = max(r // 2, 1)
        local = self._batch(lr, lr * (1 + K), self.batch.req_ids[:lr])
        seg = _ns(global_batch_req_idx=0, global_batch_slice=slice(0, 3), rank_local_batch_slice=slice(0, 3))
        self.segments = [[seg] * lr, [seg] * (r - lr)]
        self.local = local
        self.manager = _ns(_padded_gather_idx=torch.arange(2 * local.num_tokens, dtype=torch.int64),
                           _hidden_restore_idx=torch.arange(t, dtype=torch.int64),
                           _gathered_kv_write_mask=torch.ones(2 * local.num_tokens, dtype=torch.bool),
                           pcp_world_size=2, dcp_world_size=1, shard_decode_requests=True,
                           _block_tables=self.block_tables,
                           _global_batch=self.batch, dcp_rank=0, cp_interleave=1,
                           _global_batch_slot_mappings=self.slots, draft_prefill_batch=local,
                           _local_block_tables=[self.input_bt])
        self.spec.pcp_manager = self.manager


def vllm_work(x: torch.Tensor, ops: int) -> torch.Tensor:
    """The stand-in for vLLM's own step: ``ops`` small tensor ops and the Python around them."""
    meta = {}
    for i in range(ops):
        x = x.add(1) if i % 3 else x.mul(1)
        meta[i % 7] = (i, x.shape)
    return x


def step(rec, st: Stage, x: torch.Tensor, ops: int, *, on: bool) -> torch.Tensor:
    """One scheduler step: vLLM's work split around the hooks the plugin fires, in vLLM's order."""
    from pcpviz.vllm.recording import fingerprints
    from pcpviz.vllm.recording.graphs import LEDGER
    from pcpviz.vllm.recording.host import now_us

    part = ops // 6
    t0 = now_us()
    if on:
        rec.guard(rec.begin_step)
    x = vllm_work(x, part)
    if on and st.pcp == 1:
        rec.guard(rec.on_global_batch, st.runner, st.batch, t0)
        rec.guard(rec.on_runner_attn, st.runner, st.batch, block_tables=[st.bt_gpu], slot_mappings=st.slots)
    elif on:
        m, loc = st.manager, st.local
        rec.guard(rec.on_layout, st.segments, [loc.num_tokens, st.t - loc.num_tokens])
        rec.guard(rec.on_partition, m, st.batch, loc, t0=t0)
        rec.guard(rec.on_prepare_attn, m, loc, [st.bt_gpu])
        rec.guard(rec.on_slot_mappings, m, st.slots[:, : 2 * loc.num_tokens])
    x = vllm_work(x, part)
    if on:
        rec.guard(LEDGER.on_full_replay, rec, "target")
        if st.pcp > 1:
            rec.guard(rec.on_restore_for_sampling, st.manager, st.batch, 0)
            rec.guard(fingerprints.on_restored_target, rec, st.hidden)
    x = vllm_work(x, part)
    if on:
        t1 = now_us()
        r = st.r
        rec.guard(rec.on_postprocess_sampled, st.idx[:r], st.sampled[:r], st.num_sampled[:r],
                  num_rejected=st.num_rejected[:r], t0=t1)
    x = vllm_work(x, part)
    if not on:
        return vllm_work(x, 2 * part)
    try:
        from pcpviz.vllm.recording import state as threads  # the draft context's thread-local
    except ImportError:  # an older recorder (--against): it lived in wrappers
        from pcpviz.vllm.recording import wrappers as threads

    ctx = rec.guard(rec.begin_propose, st.spec, st.batch, False)
    rec.guard(fingerprints.on_target_hidden, ctx, st.hidden[: (st.local.num_tokens if st.pcp > 1 else st.t)])
    threads._tls.ctx = ctx
    try:
        if st.pcp > 1:
            ctx.global_draft_ids = st.input_ids[: st.t].detach().clone()  # prepare_draft_prefill
        n0 = st.local.num_tokens if st.pcp > 1 else st.t
        if st.full_drafts:  # FULL_AND_PIECEWISE on a decode batch: both draft forwards replay FULL graphs
            rec.guard(LEDGER.on_full_replay, rec, "draft_0")
            rec.guard(ctx.on_full_replay, st.draft_graphs, _ns(num_tokens=n0))
            x = vllm_work(x, part)
            if st.pcp > 1:  # restore_draft_prefill runs in Python after the replay
                rec.guard(rec.put, ctx.phases[-1], draft_prefill_restored=np.array(True))
                rec.guard(fingerprints.on_restored_draft, ctx, st.hidden, st.hidden)
            rec.guard(LEDGER.on_full_replay, rec, "draft_1")
            rec.guard(ctx.on_full_replay, st.draft_graphs, _ns(num_tokens=st.r))
        else:
            if hasattr(ctx, "on_run_model"):  # _run_model's entry, as recording.wrappers calls it
                rec.guard(ctx.on_run_model, n0, {"layer.0": st.slots[0, :n0]}, "PIECEWISE")
            else:  # an older recorder (--against)
                rec.guard(ctx.on_forward, n0, {"layer.0": st.slots[0, :n0]}, "PIECEWISE")
                rec.guard(fingerprints.before_forward, ctx, n0)
            x = vllm_work(x, part)
            rec.guard(fingerprints.after_forward, ctx, (st.hidden[:n0], st.hidden[:n0]))
            if st.pcp > 1:
                rec.guard(rec.put, ctx.phases[-1], draft_prefill_restored=np.array(True))
                rec.guard(fingerprints.on_restored_draft, ctx, st.hidden, st.hidden)
            rec.guard(LEDGER.on_full_replay, rec, "draft_1")
        x = vllm_work(x, part)
    finally:
        threads._tls.ctx = None
    rec.guard(rec.end_propose, ctx, st.draft_tokens)
    return x


def bench_case(r: int, pcp: int, *, steps: int, repeats: int, ops: int, ctx: int, full_drafts: bool = True,
               device: str = "cpu", profile: Path | None = None) -> dict:
    from pcpviz.trace.flight import FlightConfig
    from pcpviz.vllm import recording

    work = Path(tempfile.mkdtemp(prefix="pcpviz-rechost-"))
    with torch.device(device):  # the stand-in's buffers on ``device`` (its step's ops follow them)
        st = Stage(r, ctx, pcp, full_drafts=full_drafts)
        x = torch.zeros(8)
    flight = FlightConfig(steps=64, signal=None)
    s = recording.TraceSession(work / "trace", producer="bench", meta={"pcp": pcp}, strict=False)
    rec = s.recorder_for_rank(0, pcp)
    for _ in range(20):  # warm-up (the sink's first write opens the file / starts its worker)
        s.mode = "record"
        x = step(rec, st, x, ops, on=True)
    rec.sink.drain()
    gc.collect()
    gc.freeze()  # as vLLM's EngineCore does after start-up (v1/engine/core.py:243, utils/gc_utils.py:120-131)
    per_step: dict[str, list[float]] = {m: [] for m in MODES}
    cpu_step: dict[str, list[float]] = {m: [] for m in MODES}
    hook_us: dict[str, list[float]] = {m: [] for m in MODES}
    by_hook: dict[str, dict[str, int]] = {m: {} for m in MODES if m != "off"}
    for rep in range(repeats):
        for m in MODES[rep % 3:] + MODES[: rep % 3]:
            s.mode, s.flight = ("record", None) if m == "off" else (m, flight if m == "flight" else None)
            secs0, hooks0 = rec.seconds, rec.hook_times()
            t, c = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                x = step(rec, st, x, ops, on=m != "off")
            per_step[m].append((time.perf_counter() - t) / steps)
            cpu_step[m].append((time.thread_time() - c) / steps)
            hook_us[m].append((rec.seconds - secs0) / steps * 1e6)
            for k, v in rec.hook_times().items() if m != "off" else ():
                by_hook[m][k] = by_hook[m].get(k, 0) + v - hooks0.get(k, 0)
            rec.sink.drain()
    if profile is not None:  # the flight recorder's steps under cProfile: where the hooks' time goes, by function
        import cProfile
        import io
        import pstats

        s.mode, s.flight = "flight", flight
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            x = step(rec, st, x, ops, on=True)
        pr.disable()
        rec.sink.drain()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(r"pcpviz|torch|numpy|built-in|method", 40)
        with profile.open("a") as f:
            f.write(f"===== batch {r} x pcp {pcp} on {device}: {steps} flight steps, no vLLM work inside the hooks\n")
            f.write(out.getvalue())
    assert not rec.disabled, rec.disabled_reason
    bytes_written = rec.sink.stats().get("bytes_written", 0) if hasattr(rec.sink, "stats") else \
        (rec.writer.bytes_written if rec.writer is not None else 0)
    s.close()
    med = {m: statistics.median(v) for m, v in per_step.items()}
    cpu = {m: statistics.median(v) for m, v in cpu_step.items()}
    return {"batch": r, "pcp": pcp, "steps_per_repeat": steps, "repeats": repeats,
            "step_ms": {m: round(v * 1e3, 4) for m, v in med.items()},
            "record_over_off": round(med["record"] / med["off"], 4),
            "flight_over_off": round(med["flight"] / med["off"], 4),
            "step_thread_cpu_ms": {m: round(v * 1e3, 4) for m, v in cpu.items()},
            "cpu_record_over_off": round(cpu["record"] / cpu["off"], 4),
            "cpu_flight_over_off": round(cpu["flight"] / cpu["off"], 4),
            "hook_us_per_step": {m: round(statistics.median(v), 1) for m, v in hook_us.items() if m != "off"},
            "hook_us_per_step_by_hook": {m: _by_hook(h, steps * repeats) for m, h in by_hook.items()},
            "device": device,
            "trace_bytes": bytes_written}


def _by_hook(ns: dict[str, int], steps: int) -> dict[str, float]:
    """Microseconds a step of each hook, largest first."""
    return dict(sorted(((k, round(v / steps / 1e3, 1)) for k, v in ns.items()), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--ops", type=int, default=360, help="small torch ops of the stand-in step (~2 ms)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--cases", default="1x1,32x1,1x2,32x2", help="batch x pcp, comma-separated")
    ap.add_argument("--against", type=Path, help="another checkout (the old recorder): run this benchmark in "
                    "subprocesses, old and new alternating, --pairs times, and report both")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--profile", type=Path, help="append a cProfile of each case's flight steps to this file")
    ap.add_argument("--device", default="cpu", help="where the stand-in's buffers live (cuda: the hooks' copies "
                    "are CUDA ops, as under vLLM)")
    ap.add_argument("--draft-mode", choices=("full", "piecewise"), default="full",
                    help="full (vLLM's default FULL_AND_PIECEWISE on decode batches: both draft forwards replay "
                         "FULL graphs, read by on_full_replay) or piecewise (draft_0 through _run_model)")
    a = ap.parse_args(argv)
    if a.against is not None:
        return compare(a, sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    from pcpviz.vllm import cpu_patches

    cpu_patches.apply_cpu_patches()
    res = {"command": "PYTHONPATH=. python " + " ".join(["benchmarks/bench_recorder_host.py"] + sys.argv[1:]),
           "torch_threads": 1, "cpus": os.cpu_count(), "writer": os.environ.get("PCPVIZ_WRITER", "default"),
           "cases": []}
    for case in a.cases.split(","):
        r, pcp = (int(v) for v in case.split("x"))
        entry = bench_case(r, pcp, steps=a.steps, repeats=a.repeats, ops=a.ops, ctx=a.context,
                           full_drafts=a.draft_mode == "full", device=a.device, profile=a.profile)
        res["cases"].append(entry)
        print(json.dumps(entry), flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


def compare(a: argparse.Namespace, args: list[str]) -> int:
    """Old (``--against``) and new (this tree) interleaved: ``--pairs`` pairs of subprocesses, the
    order swapped every pair; per case and mode the median and min-max over the pairs of each
    subprocess's median ``hook_us`` (host microseconds per step inside the hooks) and step time."""
    import subprocess

    skip = {"--against", "--pairs", "--out"}
    passed, it = [], iter(args)
    for x in it:
        if x.split("=")[0] in skip:
            if "=" not in x:
                next(it, None)
            continue
        passed.append(x)
    runs: dict[str, list[list[dict]]] = {"old": [], "new": []}
    for i in range(a.pairs):
        for which in (("old", "new") if i % 2 == 0 else ("new", "old")):
            tree = a.against.resolve() if which == "old" else ROOT
            out = Path(tempfile.mkdtemp(prefix="pcpviz-rh-")) / "r.json"
            # This script in both runs (the stand-in step is the same; it runs older recorders too), the
            # recorder imported from ``tree``.
            env = {**os.environ, "PCPVIZ_BENCH_TREE": str(tree)}
            subprocess.run([sys.executable, __file__, *passed, "--out", str(out)], env=env, check=True,
                           stdout=subprocess.DEVNULL)
            runs[which].append(json.loads(out.read_text())["cases"])
            print(which, i, json.dumps([(c["batch"], c["pcp"], c["hook_us_per_step"]) for c in runs[which][-1]]),
                  flush=True)

    def spread(vals: list[float]) -> dict:
        return {"median": round(statistics.median(vals), 2), "min": round(min(vals), 2), "max": round(max(vals), 2)}

    cases = []
    for ci, case in enumerate(runs["new"][0]):
        entry = {"batch": case["batch"], "pcp": case["pcp"]}
        for which in ("old", "new"):
            cs = [r[ci] for r in runs[which]]
            entry[which] = {
                "hook_us_per_step": {m: spread([c["hook_us_per_step"][m] for c in cs]) for m in ("record", "flight")},
                "step_ms": {m: spread([c["step_ms"][m] for c in cs]) for m in MODES},
                "step_thread_cpu_ms": {m: spread([c["step_thread_cpu_ms"][m] for c in cs]) for m in MODES}}
        cases.append(entry)
    res = {"command": "PYTHONPATH=. python benchmarks/bench_recorder_host.py " + " ".join(args),
           "what": "old (--against) and new recorder, interleaved subprocess pairs; per case the median and "
                   "min-max over the pairs of each run's median per-step figure", "pairs": a.pairs,
           "cpus": os.cpu_count(), "cases": cases, "runs": runs}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    for c in cases:
        print(c["batch"], c["pcp"], "old", c["old"]["hook_us_per_step"], "new", c["new"]["hook_us_per_step"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
