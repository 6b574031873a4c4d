"""``request_keys`` of a long trace, read in runs of steps in forked processes, is the one-process
answer: the same keys in the same order, chunked prefills (a request's pair replaced by a later
chunk's) and decode steps skipped unread included."""

from __future__ import annotations

from pathlib import Path

import pytest

import pcpviz.trace as pt
from pcpviz.analysis import request_keys as diff

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["vllm-h200x2-pcp2-mtp2-chunked", "cpu-pcp2-mtp2", "vllm-serve-h200x2-pcp2-mtp2"])
def test_forked_request_keys_are_the_one_process_keys(name, monkeypatch):
    t = pt.open(ROOT / "data" / "traces" / name)
    monkeypatch.setenv("PCPVIZ_WORKERS", "1")
    one = diff.request_keys(t)
    monkeypatch.setenv("PCPVIZ_WORKERS", "2")
    monkeypatch.setattr(diff, "PARALLEL_FROM", 1)  # this short trace is read as a long one is
    forked = diff.request_keys(t)
    assert list(forked.items()) == list(one.items())
    assert one  # every shipped run prefilled its prompts


def test_a_chunked_prefill_keeps_its_last_chunk(monkeypatch):
    t = pt.open(ROOT / "data" / "traces" / "vllm-h200x2-pcp2-mtp2-chunked")
    parts = [diff._last_prompt_tokens(t, 0, [s]) for s in t.rank_steps(0)]
    chunked = {rid for rid in diff.request_keys(t) if sum(rid in p for p in parts) > 1}
    assert chunked, "the chunked trace has a prompt prefilled over several steps"
    last = {}
    for p in parts:
        last.update(p)
    keys = diff.request_keys(t)
    assert all(keys[rid][:2] == last[rid] for rid in chunked)
