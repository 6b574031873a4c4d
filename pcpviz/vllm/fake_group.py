"""PCP ranks as threads of one process: ``FakePCPGroup``, the process group they share, and
``run_ranks``, which runs a function on every rank at once.

The CPU replay, the oracle and the teaching functions drive vLLM's real PCP classes this way;
``pcpviz.vllm.cpu_patches`` points vLLM's ``get_pcp_group()`` at the calling thread's group.
PCP=2::

    >>> import torch
    >>> group = FakePCPGroup(2)
    >>> run_ranks(group, lambda rank: group.all_gather(torch.full((1,), rank)).tolist())
    [[0, 1], [0, 1]]
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pcpviz.trace.collectives import describe

__all__ = ["FakePCPGroup", "run_ranks", "current_fake_group"]

# The thread's bound (group, rank), read by the patched get_pcp_group().
_tls = threading.local()


class FakePCPGroup:
    """A PCP "process group" whose ranks are threads of this process.

    Stands in for ``vllm.distributed.parallel_state.GroupCoordinator`` in the
    calls PCP makes on it: ``rank_in_group`` / ``world_size``, ``all_gather(t, dim)``
    and, from a MoE layer under PCP, ``reduce_scatter(t, dim)``
    (``fused_moe/runner/moe_runner.py:853-861``). Each rank thread binds itself with ``bind(rank)``
    (or use ``run_ranks``); ``rank_in_group`` is then the calling thread's rank.
    """

    def __init__(self, world_size: int, *, timeout: float = 60.0) -> None:
        if world_size < 1:
            raise ValueError(f"FakePCPGroup world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout)
        self._slots: list[Any] = [None] * world_size
        self._local = threading.local()
        # all_gather calls per rank (a collective must be called equally often).
        self.all_gather_calls = [0] * world_size
        self.reduce_scatter_calls = [0] * world_size
        # every collective a rank called, in order: "all_gather pcp float32[4, 64] dim=0" (``describe``)
        self.ledger: list[list[str]] = [[] for _ in range(world_size)]

    @property
    def rank_in_group(self) -> int:
        rank = getattr(self._local, "rank", None)
        if rank is None:
            raise RuntimeError("this thread is not bound to a rank of the FakePCPGroup (use bind(rank))")
        return rank

    @property
    def num_all_gathers(self) -> int:
        """Collective all_gathers completed (each counted once, not per rank)."""
        return max(self.all_gather_calls)

    @contextlib.contextmanager
    def bind(self, rank: int) -> Iterator[FakePCPGroup]:
        """Make the current thread rank ``rank`` of this group, and the group
        the one the patched ``get_pcp_group()`` returns on this thread."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        prev_rank, prev_group = getattr(self._local, "rank", None), getattr(_tls, "group", None)
        self._local.rank, _tls.group = rank, self
        try:
            yield self
        finally:
            self._local.rank, _tls.group = prev_rank, prev_group

    def abort(self) -> None:
        """Release ranks blocked in a collective (they raise BrokenBarrierError)."""
        self._barrier.abort()

    def all_gather(self, input_: Any, dim: int = 0) -> Any:
        """Concatenate every rank's tensor along ``dim``, in rank order."""
        import torch

        rank = self.rank_in_group
        self.all_gather_calls[rank] += 1
        self.ledger[rank].append(describe("all_gather", "pcp", input_, dim=dim))
        self._slots[rank] = input_
        self._barrier.wait()  # every rank has deposited its tensor
        shapes = [tuple(t.shape) for t in self._slots]
        try:
            # A real all_gather needs equal shapes; PCP pads every rank to P rows for this.
            assert all(s == shapes[0] for s in shapes), f"all_gather with unequal shapes across PCP ranks: {shapes}"
            out = torch.cat(list(self._slots), dim=dim)
        finally:
            self._barrier.wait()  # everyone has read the slots before any rank reuses them
        return out


    def reduce_scatter(self, input_: Any, dim: int = 0) -> Any:
        """Sum every rank's tensor, then return this rank's ``1/world_size`` of it along ``dim``.

        PCP=2, rank 0 sends [[1], [2]] and rank 1 [[10], [20]]: the sum is [[11], [22]], rank 0
        gets [[11]] and rank 1 [[22]] (rank-major, like ``torch.distributed.reduce_scatter_tensor``).
        """
        import torch

        rank = self.rank_in_group
        self.reduce_scatter_calls[rank] += 1
        self.ledger[rank].append(describe("reduce_scatter", "pcp", input_, dim=dim))
        self._slots[rank] = input_
        self._barrier.wait()
        shapes = [tuple(t.shape) for t in self._slots]
        try:
            assert all(s == shapes[0] for s in shapes), f"reduce_scatter with unequal shapes across PCP ranks: {shapes}"
            assert shapes[0][dim] % self.world_size == 0, f"reduce_scatter of {shapes[0]} over {self.world_size} ranks"
            total = torch.stack(list(self._slots)).sum(dim=0)
            out = total.chunk(self.world_size, dim=dim)[rank].contiguous()
        finally:
            self._barrier.wait()
        return out


def current_fake_group() -> FakePCPGroup | None:
    """The FakePCPGroup the calling thread is bound to (``bind`` / ``run_ranks``), else None."""
    return getattr(_tls, "group", None)


def run_ranks(group: FakePCPGroup, fn: Callable[[int], Any]) -> list[Any]:
    """Run ``fn(rank)`` on one thread per rank, each bound to ``group``.

    Returns the results in rank order. If any rank raises, the group's barrier
    is aborted (so no rank hangs in a collective) and the first error (lowest
    rank) is re-raised here.
    """
    results: list[Any] = [None] * group.world_size
    errors: list[BaseException | None] = [None] * group.world_size

    def body(rank: int) -> None:
        try:
            with group.bind(rank):
                results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = exc
            group.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"pcp-rank-{r}") for r in range(group.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Prefer a real error over the BrokenBarrierError it caused on other ranks.
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    first = real[0] if real else next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
