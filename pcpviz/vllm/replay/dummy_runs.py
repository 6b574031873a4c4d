"""Dummy runs after real traffic, driven through vLLM 0.33.0's own code on PCP rank threads.

``probe_dummy_run()`` runs a scenario's real steps, then one dummy run the way
``GPUModelRunner._dummy_run`` does it, and measures what the dummy run read and wrote:

* ``kind="profile"``: the memory-profile run (``skip_attn=True``): no attention metadata, no
  slot mapping, so MLA's ``update_kv_cache`` returns before the PCP gather;
* ``kind="attention"``: every other dummy run (``Worker.execute_dummy_batch`` when a DP rank has
  no ready request, warm-up sizes): ``prepare_dummy_attn`` hands the target and ``draft_0`` the
  PCP manager's expanded all-PAD ``[G, N*T]`` mapping, which takes the all-gather branch of
  ``_gather_prefill_cache_inputs``.

Under PCP ``prepare_dummy_attn`` asks the PCP manager for the dummy block tables; its
``get_dummy_block_tables`` zeroes only its own local tables, while ``BlockTables.input_block_tables``
keeps the rows of the last real ``propose`` gather. DSpark's ``prepare_dflash_inputs`` reads that
buffer by batch row (the dummy run skips the gather), so its query slots point into live requests'
blocks and its query forward writes draft K/V there. MTP's dummy draft decodes get PAD slots
(``_copy_request_inputs`` sets its ``idx_mapping`` to -1). docs/findings/dspark-dummy-run-stale-block-tables.md.

PCP=2, K=2, scenario ``dspark`` then an attention dummy run of 1 request: the query slots are
the 3 slots after position 0 of the first request's first block, on both ranks
(``DummyRunObservation.hits``); with ``fix="zero_input_block_tables"`` they are PAD.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.pcp_manager import PCPManager
from vllm.v1.worker.gpu.spec_decode.utils import get_drafter_hidden_states

from pcpviz.vllm.fake_group import FakePCPGroup, run_ranks
from pcpviz.vllm.replay.ranks import RankState, ReplayConfig, stand_in_vllm_config
from pcpviz.vllm.replay.scenarios import SCENARIOS
from pcpviz.vllm.replay.scheduler import ScriptedScheduler
from pcpviz.vllm.replay.step import dflash_inputs_without_gather, rank_step

__all__ = ["DummyRunObservation", "DUMMY_FIXES", "probe_dummy_run", "dummy_run", "format_observations"]

DUMMY_FIXES = ("zero_input_block_tables",)


@dataclass(frozen=True)
class DummyRunObservation:
    """One rank's dummy run after real steps. ``draft_slots``: the slot mapping the drafter's
    own K/V write got (DSpark: the query slots of ``prepare_dflash_inputs``; MTP: the last draft
    decode's); ``kv_writes``: slot -> (token, position) now in the draft KV cache where the dummy
    run changed it; ``hits``: live request -> the slots of its blocks the dummy run wrote."""

    drafter: str
    kind: str
    rank: int
    all_gathers: int  # collectives of the dummy run on this rank
    input_block_tables_rows: np.ndarray  # int32[R, W]: what the drafter's kernels read by batch row
    draft_slots: np.ndarray  # int64[...]
    kv_writes: dict[int, tuple[float, float]]
    hits: dict[str, list[int]]
    non_pcp_draft_slots: np.ndarray | None  # DSpark: the same kernel after BlockTables.get_dummy_block_tables

    @property
    def writes_live_kv(self) -> bool:
        return bool(self.hits)


def dummy_run(st: RankState, *, kind: str, num_reqs: int = 1) -> dict[str, Any]:
    """``GPUModelRunner._dummy_run(uniform_decode=True)`` -> ``execute_model(dummy_run=True)`` ->
    ``propose(dummy_run=True)`` on this rank: ``InputBatch.make_dummy``, the PCP manager's
    ``prepare_inputs_for_capture_or_profile``, then (``kind="attention"``) vLLM's own
    ``prepare_dummy_attn`` and the attention metadata, the stand-in target forward, the drafter.
    The draft forwards run eagerly (``is_profile=True`` forces it; on a GPU a dummy run may
    replay graphs, which read the same buffers). Returns the dummy batch and the draft tokens."""
    c, spec = st.c, st.spec
    profile = kind == "profile"
    num_tokens = num_reqs * (1 + c.k)
    with torch.inference_mode():
        batch = InputBatch.make_dummy(num_reqs, num_tokens, st.input_buffers, is_padding=profile)
        batch = st.manager.prepare_inputs_for_capture_or_profile(batch)
        attn_metadata = slot_by_layer = None
        if not profile:
            block_tables, slot_mappings = GPUModelRunner.prepare_dummy_attn(st.runner, batch)
            slot_by_layer = build_slot_mappings_by_layer(slot_mappings, st.kv_cache_config)
            attn_metadata = st.model_state.prepare_attn(batch, CUDAGraphMode.NONE, block_tables, slot_mappings,
                                                        st.attn_groups, st.kv_cache_config)
        with set_forward_context(attn_metadata, st.vllm_config, num_tokens=num_tokens, slot_mapping=slot_by_layer,
                                 is_padding=batch.is_padding):
            model_output = st.target(batch.input_ids, batch.positions)
        hidden, aux = model_output if isinstance(model_output, tuple) else (model_output, None)
        draft = spec.propose(
            input_batch=batch, attn_metadata=attn_metadata, slot_mappings=slot_by_layer,
            last_hidden_states=get_drafter_hidden_states(st.target, hidden), aux_hidden_states=aux,
            num_sampled=torch.ones(num_reqs, dtype=torch.int32), num_rejected=torch.zeros(num_reqs, dtype=torch.int32),
            last_sampled=st.req_states.last_sampled_tokens, next_prefill_tokens=st.req_states.next_prefill_tokens,
            temperature=st.temperature, seeds=st.seeds, dummy_run=True, skip_attn_for_dummy_run=profile,
            is_profile=True)
    return {"batch": batch, "draft_tokens": draft.clone().numpy()}


def probe_dummy_run(*, drafter: str = "dspark", kind: str = "attention", fix: str | None = None,
                    pcp: int = 2, k: int = 2) -> list[DummyRunObservation]:
    """The real steps of scenario ``dspark`` (DSpark) or ``mixed`` (MTP), then one dummy run of
    ``kind`` on every rank; one observation per rank. ``fix="zero_input_block_tables"`` makes the
    PCP manager's ``get_dummy_block_tables`` also zero the shared ``input_block_tables`` (what
    ``BlockTables.get_dummy_block_tables`` does without PCP). Raises ValueError for bad arguments."""
    if drafter not in ("dspark", "mtp"):
        raise ValueError(f"drafter must be 'dspark' or 'mtp', got {drafter!r}")
    if kind not in ("profile", "attention"):
        raise ValueError(f"kind must be 'profile' or 'attention', got {kind!r}")
    if fix is not None and fix not in DUMMY_FIXES:
        raise ValueError(f"fix must be None or one of {DUMMY_FIXES}, got {fix!r}")
    sc = SCENARIOS["dspark" if drafter == "dspark" else "mixed"]
    c = ReplayConfig(pcp=pcp, k=k, shard=True, block_size=4, max_num_reqs=8, max_num_tokens=96, max_model_len=128,
                     vocab=97, hidden=8)
    sched = ScriptedScheduler(sc, c)
    vllm_config = stand_in_vllm_config(c, drafter)
    group = FakePCPGroup(pcp, timeout=120.0)
    states: list[Any] = [None] * pcp

    def build(rank: int) -> None:
        states[rank] = RankState(c, vllm_config, PCPManager, sched.num_slots, drafter)
        if fix == "zero_input_block_tables":
            _zeroing_dummy_block_tables(states[rank])

    run_ranks(group, build)
    for step in range(sc.num_steps):
        out, _ = sched.schedule(step, True)
        outs = run_ranks(group, lambda rank: rank_step(states[rank], out, step=step, sched=sched))
        sched.update(out, outs[0].req_ids, num_sampled=outs[0].num_sampled, num_rejected=outs[0].num_rejected)
    live = {rid: list(b) for rid, b in sched.blocks.items() if rid not in sched.finished}
    return run_ranks(group, lambda rank: _observe(states[rank], group, kind, live))


def _zeroing_dummy_block_tables(st: RankState) -> None:
    """The candidate fix, where it would go: ``PCPManager.get_dummy_block_tables`` also zeroes
    ``BlockTables.input_block_tables`` (through vLLM's own non-PCP method) before its own tables."""
    own = st.manager.get_dummy_block_tables

    def get_dummy_block_tables(num_reqs: int) -> tuple[torch.Tensor, ...]:
        st.block_tables.get_dummy_block_tables(num_reqs)
        return own(num_reqs)

    st.manager.get_dummy_block_tables = get_dummy_block_tables


def _observe(st: RankState, group: FakePCPGroup, kind: str, live: dict[str, list[int]]) -> DummyRunObservation:
    kv_before = st.kv_draft.clone()
    gathers_before = group.all_gather_calls[st.rank]
    num_reqs = 1
    out = dummy_run(st, kind=kind, num_reqs=num_reqs)
    gathers = group.all_gather_calls[st.rank] - gathers_before
    rows = st.block_tables.input_block_tables[0][:num_reqs].clone().numpy()
    if kind == "profile":  # no slot mapping was handed to any KV write
        draft_slots = np.zeros(0, np.int64)
    elif st.drafter == "dspark":  # prepare_dflash_inputs' query slots
        draft_slots = st.block_tables.slot_mappings[0][: num_reqs * st.spec.num_query_per_req].clone().numpy()
    else:  # the last draft decode's compute_slot_mappings
        draft_slots = st.block_tables.slot_mappings[0][:num_reqs].clone().numpy()
    changed = (st.kv_draft != kv_before).any(dim=1).nonzero().reshape(-1).tolist()
    kv_writes = {int(s): (float(st.kv_draft[s, 0]), float(st.kv_draft[s, 1])) for s in changed}
    bs = st.c.block_size
    hits = {rid: sorted(s for s in kv_writes if s // bs in blocks) for rid, blocks in live.items()}
    hits = {rid: s for rid, s in hits.items() if s}
    non_pcp = None
    if st.drafter == "dspark" and kind == "attention":
        batch = out["batch"]
        st.block_tables.get_dummy_block_tables(num_reqs)  # what the dummy run does without PCP
        ones, zeros = torch.ones(num_reqs, dtype=torch.int32), torch.zeros(num_reqs, dtype=torch.int32)
        non_pcp = dflash_inputs_without_gather(st, batch, num_sampled=ones, num_rejected=zeros)[
            "slot_mapping_draft_no_gather"].reshape(-1)
    return DummyRunObservation(st.drafter, kind, st.rank, gathers, rows, draft_slots, kv_writes, hits, non_pcp)


def format_observations(obs: list[DummyRunObservation]) -> str:
    """One line per rank: collectives, the drafter's slots, the live requests whose K/V it wrote."""
    return "\n".join(f"{o.drafter} {o.kind} dummy run, rank {o.rank}: {o.all_gathers} all_gathers, input_block_tables "
                     f"row 0 {o.input_block_tables_rows[0, :4].tolist()}..., drafter slots {o.draft_slots.tolist()}, "
                     f"live K/V written {o.hits or 'none'}" for o in obs)


if __name__ == "__main__":  # python -m pcpviz.vllm.replay.dummy_runs: the finding's reproduction
    for kwargs in (dict(drafter="dspark"), dict(drafter="dspark", fix="zero_input_block_tables"), dict(drafter="mtp")):
        print(kwargs)
        print(format_observations(probe_dummy_run(**kwargs)))
