"""No orphans (issue 39 item 2): ``pcpviz check|diff|export|explain`` stopped by SIGTERM, SIGINT
or SIGKILL while its forked workers (``PCPVIZ_WORKERS=2``; 3 for export, whose own process builds
a part) are at work leaves none of them running: a worker dies with its parent
(PR_SET_PDEATHSIG), and a stop in the parent kills the pool. A synthetic trace of ~320 steps keeps
two workers busy for seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tracegen import RequestSpec, generate

pytestmark = pytest.mark.slow  # forked worker pools, real signals

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def long_trace(tmp_path_factory):
    run = generate([RequestSpec(f"r{i}", 30, 700) for i in range(3)], pcp=2, num_speculative_tokens=2,
                   max_num_batched_tokens=64)
    return run.write(tmp_path_factory.mktemp("long") / "t")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


_CLI = ["-m", "pcpviz.cli"]
# The Chrome export forks ``workers - 1`` children per window of chunks (``fork_map``; this process builds
# the first part) and builds ~320 steps in a blink: small chunks and a pause per step keep two children
# of PCPVIZ_WORKERS=3 at work for seconds.
_SLOW_EXPORT = ["-c", "import sys, time; import pcpviz.views.export.chrome as c; c.CHUNK_STEPS = 40; "
                "c.WINDOW_CHUNKS = 4; f = c._step_events; "
                "c._step_events = lambda *a, **k: time.sleep(0.01) or f(*a, **k); "
                "from pcpviz.cli.commands import main; sys.exit(main(sys.argv[1:]))"]


@pytest.mark.parametrize("run, workers, argv, sig", [
    (_CLI, 2, ["check", "{t}"], signal.SIGTERM),
    (_CLI, 2, ["check", "{t}"], signal.SIGINT),
    (_SLOW_EXPORT, 3, ["export", "{t}", "--chrome", "{o}/c.json"], signal.SIGTERM),
    (_CLI, 2, ["diff", "{t}", "{t}"], signal.SIGKILL),
], ids=["check-TERM", "check-INT", "export-TERM", "diff-KILL"])
def test_stopping_a_command_leaves_no_worker(long_trace, tmp_path, run, workers, argv, sig):
    env = dict(os.environ, PCPVIZ_WORKERS=str(workers),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    err = open(tmp_path / "stderr", "w+")  # not a pipe: an orphan holding it would hang the test
    proc = subprocess.Popen([sys.executable, *run, *[a.format(t=long_trace, o=tmp_path) for a in argv]],
                            env=env, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 120
    workers: list[int] = []
    while len(workers) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, f"no workers forked: {err.seek(0) or err.read()}"
        workers = _children(proc.pid)
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(proc.pid, sig)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [w for w in workers if _alive(w)]
    for w in left:
        os.kill(w, signal.SIGKILL)
    assert not left, f"workers {left} outlived pcpviz {argv[0]} after {signal.Signals(sig).name}"
