"""The engine's performance machinery, held to behaviour on CPU (no timing assertions):

* the phase timer partitions every step (its phases sum to the step, the steps to at most the
  loop) and names every phase, off it records nothing;
* the decode-graph path (buckets, padding, static buffers), run without capture on CPU, gives
  the eager path's tokens;
* the asynchronous recorder writes byte-identical trace files, and a writer failure surfaces
  as one line naming the file and step, with nothing after it written;
* inside a step the engine's own modules make one host sync (the sampled tokens' copy).
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
import torch

import pcpviz
from pcpviz.engine.decode_graphs import GraphRunner, StaticInputs, capture_sizes, decode_shape
from pcpviz.engine.inputs import Uploader
from pcpviz.engine.phase_timer import TIMED_PHASES, PhaseTimer
from pcpviz.engine.record import Pending, StepRecord, row_hashes
from pcpviz.engine.recorder import AsyncRecorder
from pcpviz.trace import TraceWriter

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]
MIXED = dict(max_new_tokens=16, max_num_batched_tokens=40, progress=False)


# ---------------------------------------------------------------------------- phase timer
def test_phase_timer_partitions_steps_and_nests():
    t = PhaseTimer(True)
    for kind in ("prefill", "decode", "decode"):
        with t.step() as info:
            info["kind"] = kind
            with t.phase("batch"):
                pass
            with t.phase("target"):
                with t.phase("gather"):
                    sum(range(1000))
    with t.step() as info:
        info["kind"] = None  # not a step: dropped
    s = t.summary()
    assert set(s) == {"all", "decode"}
    assert s["all"]["steps"] == 3 and s["decode"]["steps"] == 2
    for kind in s.values():
        assert list(kind["phases"]) == list(TIMED_PHASES) == list(kind["per_step"])
        total = sum(p["host_ms"] for p in kind["phases"].values())
        assert total == pytest.approx(kind["step_ms"], rel=1e-9, abs=1e-9)
        assert kind["phases"]["gather"]["host_ms"] > 0 and kind["phases"]["draft_0"]["host_ms"] == 0
        assert "device_ms" not in kind["phases"]["target"]  # CPU: host clock only


def test_phase_timer_off_records_nothing_and_rejects_unknown_names():
    off = PhaseTimer(False)
    assert not off and off.summary() == {}
    with off.step():
        assert off.phase("target") is off.phase("batch")  # one shared no-op
    on = PhaseTimer(True)
    with on.step():
        with pytest.raises(ValueError, match="unknown phase 'targets'"):
            on.phase("targets")


# ---------------------------------------------------------------------------- the engine, timed
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """PCP=2, K=2 mixed batches: eager (timed), and the decode-graph path without capture (traced)."""
    eager = pcpviz.run(PROMPTS, pcp=2, num_speculative_tokens=2, cuda_graphs=False, time_phases=True, **MIXED)
    graphs = pcpviz.run(PROMPTS, pcp=2, num_speculative_tokens=2, cuda_graphs=True,
                        trace_dir=str(tmp_path_factory.mktemp("graphs")), **MIXED)
    return eager, graphs


@pytest.mark.slow
def test_engine_phase_breakdown_names_every_phase_and_fits_the_loop(runs):
    eager, _ = runs
    s = eager.phases
    assert s["all"]["steps"] == eager.num_steps and 0 < s["decode"]["steps"] < eager.num_steps
    for kind in s.values():
        assert list(kind["phases"]) == list(TIMED_PHASES)
        total = sum(p["host_ms"] for p in kind["phases"].values())
        assert total == pytest.approx(kind["step_ms"], rel=1e-6)
        assert kind["step_ms"] <= eager.wall_s * 1e3
    ran = {p for p, v in s["all"]["phases"].items() if v["host_ms"] > 0}
    assert {"schedule", "batch", "h2d", "target", "gather", "verify", "draft_0", "draft_k"} <= ran
    assert s["all"]["phases"]["record"]["host_ms"] == 0 and s["all"]["phases"]["capture"]["host_ms"] == 0


@pytest.mark.slow
def test_untimed_run_has_no_breakdown(runs):
    assert runs[1].phases == {}


@pytest.mark.slow
def test_decode_graph_path_gives_the_eager_tokens(runs):
    eager, graphs = runs
    assert graphs.graphs == {"mode": "eager", "captures": 0, "replays": 0, "capture_s": 0.0}
    assert eager.graphs is None
    assert graphs.output_token_ids == eager.output_token_ids
    assert graphs.num_accepted_tokens_per_pos == eager.num_accepted_tokens_per_pos


@pytest.mark.slow
def test_trace_recorded_on_the_graph_path_passes_every_check(runs):
    """Padded decode steps (as vLLM records them under FULL graphs) are still a valid PCP step."""
    import pcpviz.trace as pt
    from pcpviz.analysis.checks import run_checks

    trace = pt.open(runs[1].trace_path)
    decode = [s for s in trace.steps if not trace.record(s, 0, "target")["is_prefilling"].any()]
    assert decode
    for s in decode:  # padded to B requests (a capture size) over 2 ranks, 1 + K tokens each
        rec = trace.record(s, 0, "target")
        b = next(c for c in capture_sizes(16) if c >= len(rec["req_ids"]))
        assert rec["padded_gather_idx"].shape[0] == 2 * (-(-b // 2)) * 3, s
    report = run_checks(trace)
    assert report.ok and not report.failed, report.format()


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
def test_decode_graph_path_at_pcp1_and_other_k(k):
    kw = dict(pcp=1, num_speculative_tokens=k, max_new_tokens=10, max_num_batched_tokens=64, progress=False)
    a = pcpviz.run(PROMPTS[:2], cuda_graphs=False, **kw)
    b = pcpviz.run(PROMPTS[:2], cuda_graphs=True, **kw)
    assert a.output_token_ids == b.output_token_ids


def test_decode_shape_buckets_and_eligibility():
    assert capture_sizes(16) == (1, 2, 4, 8, 16) and capture_sizes(12) == (1, 2, 4, 8, 12)
    s = decode_shape(np.array([3, 3, 1]), np.array([False] * 3), 300, pcp=2, k=2, max_num_seqs=16,
                     shard_decode_requests=True)
    assert (s.num_reqs, s.local_reqs, s.local_tokens, s.tokens, s.max_seq_len) == (4, 2, 6, 12, 512)
    assert decode_shape(np.array([3]), np.array([False]), 10, pcp=1, k=2, max_num_seqs=4,
                        shard_decode_requests=False).max_seq_len == 256
    # not a decode step: a prefill row, or a row longer than 1 + K
    assert decode_shape(np.array([3, 5]), np.array([False, True]), 9, pcp=2, k=2, max_num_seqs=16,
                        shard_decode_requests=True) is None
    assert decode_shape(np.array([4]), np.array([False]), 9, pcp=2, k=2, max_num_seqs=16,
                        shard_decode_requests=True) is None


def test_static_inputs_keep_their_tensors_and_refuse_other_shapes():
    s = StaticInputs({"ids": ((4,), torch.int64), "bt": ((2, 3), torch.int32)}, torch.device("cpu"))
    ids = s.views["ids"]
    s.fill({"ids": np.arange(4), "bt": np.ones((2, 3))})
    assert s.views["ids"] is ids and ids.tolist() == [0, 1, 2, 3] and s.views["bt"].dtype == torch.int32
    with pytest.raises(ValueError, match=r"static input ids: shape \(5,\), captured \(4,\)"):
        s.fill({"ids": np.arange(5)})
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        GraphRunner("capture", torch.device("cpu"))


def test_uploader_on_cpu_converts_dtypes():
    up = Uploader(torch.device("cpu"))
    t = up.upload({"a": (np.array([1, 2], np.int32), torch.int64), "b": (np.zeros((2, 2)), torch.int32)})
    assert t["a"].dtype == torch.int64 and t["a"].tolist() == [1, 2] and t["b"].shape == (2, 2)


# ---------------------------------------------------------------------------- recording
def _steps():
    rng = np.random.default_rng(0)
    out = []
    for step in range(6):
        hidden = torch.tensor(rng.standard_normal((5, 8)), dtype=torch.float32)
        toks = torch.tensor(rng.integers(0, 264, 5))
        out.append((step, {
            "target": {"input_ids": rng.integers(0, 264, 5), "top1_token": Pending(toks),
                       "hidden_hash": Pending(hidden, row_hashes), "t_start_us": np.array(step, np.int64)},
            "draft_0": {"view": np.array("rank_local"), "draft_tokens": Pending(toks[:3])},
        }))
    return out


def _resolved(phases):
    return {ph: {v: (x.resolve(x.tensor.numpy()) if isinstance(x, Pending) else x) for v, x in views.items()}
            for ph, views in phases.items()}


def test_async_recorder_writes_byte_identical_files(tmp_path):
    inline = TraceWriter(tmp_path / "a", 0)
    for step, phases in _steps():
        inline.write_step(step, _resolved(phases))
    inline.close()
    rec = AsyncRecorder(TraceWriter(tmp_path / "b", 0), depth=2)  # a small queue: back-pressure
    for step, phases in _steps():
        rec.submit(step, phases)
    rec.close()
    a = (tmp_path / "a" / "rank0.arrow").read_bytes()
    assert a == (tmp_path / "b" / "rank0.arrow").read_bytes() and len(a) > 1000


class _FailingWriter:
    def __init__(self, path, fail_at):
        self.path, self.fail_at, self.written, self.closed, self.ending = path, fail_at, [], False, None

    def write_step(self, step, phases):
        if step == self.fail_at:
            raise OSError(28, f"{self.path}: cannot write (No space left on device)")
        assert all(not isinstance(v, Pending) for views in phases.values() for v in views.values())
        self.written.append(step)

    def close(self, **ending):  # TraceWriter.close's keywords: status, reason
        self.closed, self.ending = True, ending


def test_async_recorder_failure_is_one_line_and_nothing_after_it_is_written():
    w = _FailingWriter("runs/t/rank0.arrow", fail_at=2)
    rec = AsyncRecorder(w)
    for step, phases in _steps()[:4]:
        try:
            rec.submit(step, phases)
        except OSError:
            break  # the failure surfaced early: fine too
    with pytest.raises(OSError) as err:
        rec.close()
    line = str(err.value)
    assert "\n" not in line and "runs/t/rank0.arrow" in line and "step 2" in line and "No space" in line
    assert w.written == [0, 1] and w.closed
    assert w.ending["status"] == "partial" and "writer failed at step 2" in w.ending["reason"]


def test_step_record_takes_keyword_arguments_only():
    rec = StepRecord(0, 0)
    with pytest.raises(TypeError):
        rec.verify(("r0",), np.zeros(1), None, 2, 0, 1)  # the positional form is gone


# ---------------------------------------------------------------------------- host syncs
_SYNCS = ("cpu", "item", "tolist", "__int__", "__bool__", "__float__")
_ENGINE = ("worker.py", "speculator.py", "record.py", "recorder.py", "inputs.py", "graphs.py", "attention.py")


@pytest.mark.slow
def test_a_step_makes_one_host_sync_in_the_engine(monkeypatch):
    """In-process PCP=1 engine: count tensor -> host conversions made *by the engine's modules*
    while stepping (the CPU-only torch attention reference is not on the CUDA path)."""
    from pcpviz.engine.dist import SingleRank
    from pcpviz.engine.checkpoint import load_model
    from pcpviz.engine.scheduler import Scheduler
    from pcpviz.engine.tokenizer import encode
    from pcpviz.engine.worker import EngineConfig, Worker

    model = load_model(dtype=torch.float32)
    cfg = EngineConfig(pcp=1, num_speculative_tokens=2, block_size=16, num_blocks=64, max_num_seqs=2,
                       max_num_batched_tokens=64)
    worker = Worker(model, SingleRank(), cfg, torch.device("cpu"))
    sched = Scheduler([encode(p) for p in PROMPTS], 8, num_speculative_tokens=2, block_size=16,
                      num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=4096)
    calls: list[str] = []
    main = threading.get_ident()
    for name in _SYNCS:
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, _name=name, **kw):
            f = sys._getframe(1)
            if threading.get_ident() == main and f.f_code.co_filename.endswith(_ENGINE):
                calls.append(f"{_name} {f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}")
            return _orig(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    per_step = []
    while not sched.done:
        plan = sched.schedule()
        calls.clear()
        res = worker.step(plan)
        per_step.append(list(calls))
        sched.update(plan, res.per_request)
        np.testing.assert_array_equal(worker._table, worker.table.as_array())  # kept incrementally
    assert len(per_step) > 3
    for syncs in per_step:  # the sampled tokens' copy to the host, nothing else
        assert len(syncs) == 1 and syncs[0].startswith("cpu worker.py"), syncs


def test_graphs_default_on_cuda_at_pcp1_only():
    from pcpviz.engine.worker import graphs_by_default

    assert graphs_by_default(torch.device("cuda"), 1)
    assert not graphs_by_default(torch.device("cuda"), 2)  # hung at exit on 2 x H200, not diagnosed
    assert not graphs_by_default(torch.device("cpu"), 1)


def test_a_stuck_process_group_teardown_cannot_hold_the_rank(monkeypatch, capsys):
    import torch.distributed as tdist

    from pcpviz.engine import rank_main

    release = threading.Event()
    monkeypatch.setattr(tdist, "is_initialized", lambda: True)
    monkeypatch.setattr(tdist, "barrier", lambda *a, **k: release.wait())  # never returns on its own
    monkeypatch.setattr(tdist, "destroy_process_group", lambda *a, **k: None)
    rank_main._shutdown_process_group(timeout_s=0.2)
    release.set()
    for t in threading.enumerate():  # let the daemon finish while the stand-ins are still in place
        if t.name == "pcpviz-shutdown":
            t.join(5)
    assert "teardown still running after 0 s" in capsys.readouterr().err


def test_teardown_resets_every_graph_before_the_group_goes(monkeypatch):
    """pytorch/pytorch#115388: a live CUDA graph holding NCCL collectives hangs
    destroy_process_group. No graph can be captured on this CPU machine, so the graphs here
    are stand-ins that log their reset; the runner and the teardown are the real ones."""
    import types

    from pcpviz.engine import rank_main

    log = []

    class Graph:  # stand-in for torch.cuda.CUDAGraph (CUDA only)
        def __init__(self, name):
            self.name = name

        def reset(self):
            log.append(f"reset {self.name}")

    runner = GraphRunner("eager", torch.device("cpu"))
    runner._graphs = {("target", 1): (Graph("target"), None), ("draft_k", 1): (Graph("draft_k"), None)}
    runner.inputs(("target", 1), {"ids": ((4,), torch.int64)})
    worker = types.SimpleNamespace(graphs=runner)
    monkeypatch.setattr(rank_main, "_shutdown_process_group", lambda: log.append("shutdown"))
    rank_main._teardown(worker, "cpu")
    assert log == ["reset target", "reset draft_k", "shutdown"]
    assert worker.graphs is None and not runner._graphs and not runner._inputs
    runner.release()  # idempotent


# ---------------------------------------------------------------------------- profiles
@pytest.mark.slow
def test_profile_dir_writes_a_table_and_a_trace_per_rank_with_the_phases(tmp_path):
    import json as _json

    d = tmp_path / "prof"
    res = pcpviz.run(PROMPTS[:1], pcp=2, num_speculative_tokens=2, max_new_tokens=4, profile_dir=str(d),
                     progress=False)
    assert res.phases["all"]["steps"] == res.num_steps  # profile_dir implies time_phases
    for r in (0, 1):
        table = (d / f"profile_rank{r}.txt").read_text()
        assert table.startswith(f"rank {r}: {res.num_steps - 1} steps profiled")
        for name in ("phase:target", "phase:batch", "phase:gather"):
            assert name in table
        events = _json.loads((d / f"profile_rank{r}.json").read_text())["traceEvents"]
        assert any(e.get("name") == "phase:draft_0" for e in events)


@pytest.mark.parametrize("kind,why", [("file", "not a directory"), ("under_file", "cannot create it")])
def test_profile_dir_that_cannot_hold_profiles_is_one_line_naming_the_option(tmp_path, kind, why):
    (tmp_path / "x").write_text("")
    p = tmp_path / "x" if kind == "file" else tmp_path / "x" / "prof"
    with pytest.raises(ValueError, match=rf"^profile_dir {p}: {why}"):
        pcpviz.run(PROMPTS[:1], pcp=1, max_new_tokens=2, profile_dir=str(p), progress=False)
    assert (tmp_path / "x").read_text() == ""  # nothing lost


def test_stack_dump_hook_writes_every_threads_stack(tmp_path, monkeypatch):
    import faulthandler

    from pcpviz.engine import rank_main

    monkeypatch.setenv("PCPVIZ_STACK_DUMP", f"{tmp_path / 'stacks'}:0.2")
    rank_main._stack_dumps(3)
    try:
        time.sleep(0.6)
    finally:
        faulthandler.cancel_dump_traceback_later()
    text = (tmp_path / "stacks" / "stacks_rank3.txt").read_text()
    assert "test_stack_dump_hook_writes_every_threads_stack" in text


def test_plan_broadcast_carries_a_prompt_once_and_round_trips():
    """vLLM's NewRequestData: a request's prompt travels on its first row only (base64 int32),
    later chunks name their start; the JSON document gives back the same plan."""
    import json as _json

    from pcpviz.engine.scheduler import Scheduler, SchedulerOutput

    prompts = [list(range(1, 41)), [7, 8, 9]]
    sched = Scheduler(prompts, 2, num_speculative_tokens=2, block_size=16, num_blocks=64, max_num_seqs=4,
                      max_num_batched_tokens=24, max_model_len=4096)
    first = sched.schedule()
    doc = _json.loads(_json.dumps(first.to_json()))
    back = SchedulerOutput.from_json(doc)
    assert back == first  # the prompt arrays are left out of ==, so compare them too
    [row] = back.rows  # the budget of 24 takes a chunk of the first prompt only
    assert row.is_new and row.prompt_start == 0 and row.num_tokens == 24
    assert row.prompt_token_ids.tolist() == prompts[0]
    sched.update(first, {row.req_id: ([], 0)})
    second = SchedulerOutput.from_json(_json.loads(_json.dumps(sched.schedule().to_json())))
    by_id = {r.req_id: r for r in second.rows}
    assert by_id["req0"].prompt_start == 24 and by_id["req0"].prompt_token_ids is None  # not sent again
    assert by_id["req1"].prompt_token_ids.tolist() == [7, 8, 9]
    bad = _json.loads(_json.dumps(first.to_json()))
    bad["rows"][0]["prompt_len"] = 41
    with pytest.raises(ValueError, match="req0: prompt of 40 tokens, prompt_len 41"):
        SchedulerOutput.from_json(bad)


@pytest.mark.slow
def test_every_run_times_its_steps_and_reads_the_steady_decode_step(runs):
    eager, graphs = runs
    for res in (eager, graphs):
        kinds = [k for k, _ in res.step_ms]
        assert len(res.step_ms) == res.num_steps and all(t > 0 for _, t in res.step_ms)
        assert kinds[0] == "prefill" and "decode" in kinds and set(kinds) == {"prefill", "decode"}
    decode = [t for k, t in eager.step_ms if k == "decode"]
    assert eager.phases["decode"]["steps"] == len(decode)  # the same split as the phase breakdown
    mid = sorted(decode)
    median = (mid[(len(mid) - 1) // 2] + mid[len(mid) // 2]) / 2
    assert eager.steady_decode_ms(skip=0) == pytest.approx(median)
    assert min(decode) <= eager.steady_decode_ms(skip=1) <= max(decode)
    assert eager.steady_decode_ms(skip=len(decode)) is None


def test_static_input_views_start_aligned():
    """Every static input view starts at a multiple of INPUT_ALIGN elements, whatever the lengths of
    the arrays packed before it (Triton specializes kernels on pointer alignment: a view whose
    alignment depended on another array's length recompiled the prefill kernel on one H200)."""
    from pcpviz.engine.decode_graphs import StaticInputs
    from pcpviz.engine.inputs import INPUT_ALIGN, aligned

    spec = {"a": ((3,), torch.int64), "b": ((5, 7), torch.int64), "c": ((1,), torch.int32), "d": ((9,), torch.int32)}
    s = StaticInputs(spec, torch.device("cpu"))
    offsets = {name: v.storage_offset() for name, v in s.views.items()}
    assert all(off % INPUT_ALIGN == 0 for off in offsets.values()), offsets
    assert offsets["b"] == aligned(3) and offsets["d"] == aligned(1)
    s.fill({"a": np.arange(3), "b": np.ones((5, 7)), "c": np.array([4]), "d": np.arange(9)})
    assert s.views["b"].sum().item() == 35 and s.views["d"].tolist() == list(range(9))


@pytest.mark.gpu
def test_uploaded_views_start_aligned():
    from pcpviz.engine.inputs import INPUT_ALIGN

    up = Uploader(torch.device("cuda"))
    t = up.upload({"x": (np.arange(3), torch.int64), "y": (np.arange(5), torch.int64),
                   "z": (np.arange(7), torch.int32)})
    assert all(v.storage_offset() % INPUT_ALIGN == 0 for v in t.values())
    assert t["y"].tolist() == list(range(5)) and t["z"].tolist() == list(range(7))


def test_compile_default_on_for_cuda_and_switchable(monkeypatch):
    from pcpviz.engine.worker import compile_by_default

    monkeypatch.delenv("PCPVIZ_COMPILE", raising=False)
    assert compile_by_default(torch.device("cuda")) and not compile_by_default(torch.device("cpu"))
    monkeypatch.setenv("PCPVIZ_COMPILE", "0")
    assert not compile_by_default(torch.device("cuda"))
    monkeypatch.setenv("PCPVIZ_COMPILE", "1")
    assert compile_by_default(torch.device("cpu"))
