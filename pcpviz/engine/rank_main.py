"""The process of one PCP rank.

``pcpviz.run`` starts N of these itself; to span hosts, start them with torchrun,
which sets the same env:// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT)::

    pcpviz run --pcp 2 --device cuda --prompt "def f(" --trace runs/t --write-config run.cfg.json
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m pcpviz.engine.rank_main run.cfg.json                 # on every host

Rank 0 owns the scheduler and broadcasts each step's plan; every rank writes its
own trace file, and rank 0 the result JSON. SIGINT/SIGTERM stop the run between two steps
(``stop_requested``): every rank closes its trace ``partial`` and exits 0. An exception on any rank is written
to ``error_rank<r>.txt`` next to the result so the launcher can name the rank.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from pcpviz.engine.run_config import RunConfig
from pcpviz.engine.stops import STOP_KEY, catch_rank_stops, stop_requested

__all__ = ["main", "run_rank"]


def run_rank(cfg: RunConfig) -> dict | None:
    """One rank's run of ``cfg`` (``build_config``'s ``RunConfig``): set up, step until rank 0's scheduler
    is done or a stop arrives, write ``rank<r>.json``, leave the group. Rank 0 returns the run's
    result (the launcher's ``result.json``), the other ranks None."""
    import torch

    from pcpviz.engine.phase_timer import PhaseTimer
    from pcpviz.engine.recorder import AsyncRecorder
    from pcpviz.engine.worker import Worker
    from pcpviz.trace import TraceWriter
    from pcpviz.trace.completion import PARTIAL

    rank = int(os.environ.get("RANK", "0"))
    group, device, model = _set_up(cfg)
    ecfg = _engine_config(cfg, group.world_size)
    timer = PhaseTimer(bool(cfg.time_phases), device)
    profiler = _profiler(cfg, rank, timer)
    worker = Worker(model, group, ecfg, device, record=cfg.trace_dir is not None, timer=timer)
    # The launcher claimed the directory and cleared it (pcpviz.trace.owner); the rank file is
    # created exclusively, so a file this run did not create is never replaced. Steps are
    # written by a background thread (pcpviz.engine.recorder): the loop never waits on disk.
    writer = AsyncRecorder(_trace_sink(cfg, rank, TraceWriter)) if cfg.trace_dir else None
    sched = _scheduler(cfg, ecfg, model) if rank == 0 else None
    loop = _StepLoop(rank, sched, worker, writer=writer, timer=timer, profiler=profiler,
                     k=ecfg.num_speculative_tokens)
    loop.run()
    if cfg.device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - loop.t_start
    if profiler is not None:
        profiler.close()
    if writer is not None:  # waits for the queued steps; a writer failure is raised here (one line)
        writer.close(**({"status": PARTIAL, "reason": f"stopped by {loop.stopped}"} if loop.stopped else {}))
    info = _rank_info(rank, worker, timer)
    with open(os.path.join(cfg.work_dir, f"rank{rank}.json"), "w") as f:
        json.dump(info, f)  # on disk before the group goes: a stuck teardown loses nothing
    _teardown(worker, cfg.device)
    return None if sched is None else _result(loop, wall, info)


def _set_up(cfg: RunConfig):
    """(process group, device, model): the group joined, the device chosen, the model loaded
    in the run's dtype and warmed up."""
    import torch

    from pcpviz.engine.checkpoint import load_model
    from pcpviz.engine.dist import init_process_group

    device_kind = cfg.device
    group = init_process_group(device_kind, cfg.timeout_s, cfg.store_file)
    if device_kind == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.world_size))
    torch.manual_seed(cfg.seed)
    model = load_model(cfg.model_dir, device=device, dtype=getattr(torch, cfg.dtype))
    model.eval()
    if model.config.is_moe:  # its MoE layers gather and reduce-scatter over PCP (pcpviz.engine.moe)
        model.moe_comm = group
    if cfg.warmup:
        # A dummy forward (no cache, no KV gather: vLLM's profile run skips it too; the MoE
        # model's MoE layers still gather their rows and reduce-scatter, on every rank, as vLLM's
        # do in dummy runs) so the first timed step does not pay for kernel/library initialisation.
        with torch.no_grad():
            ids = torch.arange(16, device=device) % model.config.vocab_size
            model.forward(ids, attn=None)
        if device_kind == "cuda":
            torch.cuda.synchronize()
    return group, device, model


def _engine_config(cfg: RunConfig, pcp: int):
    import torch

    from pcpviz.engine.worker import EngineConfig

    return EngineConfig(
        pcp=pcp, num_speculative_tokens=cfg.num_speculative_tokens,
        block_size=cfg.block_size, num_blocks=cfg.num_blocks, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        shard_decode_requests=cfg.shard_decode_requests, faults=frozenset(cfg.inject),
        dtype=getattr(torch, cfg.dtype), cuda_graphs=cfg.cuda_graphs,
        dcp=cfg.dcp, dcp_interleave=cfg.dcp_interleave,
    )


def _profiler(cfg: RunConfig, rank: int, timer):
    """A torch.profiler per step after the first (``profile_dir``), or None."""
    if not cfg.profile_dir:
        return None
    from pcpviz.engine.profile import StepProfiler

    timer.labels = True
    return StepProfiler(cfg.profile_dir, rank, cfg.device)


def _scheduler(cfg: RunConfig, ecfg, model):
    """Rank 0's continuous-batching scheduler over the run's prompts."""
    from pcpviz.engine.scheduler import Scheduler

    return Scheduler(
        cfg.prompt_token_ids, cfg.max_new_tokens, num_speculative_tokens=ecfg.num_speculative_tokens,
        block_size=ecfg.block_size * ecfg.dcp, num_blocks=ecfg.num_blocks, max_num_seqs=ecfg.max_num_seqs,
        max_num_batched_tokens=ecfg.max_num_batched_tokens,
        max_model_len=model.config.max_position_embeddings, eos_token_id=cfg.eos_token_id,
    )


def _debug_exit() -> tuple[int, int] | None:
    """(rank, step) of ``PCPVIZ_DEBUG_EXIT_RANK=r@step``: the test hook of a rank that dies without a word."""
    if not os.environ.get("PCPVIZ_DEBUG_EXIT_RANK"):
        return None
    r, _, s = os.environ["PCPVIZ_DEBUG_EXIT_RANK"].partition("@")
    return int(r), int(s)


class _StepLoop:
    """The rank's steps: a plan (rank 0's, broadcast), the worker's step, its record, and on rank 0
    the scheduler's update, the acceptance counts and the progress line."""

    def __init__(self, rank: int, sched, worker, *, writer, timer, profiler, k: int) -> None:
        from pcpviz.trace.acceptance import Counts

        self.rank, self.sched, self.worker = rank, sched, worker
        self.writer, self.timer, self.profiler = writer, timer, profiler
        self.debug_exit = _debug_exit()
        self.counts = Counts().widened(max(k, 0))
        self.steps = 0
        self.stopped: str | None = None  # the signal that stopped the run between two steps (_next_plan)
        self.step_ms: list[tuple[str, float]] = []  # (kind, wall ms) of every step, from the plan to the verdict
        self.last_said = 0.0
        self.t_start = time.perf_counter()

    def run(self) -> None:
        """Every step until the plan runs out; on an error the completed steps reach the disk
        (the trace closed ``partial``) before it is raised."""
        from pcpviz.trace.completion import PARTIAL

        self.t_start = time.perf_counter()
        try:
            while self.step():
                pass
        except BaseException as exc:
            if self.writer is not None:
                try:
                    self.writer.close(status=PARTIAL, reason=" ".join(f"{type(exc).__name__}: {exc}".split())[:200])
                except BaseException:  # noqa: BLE001 - the step's own error is the one to report
                    pass
            raise

    def step(self) -> bool:
        """One step; False when the run is over (no plan: done, or stopped)."""
        from pcpviz.trace.acceptance import count
        from pcpviz.engine.scheduler import SchedulerOutput

        timer, writer, sched = self.timer, self.writer, self.sched
        t_step = time.perf_counter()
        with timer.step() as step_info:
            with timer.phase("schedule"):
                plan, self.stopped = _next_plan(sched, self.worker.group, SchedulerOutput)
            if plan is None:
                step_info["kind"] = None  # the closing broadcast: not a step
                return False
            if self.debug_exit == (self.rank, plan.step):
                if writer is not None:
                    writer.flush()  # its completed steps on disk, as an inline writer would leave them
                os._exit(17)  # test hook: a rank that dies without a word (PCPVIZ_DEBUG_EXIT_RANK=r@step)
            kind = "prefill" if any(row.is_prefilling for row in plan.rows) else "decode"
            if kind == "decode":
                step_info["kind"] = "decode"
            if self.profiler is not None:
                self.profiler.before_step(self.steps)
            res = self.worker.step(plan)
            if writer is not None:
                with timer.phase("record"):
                    writer.submit(plan.step, res.record.phases)
            self.steps += 1
            if sched is not None:
                with timer.phase("schedule"):
                    sched.update(plan, res.per_request)
                    self.counts = self.counts + count(res.num_accepted, res.num_draft_tokens)
                    self.last_said = progress_line(sched, plan.step, self.last_said)
        self.step_ms.append((kind, 1e3 * (time.perf_counter() - t_step)))
        return True


def _rank_info(rank: int, worker, timer) -> dict:
    """``rank<r>.json``: the KV-cache digest, collectives, phases and CUDA-graph counts."""
    info = {"rank": rank, "kv_cache_digest": worker.cache.digest(), "num_collectives": worker.group.num_collectives,
            "phases": timer.summary()}
    if worker.graphs is not None:
        info["graphs"] = {"mode": worker.graphs.mode, "captures": worker.graphs.num_captures,
                          "replays": worker.graphs.num_replays, "capture_s": worker.graphs.capture_s}
        if worker.graphs.failed:
            info["graphs"]["capture_failed"] = sorted({v for v in worker.graphs.failed.values()})
    return info


def _result(loop: _StepLoop, wall: float, info: dict) -> dict:
    """Rank 0's result: every request's tokens, acceptance by pcpviz.trace.acceptance's
    definitions (None, JSON null, where nothing was drafted), the timings."""
    from pcpviz.trace.acceptance import json_ratio

    counts = loop.counts
    return {
        "requests": [
            {"req_id": r.req_id, "prompt_token_ids": r.prompt, "output_token_ids": r.output}
            for r in loop.sched.requests
        ],
        "num_steps": loop.steps,
        "stopped": loop.stopped,
        "num_drafts": counts.num_drafts,
        "num_draft_tokens": counts.num_draft_tokens,
        "num_accepted_tokens_per_pos": list(counts.accepted_per_position),
        "acceptance_rate_per_pos": [json_ratio(x) for x in counts.rate_per_position],
        "acceptance_rate": json_ratio(counts.acceptance_rate),
        "mean_acceptance_length": json_ratio(counts.mean_acceptance_length),
        "wall_s": wall,
        "step_ms": loop.step_ms,
        "phases": info["phases"],
        "graphs": info.get("graphs"),
    }


def _trace_sink(cfg: RunConfig, rank: int, writer_cls):
    """Where the rank's steps go: its rank file, or in flight-recorder mode
    (``PCPVIZ_FLIGHT_RECORDER``, ``pcpviz.trace.flight``) a ring of its last steps that is dumped
    as a trace on low acceptance, a signal, an exception or the end of the run."""
    from pcpviz.trace.flight import FlightConfig, FlightRing

    flight = FlightConfig.from_env()
    if flight is None:
        return writer_cls(cfg.trace_dir, rank, owner=cfg.trace_owner)
    from pcpviz.engine.trace_dir import trace_meta

    return FlightRing(flight, cfg.trace_dir, rank, lambda: trace_meta(cfg))


def _next_plan(sched, group, plan_cls):
    """``(plan, stopped)``: the step's plan (None: the run is over), on every rank. Rank 0 keeps
    its own plan; the others rebuild it from the broadcast JSON. A stop (SIGINT/SIGTERM on rank 0)
    travels in place of the plan, between two steps: ``stopped`` names the signal."""
    plan = None
    stop = stop_requested() if sched is not None else None
    if sched is not None and not sched.done and stop is None:
        plan = sched.schedule()
        if not plan.rows:
            raise RuntimeError(f"step {plan.step}: the scheduler found nothing to run "
                               "(max_num_batched_tokens too small for a decode of 1+K tokens?)")
    out = {STOP_KEY: stop} if stop else (None if plan is None else plan.to_json())
    doc = group.broadcast_json(out) if group.world_size > 1 else (out if stop else plan)
    if isinstance(doc, dict) and STOP_KEY in doc:
        return None, str(doc[STOP_KEY])
    if doc is not None and plan is None:
        plan = plan_cls.from_json(doc)
    return plan, None


PIPE_EVERY_S = 0.1  # the launcher's bar needs no more; a line per step costs the decode loop


def progress_line(sched, step: int, last_said: float) -> float:
    """Rank 0's progress after ``step``: new tokens so far and prompt tokens prefilled so far.

    Started by ``pcpviz.run`` (``PCPVIZ_PROGRESS=pipe``) it prints a machine line at most every
    0.1 s and after the last step, ``PCPVIZ_PROGRESS {"step": 3, "tokens": 12, "prefill":
    [20001, 20001]}``, for the launcher's progress bar; started by torchrun, a line for people at
    most every 2 s and at the end:
    ``pcpviz rank 0: step 3, prefill 20001/20001 prompt tokens, 12/32 new tokens``.
    Returns the time of the last line."""
    pipe = os.environ.get("PCPVIZ_PROGRESS") == "pipe"
    now = time.monotonic()
    if now - last_said < (PIPE_EVERY_S if pipe else 2.0) and not sched.done:
        return last_said
    done = sum(len(r.output) for r in sched.requests)
    prefill = [sum(min(r.num_computed, len(r.prompt)) for r in sched.requests),
               sum(len(r.prompt) for r in sched.requests)]
    if pipe:
        print("PCPVIZ_PROGRESS " + json.dumps({"step": step, "tokens": done, "prefill": prefill}), flush=True)
    else:
        total = sum(r.max_new_tokens for r in sched.requests)
        print(f"pcpviz rank 0: step {step}, prefill {prefill[0]}/{prefill[1]} prompt tokens, "
              f"{done}/{total} new tokens", flush=True)
    return now


SHUTDOWN_TIMEOUT_S = 30.0


def _teardown(worker, device_kind: str) -> None:
    """Release the worker's CUDA graphs, then leave the process group (bounded). The order
    matters: graphs that captured NCCL collectives make the group's destruction hang
    (``GraphRunner.release``), so every rank resets its graphs before the barrier that
    precedes it."""
    if worker.graphs is not None:
        worker.graphs.release()
        worker.graphs = None
        if device_kind == "cuda":
            import torch

            torch.cuda.synchronize()
    _shutdown_process_group()


def _shutdown_process_group(timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Leave the group cleanly: a barrier (no peer is still talking to us), then destroy it.

    Bounded: the teardown runs in a daemon thread and the rank goes on after ``timeout_s``
    (everything is on disk by then and the rank leaves with ``os._exit``). On 2 x H200 one PCP=2
    run with CUDA graphs produced every token and never returned; a teardown stuck on the NCCL
    communicator is the suspect, so it can no longer hold the run."""
    import threading

    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()):
        return

    def leave() -> None:
        tdist.barrier()
        tdist.destroy_process_group()

    t = threading.Thread(target=leave, name="pcpviz-shutdown", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        print(f"pcpviz: process-group teardown still running after {timeout_s:.0f} s; leaving without it",
              file=sys.stderr, flush=True)


def _stack_dumps(rank: int) -> None:
    """Debug hook for a rank that hangs: ``PCPVIZ_STACK_DUMP=DIR[:SECONDS]`` writes every
    thread's Python stack to ``DIR/stacks_rank<r>.txt`` every SECONDS (default 60) while the
    rank lives (``faulthandler``; the file is appended to, newest dump last)."""
    spec = os.environ.get("PCPVIZ_STACK_DUMP")
    if not spec:
        return
    import faulthandler

    d, _, secs = spec.partition(":")
    try:
        os.makedirs(d, exist_ok=True)
        f = open(os.path.join(d, f"stacks_rank{rank}.txt"), "a")  # noqa: SIM115 - lives with the process
        faulthandler.dump_traceback_later(float(secs or 60), repeat=True, file=f)
    except (OSError, ValueError) as exc:
        print(f"pcpviz: rank {rank}: PCPVIZ_STACK_DUMP={spec!r} ignored: {exc}", file=sys.stderr, flush=True)


def _exit_now(code: int) -> None:
    """Leave the process without interpreter teardown, once every result is on disk.

    A rank exiting normally runs Python's finalization and then the C++ static destructors
    of torch/gloo; a gloo or store thread still joinable when its ``std::thread`` is destroyed
    there calls ``std::terminate`` ("terminate called without an active exception", SIGABRT,
    exit -6) although all work is done. Nothing is left to clean up by then (files written
    and closed, the group destroyed), so the rank flushes its streams and calls ``os._exit``."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pcpviz.engine.rank_main CONFIG.json", file=sys.stderr)
        return 2
    try:
        cfg = RunConfig.from_json(argv[0])
        world = os.environ.get("WORLD_SIZE", "1")
        if world != str(cfg.pcp):
            raise ValueError(f"{argv[0]}: pcp: {cfg.pcp}, but WORLD_SIZE is {world} (start as many ranks as pcp)")
        if cfg.work_dir is None:
            raise ValueError(f"{argv[0]}: work_dir: missing (write the file with pcpviz run --write-config)")
    except ValueError as exc:
        print(f"pcpviz rank: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    out_dir = cfg.work_dir
    catch_rank_stops()
    _stack_dumps(rank)
    try:
        result = run_rank(cfg)
        if result is not None:
            tmp = os.path.join(out_dir, "result.json.tmp")
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, os.path.join(out_dir, "result.json"))
        return 0
    except BaseException as e:  # noqa: BLE001 - report every failure with the rank named
        line = " ".join(f"{type(e).__name__}: {e}".split())
        # stderr first: on a full disk the error file below cannot be written
        print(f"PCPVIZ_ERROR {line}", file=sys.stderr, flush=True)
        try:
            with open(os.path.join(out_dir, f"error_rank{rank}.txt"), "w") as f:
                f.write(f"{line}\n\n{traceback.format_exc()}")
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    _exit_now(main())
