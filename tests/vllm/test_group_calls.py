"""Issue 36: the plugin's ledger of vLLM's PCP / DCP collectives on GPUs (``recording.group_calls``).
No process group of GPUs can be made here, so the wrappers are driven on a stand-in coordinator
class with ``GroupCoordinator``'s method signatures (``parallel_state.py:726-810``); the wrapping of
vLLM's own class is checked by attribute. The ledger's cut into phases is the recorder's own."""

from __future__ import annotations

import types

import pytest
import torch

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

from pcpviz.vllm.recording import group_calls  # noqa: E402
from pcpviz.vllm.recording.collectives import Ledger  # noqa: E402


class StandIn:
    """``GroupCoordinator``'s collective methods, returning what a one-rank group would."""

    def __init__(self, name: str, world_size: int) -> None:
        self.unique_name, self.world_size = name, world_size

    def all_gather(self, input_, dim=-1):
        return torch.cat([input_] * self.world_size, dim=dim)

    def reduce_scatter(self, input_, dim=-1):
        return input_.chunk(self.world_size, dim=dim)[0]

    def all_reduce(self, input_):
        return input_

    def all_gatherv(self, input_, dim=0, sizes=None):
        return input_

    def reduce_scatterv(self, input_, dim=0, sizes=None):
        return input_


class Rec:
    def __init__(self) -> None:
        self.phases: dict = {}
        self.puts: list = []

    def put(self, phase, **views):
        self.phases.setdefault(phase, {}).update(views)
        self.puts.append((phase, views))


@pytest.fixture
def wrapped():
    group_calls.install_group_wrappers(StandIn)
    group_calls.watch(eager=True)
    group_calls.calls().clear()
    yield
    group_calls.watch(eager=False)
    group_calls.uninstall_group_wrappers(StandIn)
    assert not getattr(StandIn.all_gather, "_pcpviz_wrapper", False)


def test_moe_calls_are_cut_into_the_phases_they_ran_in_and_the_ledger_emptied(wrapped):
    pcp, rec, ledger = StandIn("pcp:0", 2), Rec(), Ledger()
    rows, logits = torch.zeros(6, 256, dtype=torch.bfloat16), torch.zeros(6, 8)
    ledger.switch(rec, "target")
    rec.phases["target"] = {}
    out = pcp.all_gather(rows, dim=0)
    pcp.all_gather(logits, dim=0)
    assert pcp.reduce_scatter(out, dim=0).shape == (6, 256)  # the wrapper returns what vLLM's method does
    ledger.switch(rec, "verify")
    rec.phases["verify"] = {}
    ledger.switch(rec, "draft_0")
    pcp.all_reduce(torch.zeros(3))
    ledger.switch(rec, None)
    assert rec.phases["target"]["collectives"].tolist() == [
        "all_gather pcp bfloat16[6, 256] dim=0", "all_gather pcp float32[6, 8] dim=0",
        "reduce_scatter pcp bfloat16[12, 256] dim=0"]
    assert rec.phases["verify"]["collectives"].shape == (0,)  # recorded, none ran
    assert rec.phases["draft_0"]["collectives"].tolist() == ["all_reduce pcp float32[3] dim=0"]
    assert group_calls.calls() == []  # read and emptied: a long run keeps no history


def test_only_pcp_and_dcp_groups_of_several_ranks_count_and_negative_dims_are_normalised(wrapped):
    StandIn("tp:0", 2).all_gather(torch.zeros(2, 4), dim=0)
    StandIn("pcp:0", 1).all_gather(torch.zeros(2, 4), dim=0)  # vLLM returns before any collective
    StandIn("dcp:0", 2).all_gather(torch.zeros(2, 4))  # vLLM's default dim=-1
    StandIn("pcp:1", 4).all_gatherv([torch.zeros(5, 3)], 0)
    assert group_calls.calls() == ["all_gather dcp float32[2, 4] dim=1", "all_gatherv pcp float32[5, 3] dim=0"]


def test_nothing_counts_while_not_watching_or_while_dynamo_traces(wrapped, monkeypatch):
    pcp = StandIn("pcp:0", 2)
    group_calls.watch(eager=False)
    pcp.all_gather(torch.zeros(2), dim=0)
    assert group_calls.calls() is None
    group_calls.watch(eager=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    pcp.all_gather(torch.zeros(2), dim=0)
    assert group_calls.calls() == []
    rec, ledger = Rec(), Ledger()
    group_calls.watch(eager=False)
    ledger.switch(rec, "target")
    ledger.switch(rec, None)
    assert rec.puts == []  # not watching: no collectives view at all (absent means not recorded)


def test_eager_is_no_compile_and_no_graphs():
    from vllm.config import CompilationMode, CUDAGraphMode

    def cfg(mode, graphs):
        return types.SimpleNamespace(compilation_config=types.SimpleNamespace(mode=mode, cudagraph_mode=graphs))

    assert group_calls.runs_eagerly(cfg(CompilationMode.NONE, CUDAGraphMode.NONE))
    assert not group_calls.runs_eagerly(cfg(CompilationMode.VLLM_COMPILE, CUDAGraphMode.NONE))
    assert not group_calls.runs_eagerly(cfg(CompilationMode.NONE, CUDAGraphMode.FULL_AND_PIECEWISE))
    assert not group_calls.runs_eagerly(None)


def test_the_plugin_wraps_vllms_group_coordinator():
    from vllm.distributed.parallel_state import GroupCoordinator

    from pcpviz.vllm.recording import wrappers

    wrappers.install_wrappers()
    try:
        assert all(getattr(getattr(GroupCoordinator, m), "_pcpviz_wrapper", False) for m in group_calls.METHODS)
    finally:
        wrappers.uninstall_wrappers()
    assert not any(getattr(getattr(GroupCoordinator, m), "_pcpviz_wrapper", False) for m in group_calls.METHODS)


def test_an_unread_ledger_stops_instead_of_growing(wrapped, monkeypatch, caplog):
    monkeypatch.setattr(group_calls, "MAX_UNREAD", 3)
    pcp = StandIn("pcp:0", 2)
    for _ in range(4):
        pcp.all_gather(torch.zeros(1), dim=0)
    assert group_calls.calls() is None and "never read" in caplog.text
