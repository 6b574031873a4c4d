"""A real trace-writer process for tests/trace/test_trace_kill.py, killed with SIGKILL by the test.

    python trace_kill_writer.py pause RUN_DIR N_STEPS PAUSE_STEP
        Ranks 0 and 1 write steps 0..N_STEPS-1. At PAUSE_STEP rank 0 completes the step, then
        rank 1's write hands the kernel only the first half of the step's bytes, prints
        ``PAUSED <bytes>`` and sleeps: the test kills it there, so the kill lands mid-step
        deterministically. The pause is a monkeypatch of ``pcpviz.trace.writer._write_all``
        (the one function that hands bytes to the kernel) made here, in the test helper; the
        library has no test hook.

    python trace_kill_writer.py free RUN_DIR N_STEPS BIG
        Rank 0 writes steps with a BIG-element int64 payload each, unpatched, as fast as it can;
        the test kills it whenever it sees the file grow (often in the middle of a write).

After each completed ``write_step`` it prints ``DONE <step>``. ``expected_step`` is imported by
the test to know what each step must read back as.
"""

from __future__ import annotations

import sys
import time

import numpy as np


def expected_step(step: int, rank: int, big: int = 0) -> dict[str, dict[str, object]]:
    """Deterministic content of one step on one rank (phases in a shuffled order on purpose)."""
    n = 5 + step % 4
    base = np.arange(n, dtype=np.int64)  # int64[n]
    target = {
        "positions": base + 3 * step,
        "input_ids": (base * 7919 + step * 31 + rank) % 1000,
        "req_ids": [f"req-{step}-{i}" for i in range(3)],
        "is_prefilling": base % 2 == 0,
        "segments": np.array([(0, 0, n, 0, n, rank)], dtype=[
            ("global_req_idx", "<i8"), ("global_start", "<i8"), ("global_stop", "<i8"),
            ("local_start", "<i8"), ("local_stop", "<i8"), ("rank", "<i8")]),
        "block_table_global": np.arange(12, dtype=np.int32).reshape(1, 3, 4) + step,
    }
    if big:
        target["big"] = (np.arange(big, dtype=np.int64) * 2654435761 + step) % 1000003
    return {
        "verify": {"num_accepted": np.array([step % 3, 1, 0], dtype=np.int32)},
        "draft_1": {"view": "replicated", "draft_tokens": base[:3] + step},
        "target": target,
        "draft_0": {"view": "rank_local", "draft_tokens": base[:3] * 2 + step},
    }


def _pause(run_dir: str, n_steps: int, pause_step: int) -> None:
    import pcpviz.trace as pt
    from pcpviz.trace import writer as writer_mod

    real_write_all = writer_mod._write_all
    armed = False

    def half_then_hang(fd, data):
        if not armed:
            return real_write_all(fd, data)
        data = memoryview(data).cast("B")
        real_write_all(fd, data[: len(data) // 2])
        print(f"PAUSED {len(data) // 2}", flush=True)
        time.sleep(600)
        raise SystemExit("not killed")

    writer_mod._write_all = half_then_hang
    w0 = pt.TraceWriter(run_dir, 0, meta={"producer": "kill-test", "pcp": 2})
    w1 = pt.TraceWriter(run_dir, 1)
    for step in range(n_steps):
        w0.write_step(step, expected_step(step, 0))
        armed = step == pause_step
        w1.write_step(step, expected_step(step, 1))
        print(f"DONE {step}", flush=True)
    w0.close()
    w1.close()


def _free(run_dir: str, n_steps: int, big: int) -> None:
    import pcpviz.trace as pt

    with pt.TraceWriter(run_dir, 0, meta={"producer": "kill-test", "pcp": 1}) as w:
        for step in range(n_steps):
            w.write_step(step, expected_step(step, 0, big))
            print(f"DONE {step}", flush=True)


if __name__ == "__main__":
    mode, run_dir, n_steps, arg = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    {"pause": _pause, "free": _free}[mode](run_dir, n_steps, arg)
