"""The collectives vLLM runs on its PCP and DCP groups, on GPUs: a ledger of this process's calls.

vLLM's model code, PCP manager and attention call ``GroupCoordinator.all_gather`` /
``reduce_scatter`` / ``all_reduce`` / ``all_gatherv`` / ``reduce_scatterv`` on ``get_pcp_group()``
and ``get_dcp_group()`` (``distributed/parallel_state.py:726-810``; the MoE's PCP gathers and
reduce-scatter, ``fused_moe/runner/moe_runner.py:824-861``). Wrapped here, each call on a group of
more than one rank adds one line to this process's ledger (``pcpviz.trace.collectives.describe``:
kind, group, the input this rank sent, the dimension), which ``recording.collectives.Ledger`` cuts
into the phases of a step, as it does the CPU replay's ``FakePCPGroup`` ledger.

Only when vLLM runs eagerly (``watch(eager=True)``: no torch.compile, no CUDA graphs, e.g.
``enforce_eager=True``): a compiled forward calls the collectives from its graph (``torch.ops.vllm``
ops, ``parallel_state.py:199-245``) and a CUDA graph replays them without Python, so the wrappers
would see only the calls outside the model and the phase would hold a partial list. Otherwise the
ledger is off and phases carry no ``collectives`` view (absent: not recorded). A call made while
Dynamo traces or a CUDA graph captures is never counted.

One GPU process is one PCP rank; PCP=2 with an MoE model, eager, a target step of 6 padded rows a
rank, rank 0's lines (the same on rank 1)::

    all_gather pcp bfloat16[6, 256] dim=0      (the MoE layer's rows, moe_runner.py:828)
    all_gather pcp float32[6, 8] dim=0         (its router logits, :829)
    reduce_scatter pcp bfloat16[12, 256] dim=0 (its output, :858)

Not run on GPUs yet: one H200 is PCP=1, where vLLM makes no PCP call (``world_size == 1`` returns
before any collective, ``parallel_state.py:757-758``). ``tests/vllm/test_group_calls.py`` drives the
wrappers on stand-in coordinators (no process group can be made of GPUs here).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from pcpviz.trace.collectives import describe

__all__ = ["watch", "calls", "runs_eagerly", "install_group_wrappers", "uninstall_group_wrappers", "GROUPS", "METHODS"]

GROUPS = ("pcp", "dcp")
METHODS = {"all_gather": -1, "reduce_scatter": -1, "all_reduce": None, "all_gatherv": 0, "reduce_scatterv": 0}
"""The wrapped ``GroupCoordinator`` methods and their default ``dim`` (None: no dimension)."""

MAX_UNREAD = 1 << 16
"""Lines the ledger holds unread before it stops (a process whose recorder stopped reading it)."""

logger = logging.getLogger("vllm.pcpviz")
_lock = threading.Lock()
_ledger: list[str] = []
_watching = False


def watch(*, eager: bool) -> None:
    """Count this process's calls from now on when vLLM runs eagerly; else stop counting."""
    global _watching
    _watching = bool(eager)


def calls() -> list[str] | None:
    """This process's ledger (None while not watching: phases then get no ``collectives`` view).
    Its reader empties it once read (``recording.collectives.Ledger``): a long run keeps no history."""
    return _ledger if _watching else None


def _stop() -> None:
    """Nobody reads the ledger: stop (phases get no ``collectives`` view from now on), say so once."""
    global _watching
    _watching = False
    _ledger.clear()
    logger.warning("pcpviz: %d collective calls were never read; no collectives are recorded from now on",
                   MAX_UNREAD)


def runs_eagerly(vllm_config: Any) -> bool:
    """vLLM runs the model without torch.compile and without CUDA graphs (``enforce_eager=True``
    sets both), so every collective passes through ``GroupCoordinator``'s Python methods."""
    comp = getattr(vllm_config, "compilation_config", None)
    if comp is None:
        return False
    names = [getattr(getattr(comp, attr, None), "name", str(getattr(comp, attr, None))) for attr in
             ("mode", "cudagraph_mode")]
    return names == ["NONE", "NONE"]


def _group(coordinator: Any) -> str | None:
    name = str(getattr(coordinator, "unique_name", "")).split(":")[0]
    return name if name in GROUPS and int(getattr(coordinator, "world_size", 1)) > 1 else None


def _tracing() -> bool:
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _wrap(kind: str, default_dim: int | None, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self, input_: Any, *args: Any, **kwargs: Any) -> Any:
        if _watching:
            group = _group(self)
            if group is not None and not _tracing():
                dim = kwargs.get("dim", args[0] if args else default_dim)
                tensor = input_[0] if isinstance(input_, (list, tuple)) and input_ else input_
                d = 0 if dim is None else int(dim)
                if d < 0 and hasattr(tensor, "dim"):
                    d %= tensor.dim()
                with _lock:
                    _ledger.append(describe(kind, group, tensor, dim=d))
                    if len(_ledger) > MAX_UNREAD:
                        _stop()
        return original(self, input_, *args, **kwargs)

    wrapper._pcpviz_wrapper = True  # type: ignore[attr-defined]
    wrapper._pcpviz_original = original  # type: ignore[attr-defined]
    return wrapper


def install_group_wrappers(owner: Any = None) -> None:
    """Wrap ``METHODS`` of vLLM's ``GroupCoordinator`` (or of ``owner``) once."""
    if owner is None:
        from vllm.distributed.parallel_state import GroupCoordinator as owner  # noqa: N813
    for name, dim in METHODS.items():
        current = getattr(owner, name, None)
        if current is not None and not getattr(current, "_pcpviz_wrapper", False):
            setattr(owner, name, _wrap(name, dim, current))


def uninstall_group_wrappers(owner: Any = None) -> None:
    if owner is None:
        from vllm.distributed.parallel_state import GroupCoordinator as owner  # noqa: N813
    for name in METHODS:
        current = getattr(owner, name, None)
        if getattr(current, "_pcpviz_wrapper", False):
            setattr(owner, name, current._pcpviz_original)
