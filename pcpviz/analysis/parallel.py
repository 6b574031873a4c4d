"""Work over a trace's steps in forked processes: ``default_workers`` (how many) and
``forked_map`` (a function over chunks, results in order). The children share the parent's
memory-mapped rank files (``pcpviz.trace.index``): nothing is pickled to them but a chunk's index,
and only each chunk's result comes back.

    >>> forked_map(lambda i: i * i, 4, workers=1)        # one worker: in this process
    [0, 1, 4, 9]

``run_checks`` (checks) uses it above ``PARALLEL_FROM`` steps, ``export_chrome`` (events) uses
``windowed_map`` (``fork_map`` a window of chunks at a time: results held are bounded);
``$PCPVIZ_WORKERS`` sets the count (``1``: never fork).
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterator

from pcpviz.trace.index import fork_map

WORKERS_ENV = "PCPVIZ_WORKERS"
"""How many processes the trace commands use by default: a number, or ``auto`` (the default:
one per CPU, at most 8, once a trace has ``PARALLEL_FROM`` steps; one below that)."""

PARALLEL_FROM = 2000
"""Steps from which ``auto`` uses several processes (below it, starting them costs more than it
saves)."""


def default_workers(num_steps: int, setting: str | int | None = None, *, parallel_from: int = PARALLEL_FROM) -> int:
    """The process count for ``num_steps`` steps (or other units of work): ``setting`` (or
    ``$PCPVIZ_WORKERS``) as a number from 1 to 256, or ``auto`` (several from ``parallel_from``
    units). ValueError names the setting when it is neither."""
    setting = os.environ.get(WORKERS_ENV, "auto") if setting is None else setting
    if str(setting).strip().lower() == "auto":
        return min(os.cpu_count() or 1, 8) if num_steps >= parallel_from else 1
    try:
        n = int(setting)
    except (TypeError, ValueError):
        n = 0
    if not 1 <= n <= 256:
        raise ValueError(f"{WORKERS_ENV}={setting!r}: expected 'auto' or a process count from 1 to 256")
    return n


def chunk_bounds(num_steps: int, workers: int, *, per_worker: int = 2) -> list[int]:
    """Where ``num_steps`` steps are cut into ``per_worker * workers`` runs of consecutive steps
    (fewer when there are fewer steps): run ``i`` is ``steps[b[i]:b[i + 1]]``. More runs than
    workers keep them busy to the end when one is slowed (another job on its CPU): a free worker
    takes the next run.

    >>> chunk_bounds(10, 2)
    [0, 2, 5, 8, 10]
    """
    n = min(num_steps, per_worker * workers)
    return [round(i * num_steps / n) for i in range(n + 1)] if n else [0]


_TASK: list[Callable[[int], Any]] = []  # the function a forked child runs: set just before the fork
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """In a forked worker: be killed (SIGKILL) when the process that forked it dies, however it
    dies (SIGTERM, SIGKILL, a crash), so a stopped ``pcpviz check`` leaves no worker behind
    holding its pipes. Linux only (``prctl``); elsewhere the parent's stop handling kills the pool.
    A parent already gone before this ran is noticed by ``getppid``."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != parent:
        os._exit(1)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the parent decides; a worker only dies with it
        signal.signal(sig, signal.SIG_DFL)


def _run_task(i: int) -> Any:
    return _TASK[0](i)


def forked_imap(fn: Callable[[int], Any], n: int, *, workers: int) -> Iterator[Any]:
    """``fn(0), fn(1), ... fn(n - 1)``, in order, computed by ``workers`` forked processes (lazily
    in this process when ``workers`` is 1 or the platform cannot fork). The children are forked
    and at work when this returns, so the caller can do other work before reading the results.
    ``fn`` may be a closure: the children inherit it. An exception in a child is raised while
    iterating, as ``fn`` raised it."""
    if workers <= 1 or n <= 1 or not hasattr(os, "fork"):
        return (fn(i) for i in range(n))
    if _TASK:
        raise RuntimeError("forked_imap is not re-entrant")
    _TASK.append(fn)
    try:  # with "fork", the pool forks all its children at the first submit
        pool = ProcessPoolExecutor(min(workers, n), mp_context=multiprocessing.get_context("fork"),
                                   initializer=_die_with_parent, initargs=(os.getpid(),))
        futures = [pool.submit(_run_task, i) for i in range(n)]
    except BaseException:
        _TASK.clear()
        raise
    return _results(pool, futures)


def _results(pool: ProcessPoolExecutor, futures: list) -> Iterator[Any]:
    done = False
    try:
        for f in futures:
            yield f.result()
        done = True
    finally:
        for f in futures:
            f.cancel()
        if not done:  # stopped (KeyboardInterrupt, an error, the caller gave up): kill, don't wait
            _kill_workers(pool)
        pool.shutdown(wait=done, cancel_futures=True)
        _TASK.clear()


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        try:
            proc.kill()
        except (OSError, ValueError, AttributeError):
            pass


def forked_map(fn: Callable[[int], Any], n: int, *, workers: int) -> list[Any]:
    """``list(forked_imap(fn, n, workers=workers))``."""
    return list(forked_imap(fn, n, workers=workers))


def windowed_map(fn: Callable[[int], Any], n: int, *, workers: int, window: int) -> Iterator[Any]:
    """``fn(0) ... fn(n - 1)`` in order, ``workers * window`` indices at a time through ``fork_map``
    (this process computes the first ``window`` of each batch and yields each as it is made, forked
    children the others): at most ``workers * window`` results are held, so a caller writing each
    one as it comes streams. ``fn`` must be pure (``fork_map``); one worker forks nothing.

    >>> list(windowed_map(lambda i: i * i, 5, workers=2, window=2))   # batches [0..3], [4]
    [0, 1, 4, 9, 16]
    """
    if workers <= 1:
        yield from (fn(i) for i in range(n))
        return
    size = workers * window
    for lo in range(0, n, size):
        yield from fork_map(functools.partial(_shifted, fn, lo), min(size, n - lo), workers=workers)


def _shifted(fn: Callable[[int], Any], lo: int, i: int) -> Any:
    return fn(lo + i)
