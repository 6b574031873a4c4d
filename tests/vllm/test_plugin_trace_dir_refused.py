"""The plugin is never silent about where it writes nothing (issue 39 item 7): with
``PCPVIZ_TRACE_DIR`` naming a directory that already holds a trace, or whose ``.writer.lock`` or
``run.json`` is a FIFO, the recorder warns once (naming the directory and why) and records
nothing, and vLLM runs on. ``pcpviz replay`` honours ``PCPVIZ_FLIGHT_*`` as the plugin does."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # imports vLLM

REPO = Path(__file__).resolve().parents[2]
CPU_TRACE = REPO / "data" / "traces" / "cpu-pcp2-mtp2"


def _existing_trace(d: Path) -> None:
    shutil.copytree(CPU_TRACE, d)


def _fifo_lock(d: Path) -> None:
    d.mkdir()
    os.mkfifo(d / ".writer.lock")


def _fifo_meta(d: Path) -> None:
    d.mkdir()
    os.mkfifo(d / "run.json")


@pytest.mark.parametrize("make, why", [(_existing_trace, "already holds a trace"),
                                       (_fifo_lock, ".writer.lock is a FIFO"), (_fifo_meta, "run.json is a FIFO")],
                         ids=["trace", "fifo-lock", "fifo-run-json"])
def test_plugin_warns_once_and_writes_nothing(tmp_path, monkeypatch, caplog, make, why):
    from pcpviz.vllm.recording import sessions, state

    d = tmp_path / "t"
    make(d)
    before = sorted(os.listdir(d))
    monkeypatch.setenv(sessions.ENV_TRACE_DIR, str(d))
    monkeypatch.setattr(state, "_session", None)
    monkeypatch.setattr(sessions, "_warned", [])
    with caplog.at_level(logging.WARNING, logger="vllm.pcpviz"):
        assert sessions.active_session() is None
        assert sessions.active_session() is None  # asked again by another manager: no second warning
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.pcpviz"]
    assert len(lines) == 1 and str(d) in lines[0] and why in lines[0] and "nothing is being written" in lines[0]
    assert sorted(os.listdir(d)) == before


def test_replay_honours_flight_settings(tmp_path):
    env = dict(os.environ, PCPVIZ_FLIGHT_RECORDER="nope",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "pcpviz.cli", "replay", "--trace", str(tmp_path / "r"), "--quiet"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "PCPVIZ_FLIGHT_RECORDER" in r.stderr, r.stderr
    assert not (tmp_path / "r").exists()
