"""The launcher blames the rank that caused a failure, with its real cause, not the first rank
seen failing: peers of a dead, stopped or failing rank fail too, with connection/timeout
errors. Real processes stand in for ranks (a shell line each), so no torch is needed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pcpviz.engine.rank_procs import WORK_PREFIX, RankError, RankProcess, blame, clean_stale_work_dirs


def _ranks(*scripts: str) -> list[RankProcess]:
    ranks = [RankProcess(r, subprocess.Popen(["sh", "-c", s], stderr=subprocess.PIPE, text=True))
             for r, s in enumerate(scripts)]
    time.sleep(0.5)
    for r in ranks:
        if "sleep 60" not in r.proc.args[2]:
            r.proc.wait(timeout=30)
    return ranks


def _cleanup(ranks):
    for r in ranks:
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait()


def test_full_disk_is_blamed_on_its_rank_not_on_the_peer(tmp_path):
    ranks = _ranks("echo 'PCPVIZ_ERROR RuntimeError: Connection closed by peer [127.0.0.1]:4242' >&2; exit 1",
                   "echo 'PCPVIZ_ERROR OSError: runs/x/rank1.arrow: cannot write (No space left on device)' >&2; "
                   "exit 1")
    err = blame(ranks, str(tmp_path))
    assert isinstance(err, RankError) and err.rank == 1 and "No space left on device" in str(err)


def test_stopped_rank_is_blamed_when_its_peer_times_out(tmp_path):
    ranks = _ranks("echo 'PCPVIZ_ERROR RuntimeError: Timed out waiting 20000ms for recv operation' >&2; exit 1",
                   "sleep 60")
    try:
        os.kill(ranks[1].proc.pid, signal.SIGSTOP)
        time.sleep(0.3)
        err = blame(ranks, str(tmp_path))
        assert err.rank == 1 and "is stopped" in str(err) and "rank 0 gave up waiting" in str(err)
    finally:
        os.kill(ranks[1].proc.pid, signal.SIGCONT)
        _cleanup(ranks)


def test_rank_dying_without_a_word_is_blamed(tmp_path):
    ranks = _ranks("echo 'PCPVIZ_ERROR RuntimeError: Connection reset by peer' >&2; exit 1", "kill -9 $$")
    err = blame(ranks, str(tmp_path))
    assert err.rank == 1 and "killed by SIGKILL" in str(err)


def test_work_dirs_of_dead_launchers_are_removed(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{WORK_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{WORK_PREFIX}{os.getpid()}-abc"
    other = tmp_path / "pcpviz-run-notmine"
    for d in (stale, live, other):
        d.mkdir()
    clean_stale_work_dirs()
    assert not stale.exists() and live.exists() and other.exists()
