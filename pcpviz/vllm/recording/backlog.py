"""The steps a rank's writer has not yet taken: bounded by count and by the host memory they hold.

A staged step keeps its host buffer (pinned where there is CUDA) until the writer has copied it
out. When the writer is slower than vLLM, steps pile up between the two; a count alone does not
bound what they hold, since a decode step is kilobytes and a 16k-token prefill chunk megabytes.
``Backlog.put`` waits while ``max_steps`` steps, or ``PCPVIZ_BACKLOG_MB`` of their buffers, are
already waiting (a slow writer slows the steps, it never grows host memory without bound), and
says so once per rank. One step is always let in, whatever its size.

PCP=1, batch 64 with 32k-token contexts, prefill chunks of 16,384 tokens: a chunk's buffer is
about 4 MB, so the default 256 MB holds about 64 chunks; 256 decode steps of 541 kB hold 138 MB
and never reach it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any

__all__ = ["Backlog", "ENV_BACKLOG_MB", "DEFAULT_BACKLOG_MB", "backlog_bytes", "held_bytes"]

logger = logging.getLogger("pcpviz.vllm")

ENV_BACKLOG_MB = "PCPVIZ_BACKLOG_MB"
DEFAULT_BACKLOG_MB = 256.0
MAX_STEPS = 256


def backlog_bytes() -> int:
    """``PCPVIZ_BACKLOG_MB`` in bytes (a bad value: one warning and the default)."""
    raw = os.environ.get(ENV_BACKLOG_MB, "").strip()
    try:
        mb = float(raw) if raw else DEFAULT_BACKLOG_MB
        if not mb > 0 or mb != mb or mb == float("inf"):
            raise ValueError(raw)
    except ValueError:
        logger.warning("pcpviz: %s=%r is not a positive number of MB; using %g", ENV_BACKLOG_MB, raw,
                       DEFAULT_BACKLOG_MB)
        mb = DEFAULT_BACKLOG_MB
    return int(mb * 1e6)


class Backlog:
    """A FIFO of ``(item, nbytes)`` between a rank's step thread and its writer thread:
    ``put`` blocks past ``max_steps`` items or ``max_bytes`` bytes waiting (one item always fits),
    ``get`` takes the oldest, ``task_done(nbytes)`` gives its room back, ``join`` waits until
    every item put was done."""

    def __init__(self, rank: int, *, max_steps: int = MAX_STEPS, max_bytes: int | None = None) -> None:
        self.rank = rank
        self.max_steps = max_steps
        self.max_bytes = backlog_bytes() if max_bytes is None else max_bytes
        self.steps = self.nbytes = 0
        self.waited = 0  # puts that had to wait for room
        self._q: queue.Queue = queue.Queue()
        self._cv = threading.Condition()

    def _fits(self, nbytes: int) -> bool:
        return self.steps == 0 or (self.steps < self.max_steps and self.nbytes + nbytes <= self.max_bytes)

    def put(self, item: Any, nbytes: int = 0) -> None:
        with self._cv:
            if not self._fits(nbytes):
                if not self.waited:
                    logger.warning("pcpviz: rank %d's writer is %d steps (%.0f MB) behind; vLLM's steps wait for it "
                                   "(%s bounds the host memory of steps not yet written)", self.rank, self.steps,
                                   self.nbytes / 1e6, ENV_BACKLOG_MB)
                self.waited += 1
                self._cv.wait_for(lambda: self._fits(nbytes))
            self.steps += 1
            self.nbytes += nbytes
        self._q.put((item, nbytes))

    def get(self) -> tuple[Any, int]:
        return self._q.get()

    def get_ready(self, most: int) -> list[tuple[Any, int]]:
        """The items waiting now (at most ``most``), oldest first, without waiting for more."""
        out: list[tuple[Any, int]] = []
        while len(out) < most:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                break
        return out

    def task_done(self, nbytes: int) -> None:
        with self._cv:
            self.steps -= 1
            self.nbytes -= nbytes
            self._cv.notify_all()
        self._q.task_done()

    def join(self) -> None:
        self._q.join()


def held_bytes(staged: Any) -> int:
    """The host memory a staged step holds until it is written: its host buffer's size."""
    host = getattr(staged, "host", None)
    return int(host.numel() * host.element_size()) if host is not None else int(getattr(staged, "nbytes", 0) or 0)
