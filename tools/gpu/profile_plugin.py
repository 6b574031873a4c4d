"""Where the plugin's time goes on real vLLM (one GPU): cProfile of batch-1 decode, recording off
against the flight recorder and recording on, in one process (bench_plugin_overhead.py's setup).

    python3 tools/gpu/profile_plugin.py --out $OUT/profile_plugin.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pcpviz-profile-"))
    os.environ.update(PCPVIZ_TRACE_DIR=str(work / "trace"), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      VLLM_USE_V2_MODEL_RUNNER="1")
    from bench_plugin_overhead import MODEL, _ids
    from vllm import LLM, SamplingParams

    from pcpviz.trace.flight import FlightConfig
    from pcpviz.vllm import recording

    llm = LLM(model=MODEL, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"}, gpu_memory_utilization=0.3,
              disable_custom_all_reduce=True, enable_prefix_caching=False, max_num_seqs=64, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    flight = FlightConfig(steps=64, signal=None)
    out = io.StringIO()
    prompts = [{"prompt_token_ids": p} for p in _ids(1, 256, 0)]  # the same work in every mode (no prefix cache)
    rec = next(iter(recording.current_session().recorders.values()))
    for mode in ("off", "flight", "record", "off", "flight", "record"):
        recording.set_mode(mode, flight=flight)
        llm.generate(prompts, sp, use_tqdm=False)  # warm
        pr = cProfile.Profile()
        secs0, steps0 = rec.seconds, rec.steps_written
        t0 = time.perf_counter()
        pr.enable()
        llm.generate(prompts, sp, use_tqdm=False)
        pr.disable()
        dt = time.perf_counter() - t0
        steps = rec.steps_written - steps0
        if mode != "off":  # the hooks' host time on vLLM's thread (under cProfile: inflated alike for every mode)
            out.write(f"##### {mode}: {steps} steps recorded, {(rec.seconds - secs0) / max(steps, 1) * 1e6:.1f} us "
                      f"per step inside the hooks (cProfile on); device ring {rec.pack.ring.stats()}\n")
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        out.write(f"===== {mode}: {dt:.4f} s\n{s.getvalue()}\n")
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats("pcpviz", 25)
        out.write(f"----- {mode} pcpviz by cumtime\n{s.getvalue()}\n")
        a.out.write_text(out.getvalue())
    # The same without cProfile: wall time per generate and hook time per step, modes interleaved.
    plain: dict[str, list] = {"off": [], "flight": [], "record": []}
    for r in range(5):
        for mode in list(plain)[r % 3:] + list(plain)[: r % 3]:
            recording.set_mode(mode, flight=flight)
            secs0, steps0 = rec.seconds, rec.steps_written
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            steps = rec.steps_written - steps0
            plain[mode].append((round(dt, 5), round((rec.seconds - secs0) / max(steps, 1) * 1e6, 1) if steps else 0.0))
    out.write("===== without cProfile, 5 interleaved repeats: (seconds, hook us per step)\n")
    for mode, v in plain.items():
        out.write(f"{mode}: {v}\n")
    a.out.write_text(out.getvalue())
    recording.set_mode("off")
    return 0


if __name__ == "__main__":
    sys.exit(main())
