"""A real writer process killed with SIGKILL: every completed step must stay readable.

The writer is ``tests/helpers/trace_kill_writer.py`` run as a subprocess (see its docstring).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pcpviz.trace as pt

REPO = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).resolve().parents[1] / "helpers" / "trace_kill_writer.py"

_spec = importlib.util.spec_from_file_location("trace_kill_writer", HELPER)
helper = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helper)


def _spawn(*args: object) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, str(HELPER), *map(str, args)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        pytest.fail(f"writer exited early (rc={proc.returncode}): {proc.stderr.read()}")
    return line.strip()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    proc.stderr.close()


def _assert_step_equal(trace: pt.Trace, step: int, rank: int, big: int = 0) -> None:
    want = helper.expected_step(step, rank, big)
    assert trace.phases(step, rank) == ["target", "draft_0", "draft_1", "verify"]
    for phase, views in want.items():
        rec = trace.record(step, rank, phase)
        assert list(rec) == list(views)
        for name, value in views.items():
            value = np.asarray(value)
            assert rec[name].shape == value.shape, (step, phase, name)
            assert np.array_equal(rec[name], value), (step, phase, name)


@pytest.mark.parametrize("pause_step", [0, 4])
def test_sigkill_mid_step_keeps_every_completed_step(tmp_path, pause_step):
    run = tmp_path / "run"
    proc = _spawn("pause", run, 10, pause_step)
    try:
        for step in range(pause_step):
            assert _read_line(proc) == f"DONE {step}"
        line = _read_line(proc)
        assert line.startswith("PAUSED ")
        half = int(line.split()[1])
        rank1 = run / "rank1.arrow"
        size_before_kill = rank1.stat().st_size
        os.kill(proc.pid, signal.SIGKILL)  # the process is mid-write of rank 1's step
    finally:
        _kill(proc)
    assert proc.returncode == -signal.SIGKILL
    assert rank1.stat().st_size == size_before_kill and half > 0

    with pytest.warns(pt.TraceWarning, match="rank1.arrow"):
        t = pt.open(run)
    assert t.meta["producer"] == "kill-test"
    assert t.ranks == [0, 1]
    assert t.rank_steps(0) == list(range(pause_step + 1))  # rank 0 completed the step
    assert t.rank_steps(1) == list(range(pause_step))  # rank 1 was killed in it
    assert t.steps == list(range(pause_step + 1))  # complete on at least one rank
    assert not t.has(pause_step, 1, "target") and t.has(pause_step, 0, "target")
    for step in range(pause_step):
        _assert_step_equal(t, step, 0)
        _assert_step_equal(t, step, 1)
    _assert_step_equal(t, pause_step, 0)
    with pytest.raises(KeyError, match=f"step {pause_step}"):
        t.record(pause_step, 1, "target")

    assert len(t.warnings) == 1
    note = t.warnings[0]
    assert str(rank1) in note and "\n" not in note
    last = f"step {pause_step - 1}" if pause_step else "no complete step"
    assert f"last complete step: {last}" in note
    assert not t.files[1].closed and t.files[0].closed is False  # neither writer closed

    with pytest.raises(pt.TraceError, match=str(rank1).replace(".", r"\.")):
        pt.open(run, strict=True)
    # finished is not crashed: no writer wrote its completion record
    status = pt.validate(t)
    assert not status.complete and status.ending == "unfinished"
    assert any("complete.json: missing: no writer finished" in ln for ln in status.lines("incomplete"))


@pytest.mark.slow
def test_sigkill_free_running_writer(tmp_path):
    """Unpatched writer with large steps, killed as soon as the file grows: wherever the kill
    lands, the readable steps are a prefix that includes every step the writer reported done,
    each identical to what was written; a partial tail is reported (and strict refuses it)."""
    run = tmp_path / "run"
    big = 4_000_000  # int64: 32 MB per step, so a write takes long enough to be hit
    proc = _spawn("free", run, 50, big)
    path = run / "rank0.arrow"
    try:
        done = -1
        while done < 1:
            done = int(_read_line(proc).split()[1])
        size_done = path.stat().st_size
        deadline = time.monotonic() + 60
        while path.stat().st_size <= size_done and time.monotonic() < deadline:
            pass
        os.kill(proc.pid, signal.SIGKILL)
        # Lines already printed before the kill: steps that were complete.
        out = proc.stdout.read()
    finally:
        _kill(proc)
    done = max([done] + [int(x.split()[1]) for x in out.splitlines() if x.startswith("DONE ")])
    size = path.stat().st_size

    import warnings

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        t = pt.open(run)
    steps = t.rank_steps(0)
    assert steps == list(range(len(steps))) and len(steps) >= done + 1
    for step in steps:
        _assert_step_equal(t, step, 0, big)
    print(f"killed {'mid-step' if t.warnings else 'between steps'} after step {done}")
    if t.warnings:
        assert t.files[0].good_bytes < size
        with pytest.raises(pt.TraceError, match="rank0.arrow"):
            pt.open(run, strict=True)
    else:
        assert t.files[0].good_bytes == size
        assert pt.open(run, strict=True).rank_steps(0) == steps
    assert pt.validate(t).ending == "unfinished"  # a whole prefix, but the run did not finish
