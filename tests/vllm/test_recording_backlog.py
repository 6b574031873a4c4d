"""``recording.backlog``: the steps a writer has not taken are bounded in count and in host bytes;
a put past either waits for the writer (one warning per rank), one step always fits, and a bad
``PCPVIZ_BACKLOG_MB`` is one warning and the default."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from pcpviz.vllm.recording.backlog import DEFAULT_BACKLOG_MB, ENV_BACKLOG_MB, Backlog, backlog_bytes


def _put_later(q: Backlog, item, nbytes: int) -> threading.Thread:
    t = threading.Thread(target=q.put, args=(item, nbytes), daemon=True)
    t.start()
    return t


def test_bytes_bound_the_backlog_and_the_writer_frees_room(caplog):
    q = Backlog(3, max_steps=100, max_bytes=10)
    q.put("a", 6)
    q.put("b", 4)  # exactly at the bound
    with caplog.at_level(logging.WARNING, logger="pcpviz.vllm"):
        t = _put_later(q, "c", 1)
        time.sleep(0.2)
        assert t.is_alive() and (q.steps, q.nbytes) == (2, 10)  # waits: 11 bytes would pass the bound
        assert q.get() == ("a", 6)
        q.task_done(6)
        t.join(5)
        assert not t.is_alive() and (q.steps, q.nbytes) == (2, 5)
        t2 = _put_later(q, "d", 7)  # 12 > 10: waits again, no second warning
        time.sleep(0.1)
        assert t2.is_alive()
        for _ in range(2):
            item, n = q.get()
            q.task_done(n)
        t2.join(5)
    warnings = [r.getMessage() for r in caplog.records if "behind" in r.getMessage()]
    assert len(warnings) == 1 and "rank 3" in warnings[0] and ENV_BACKLOG_MB in warnings[0]
    assert q.waited == 2 and q.get() == ("d", 7)


def test_one_step_always_fits_and_the_count_bounds_too():
    q = Backlog(0, max_steps=2, max_bytes=10)
    q.put("huge", 10**9)  # alone: let in whatever its size
    assert (q.steps, q.nbytes) == (1, 10**9)
    q.task_done(q.get()[1])
    q.put("x", 0)
    q.put("y", 0)
    t = _put_later(q, "z", 0)  # a third step: past max_steps
    time.sleep(0.1)
    assert t.is_alive()
    q.task_done(q.get()[1])
    t.join(5)
    assert not t.is_alive()


def test_join_waits_for_every_item_done():
    q = Backlog(0, max_bytes=100)
    q.put("a", 1)
    done = threading.Event()
    threading.Thread(target=lambda: (q.join(), done.set()), daemon=True).start()
    time.sleep(0.1)
    assert not done.is_set()
    q.task_done(q.get()[1])
    assert done.wait(5)


@pytest.mark.parametrize("raw", ["lots", "-5", "0", "nan", "inf"])
def test_a_bad_setting_is_one_warning_and_the_default(monkeypatch, caplog, raw):
    monkeypatch.setenv(ENV_BACKLOG_MB, raw)
    with caplog.at_level(logging.WARNING, logger="pcpviz.vllm"):
        assert backlog_bytes() == int(DEFAULT_BACKLOG_MB * 1e6)
    assert len(caplog.records) == 1 and ENV_BACKLOG_MB in caplog.records[0].getMessage()
    monkeypatch.setenv(ENV_BACKLOG_MB, "64")
    assert backlog_bytes() == 64_000_000
