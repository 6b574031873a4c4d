"""A library host does not swallow its own termination (issue 39 item 3): ``pcpviz.run`` inside
``try: ... except Exception: pass`` and SIGTERM (or SIGINT) mid-run. The trace is finalized and
marked partial, then the signal reaches the host as if pcpviz were not there: the default SIGTERM
action ends it (-15, a shell's 143), SIGINT's KeyboardInterrupt ends it (130). A real 1-rank CPU
run of the shipped model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # an engine run stopped by a signal

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))

HOST = textwrap.dedent("""
    import sys, pcpviz
    try:
        pcpviz.run(["def fib(n):"], pcp=1, num_speculative_tokens=2, max_new_tokens=4000,
                   trace_dir=sys.argv[1], progress=False)
    except Exception as e:
        print("swallowed", type(e).__name__, flush=True)
    print("host carried on", flush=True)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM])  # SIGINT takes the same path (KeyboardInterrupt: 130)
def test_a_host_catching_exception_still_dies_of_the_signal(tmp_path, sig):
    import pcpviz.trace as pt

    trace = tmp_path / "t"
    proc = subprocess.Popen([sys.executable, "-c", HOST, str(trace)], env=ENV, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not ((trace / "rank0.arrow").exists() and (trace / "rank0.arrow").stat().st_size > 8000):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    assert "host carried on" not in out and "swallowed" not in out, (out, err)
    assert proc.returncode == -sig, (proc.returncode, err)  # died of the signal: 143 / 130 in a shell
    status = pt.validate(pt.open(trace))
    assert status.ending == f"partial: stopped by {signal.Signals(sig).name} (rank 0)", status.ending
