"""Which collectives each phase of a step ran: the ``collectives`` view (``str[M]``, one line a
call, in call order: kind, group, the input this rank sent, the dimension gathered along).

The source is a ledger of the calls vLLM's own code made on the PCP group, read by position:
``Ledger.switch(phase)`` gives the calls since the last switch to the phase that was running and
starts counting for the next one. The recorder switches where its hooks see a phase begin:
``begin_step`` (target), ``postprocess_sampled`` (verify), ``propose`` (draft_0, or dummy),
each later draft forward (draft_k), and the step's end.

Where the ledger comes from: the CPU replay's ``FakePCPGroup`` (vLLM's real classes call it
for every PCP collective); on GPUs, vLLM's ``GroupCoordinator`` methods on the PCP and DCP groups
(``recording.group_calls``), only when vLLM runs eagerly: with torch.compile or CUDA graphs the
phases carry no ``collectives`` view (absent, not empty: absent means not recorded). The engine
records the same lines from its own group
(``pcpviz.engine.dist``); ``pcpviz.trace.collectives.describe`` writes them for both.

The CPU replay at PCP=2, K=2 with the tiny dense model, rank 0, a step of 14 padded rows a rank
(``tests/vllm/test_collectives_recorded.py`` holds these lines)::

    target   all_gather pcp float32[14, 512] dim=0      (a layer's kv_c, ops/pcp.py:40)
             all_gather pcp float32[14, 64] dim=0       (its k_pe; the same for every layer)
             ...
             all_gather pcp float32[14, 256] dim=0      (restore_hidden_states, pcp_manager.py:836)
    verify   (none)
    draft_0  the MTP layer's KV gathers, then two hidden-state restores
    draft_1  (none: a dense replicated draft decode gathers nothing)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcpviz.vllm.fake_group import current_fake_group
from pcpviz.vllm.recording import group_calls

__all__ = ["Ledger"]


def _calls() -> tuple[list[str] | None, bool]:
    """The calling thread's rank's ledger (None where no ledger is kept) and whether its reader
    empties it (this process's GPU ledger, ``group_calls``; the replay's is kept whole)."""
    group = current_fake_group()
    if group is None:
        return group_calls.calls(), True
    return group.ledger[group.rank_in_group], False


class Ledger:
    """One recorder's position in the ledger and the phase it is counting for."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.mark = 0

    def switch(self, rec: Any, phase: str | None) -> None:
        """Put the calls since the last switch into the running phase (``rec.put``) and start
        counting for ``phase`` (None: the step ended)."""
        if phase == self.phase:
            return
        calls, trim = _calls()
        if calls is None:
            self.phase = phase
            return
        if self.phase is not None:
            since = calls[self.mark:]
            if since or (rec.phases is not None and self.phase in rec.phases):
                rec.put(self.phase, collectives=np.array(since, dtype=str))  # str[0] when none
        if trim:
            del calls[:]
        self.phase, self.mark = phase, 0 if trim else len(calls)
