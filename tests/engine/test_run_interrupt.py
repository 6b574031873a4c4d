"""Finished is not crashed (issue 20 item 3): ``pcpviz run`` interrupted in every way a run ends
early, then ``pcpviz check`` on what it left.

* SIGINT / SIGTERM to the launcher: exit 130 / 143, one line, no traceback; every rank file is
  finalized (end-of-stream marker) and ``complete.json`` marks it partial; check exits 3 and says
  "partial: stopped by SIGINT".
* SIGKILL of the launcher (its ranks die with it) or of one rank: no completion record for the
  killed writers; check exits 3 naming what did not finish.
* A run that finishes: complete, check exits 0.

Each case is a real 2-rank CPU run of the shipped model, stopped once its first steps are on disk.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # multi-process engine runs stopped by signals

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run(trace: Path, tokens: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pcpviz.cli", "run", "--pcp", "2", "--mtp", "2", "--device", "cpu",
           "--prompt", "def fib(n):", "--max-new-tokens", str(tokens), "--trace", str(trace), "--quiet"]
    return subprocess.Popen(cmd, env=ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(proc: subprocess.Popen, trace: Path, min_bytes: int = 8000) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"run ended early (rc={proc.returncode}): {proc.stderr.read()}")
        try:
            if all((trace / f"rank{r}.arrow").stat().st_size > min_bytes for r in (0, 1)):
                return
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    proc.kill()
    pytest.fail("no steps on disk after 240 s")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _check(trace: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pcpviz.cli", "check", str(trace)], env=ENV, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_the_run_cleanly_and_marks_the_trace_partial(tmp_path, sig, code):
    import pcpviz.trace as pt

    trace = tmp_path / "t"
    proc = _run(trace, 400)
    _wait_for_steps(proc, trace)
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    name = signal.Signals(sig).name
    assert proc.returncode == code, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    line = [ln for ln in err.splitlines() if ln.strip()]
    assert len(line) == 1 and f"stopped by {name}" in line[0] and "marked partial" in line[0], err
    t = pt.open(trace)
    assert all(f.closed and f.finalizes for f in t.files.values())  # end-of-stream marker on both
    assert t.rank_steps(0) == t.rank_steps(1) and len(t.steps) >= 1  # the ranks stopped together
    status = pt.validate(t)
    assert not status.complete and status.ending == f"partial: stopped by {name} (rank 0)"
    res = _check(trace)
    assert res.returncode == 3, res.stderr
    assert f"partial: stopped by {name}" in res.stderr and "rank1.arrow" in res.stderr


def test_sigkill_of_the_launcher_leaves_an_unfinished_trace(tmp_path):
    trace = tmp_path / "t"
    proc = _run(trace, 400)
    _wait_for_steps(proc, trace)
    ranks = _children(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    for pid in ranks:  # PR_SET_PDEATHSIG: the ranks die with their launcher
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not (trace / "complete.json").exists()
    res = _check(trace)
    assert res.returncode == 3, (res.stdout, res.stderr)
    assert "complete.json: missing: no writer finished this trace" in res.stderr


def test_sigkill_of_one_rank_is_reported_for_that_rank(tmp_path):
    trace = tmp_path / "t"
    proc = _run(trace, 400)
    _wait_for_steps(proc, trace)
    rank1 = _children(proc.pid)[1]
    os.kill(rank1, signal.SIGKILL)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 1 and "rank 1 failed" in err, err
    res = _check(trace)
    assert res.returncode == 3, (res.stdout, res.stderr)
    assert "rank1.arrow: rank 1 did not finish" in res.stderr, res.stderr
    assert "rank0.arrow: partial:" in res.stderr  # rank 0 failed on its dead peer, closed cleanly


def test_a_finished_run_is_complete(tmp_path):
    import pcpviz.trace as pt

    trace = tmp_path / "t"
    proc = _run(trace, 8)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    status = pt.validate(pt.open(trace))
    assert status.ok and status.ending == "complete"
    assert _check(trace).returncode == 0
