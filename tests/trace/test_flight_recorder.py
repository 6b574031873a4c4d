"""Flight-recorder mode (issue 24 item 3, ``pcpviz.trace.flight``): the last N steps per rank in
host memory, nothing written while healthy, a normal trace dumped on low acceptance, a signal, an
exception in a step or shutdown. On the ring itself, on the engine (``pcpviz run``, 2 CPU ranks)
and through the vLLM recording classes (the CPU replay); real vLLM: tools/gpu/jobs.py flight-pcp1."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pcpviz.trace as pt
from pcpviz.analysis.checks import run_checks
from pcpviz.trace.flight import FlightConfig, FlightRing

REPO = Path(__file__).resolve().parents[2]


def _step(accepted: int, drafted: int, size: int = 4) -> dict:
    return {"target": {"positions": np.arange(size)},
            "verify": {"num_accepted": np.array([accepted]), "num_draft_tokens": np.array([drafted])}}


def _ring(tmp_path, **kw) -> FlightRing:
    cfg = FlightConfig(**{"steps": 4, "signal": None, **kw})
    return FlightRing(cfg, tmp_path, 0, lambda: {"producer": "test", "pcp": 1, "block_size": 16})


def test_config_from_env_and_bad_values():
    assert FlightConfig.from_env({}) is None and FlightConfig.from_env({"PCPVIZ_FLIGHT_RECORDER": "0"}) is None
    c = FlightConfig.from_env({"PCPVIZ_FLIGHT_RECORDER": "64", "PCPVIZ_FLIGHT_ACCEPTANCE": "0.3",
                               "PCPVIZ_FLIGHT_SIGNAL": "usr2"})
    assert (c.steps, c.acceptance, c.window, c.signal) == (64, 0.3, 32, signal.SIGUSR2)
    for env, text in [({"PCPVIZ_FLIGHT_RECORDER": "x"}, "PCPVIZ_FLIGHT_RECORDER='x': expected an integer"),
                      ({"PCPVIZ_FLIGHT_RECORDER": "8", "PCPVIZ_FLIGHT_ACCEPTANCE": "2"}, "in 0..1"),
                      ({"PCPVIZ_FLIGHT_RECORDER": "8", "PCPVIZ_FLIGHT_SIGNAL": "SIGNOPE"}, "not a signal name")]:
        with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
            FlightConfig.from_env(env)


def test_healthy_runs_write_nothing_and_shutdown_dumps_the_last_n_steps(tmp_path):
    ring = _ring(tmp_path)
    for s in range(10):
        ring.write_step(s, _step(1, 2))
    assert list(tmp_path.iterdir()) == []  # nothing on disk while healthy
    ring.close()
    (dump,) = sorted(tmp_path.iterdir())
    assert dump.name == "flight-000-shutdown"
    t = pt.open(dump)
    assert t.steps == [6, 7, 8, 9] and pt.validate(t).ok and pt.validate(t).ending == "complete"
    assert t.meta["flight_recorder"]["trigger"] == "shutdown" and t.meta["flight_recorder"]["steps"] == [6, 9]


def test_low_acceptance_over_the_window_dumps_once_then_cools_down(tmp_path):
    ring = _ring(tmp_path, acceptance=0.5, window=3)
    for s, acc in enumerate([2, 2, 2, 0, 0, 0, 0, 0]):  # the window's rate: 1, 1, 1, .67, .33 -> dump at step 4
        ring.write_step(s, _step(acc, 2))
    dumps = sorted(tmp_path.iterdir())
    assert [d.name for d in dumps] == ["flight-000-acceptance"]
    t = pt.open(dumps[0])
    assert t.steps == [1, 2, 3, 4] and "acceptance 0.333 < 0.5 over 3 steps" in t.meta["flight_recorder"]["trigger"]
    ring.write_step(8, _step(0, 2))  # cooldown (3 steps) over: the rate is still low
    assert len(list(tmp_path.iterdir())) == 2


def test_memory_cap_keeps_fewer_steps_with_one_warning(tmp_path, caplog):
    ring = _ring(tmp_path, steps=100, max_bytes=3000)
    with caplog.at_level(logging.WARNING, logger="pcpviz.flight"):
        for s in range(50):
            ring.write_step(s, _step(1, 2, size=100))  # ~816 bytes a step
    assert ring.bytes <= 3000 and len(ring.ring) == 3
    assert len([r for r in caplog.records if "PCPVIZ_FLIGHT_MAX_MB" in r.getMessage()]) == 1


def test_dump_budget_and_exception_trigger(tmp_path, caplog):
    ring = _ring(tmp_path, max_dumps=1)
    ring.write_step(0, _step(1, 2))
    with caplog.at_level(logging.WARNING, logger="pcpviz.flight"):
        ring.close(status="partial", reason="RuntimeError: CUDA error")
        assert ring.dump("signal SIGUSR1") is None
    assert [d.name for d in tmp_path.iterdir()] == ["flight-000-exception"]
    assert any("PCPVIZ_FLIGHT_MAX_DUMPS" in r.getMessage() for r in caplog.records)


def test_a_signal_dumps_from_a_helper_thread(tmp_path):
    cfg = FlightConfig(steps=4, signal=signal.SIGUSR1)
    ring = FlightRing(cfg, tmp_path, 0, lambda: {"producer": "test", "pcp": 1, "block_size": 16})
    try:
        for s in range(3):
            ring.write_step(s, _step(1, 2))
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not list(tmp_path.glob("flight-000-signal/complete.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pt.open(tmp_path / "flight-000-signal").steps == [0, 1, 2]
    finally:
        ring.closed = True
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


# --------------------------------------------------------------------------- the engine

def _engine(trace: Path, env: dict, tokens: int = 24) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    cmd = [sys.executable, "-m", "pcpviz.cli", "run", "--pcp", "2", "--mtp", "2", "--device", "cpu", "--prompt",
           "def fib(n):", "--max-new-tokens", str(tokens), "--trace", str(trace), "--quiet"]
    return subprocess.run(cmd, env=e, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_engine_dumps_the_same_steps_a_full_recording_holds(tmp_path):
    full, flight = tmp_path / "full", tmp_path / "flight"
    assert _engine(full, {}).returncode == 0
    res = _engine(flight, {"PCPVIZ_FLIGHT_RECORDER": "6"})
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in flight.iterdir()) == ["flight-000-shutdown"]  # no rank file, no run.json
    dump, ref = pt.open(flight / "flight-000-shutdown"), pt.open(full)
    assert dump.ranks == [0, 1] and dump.steps == ref.steps[-6:]
    for step in dump.steps:
        for r in (0, 1):
            for ph in ref.phases(step, r):
                a, b = ref.record(step, r, ph), dump.record(step, r, ph)
                assert set(a) == set(b) and all(np.array_equal(a[v], b[v]) for v in a if not v.startswith("t_"))
    report = run_checks(dump)
    assert report.ok and not report.failed, report.format()


@pytest.mark.slow
def test_the_engine_dumps_on_low_acceptance(tmp_path):
    res = _engine(tmp_path / "t", {"PCPVIZ_FLIGHT_RECORDER": "4", "PCPVIZ_FLIGHT_ACCEPTANCE": "0.99",
                                   "PCPVIZ_FLIGHT_WINDOW": "3", "PCPVIZ_FLIGHT_MAX_DUMPS": "1"})
    assert res.returncode == 0, res.stderr
    (dump,) = sorted((tmp_path / "t").iterdir())
    assert dump.name == "flight-000-acceptance"
    t = pt.open(dump)
    assert t.ranks == [0, 1] and len(t.steps) == 4 and pt.validate(t).ok


# --------------------------------------------------------------------------- the vLLM recording classes

@pytest.mark.slow
def test_the_vllm_recorder_keeps_a_ring_and_dumps_at_shutdown(tmp_path):
    from pcpviz.vllm import cpu_patches

    cpu_patches.apply_cpu_patches()  # before the recording classes import vLLM's worker modules
    from pcpviz.vllm import recording

    cfg = FlightConfig(steps=3, signal=None)
    with recording.session(tmp_path / "t", producer="test", meta={"pcp": 1, "block_size": 4}, strict=True,
                           flight=cfg) as s:
        rec = s.recorder_for_rank(0, 1)
        for step in range(5):
            rec.begin_step()
            rec.put("target", positions=np.arange(4) + step)
        assert not (tmp_path / "t" / "rank0.arrow").exists()
    t = pt.open(tmp_path / "t" / "flight-000-shutdown")
    assert t.steps == [2, 3, 4] and pt.validate(t).ending == "complete"
