"""``pcpviz.run``'s progress bar starts at rank 0's first progress line, not before the rank
processes load the model (issue 39 item 12): start-up is not token time, so the bar's rate and ETA
are the generation's. A real 1-rank CPU run of the shipped model."""

from __future__ import annotations

import subprocess
import time

import pytest

import pcpviz.engine.launch as launch

pytestmark = pytest.mark.slow  # an engine run


def test_progress_bar_starts_after_start_up(monkeypatch, tmp_path):
    seen: dict[str, float] = {}
    real_popen, real_bar = subprocess.Popen, launch._progress_bar

    def popen(*a, **k):
        seen.setdefault("ranks started", time.monotonic())
        return real_popen(*a, **k)

    def bar(cfg):
        seen.setdefault("bar", time.monotonic())
        return real_bar(cfg)

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    monkeypatch.setattr(launch, "_progress_bar", bar)
    res = launch.run(["def f("], pcp=1, num_speculative_tokens=1, max_new_tokens=4, progress=True)
    assert res.num_steps >= 1
    # the model loads in the rank process (seconds): the bar exists only once a step has run
    assert seen["bar"] - seen["ranks started"] > 0.5, seen
