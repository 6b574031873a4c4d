"""What one ``propose`` call records on one PCP rank: a phase per draft forward.

``TargetDependentARSpeculator.propose`` (MTP) runs one forward per draft step: ``_prefill``
(``draft_0``) then one ``_generate_draft`` per decode step (``draft_1`` ... ``draft_{K-1}``).
A ``DraftContext`` is opened by the ``propose`` wrapper (``recording.wrappers``) and fed by the
hooks that fire inside it on the same thread: the ``_run_model`` entry (``on_forward``: the
inputs of the forward about to run), ``BlockTables.compute_slot_mappings`` and
``gather_block_tables`` on the speculator's instance, the PCP manager's draft-prefill hooks
and, for DSpark/DFlash, ``prepare_dflash_inputs`` (``on_dflash_inputs``).

At PCP = 1 (no PCP manager) ``draft_0`` runs on the whole global batch (view ``replicated``,
the target's ``T`` rows, block tables and slot mapping; ``draft_global_input_ids`` its ids).
PCP=2, K=2, two decode requests: ``draft_0`` runs on the target's rank-local rows (view
``rank_local``: this rank's share of the global batch, ``draft_global_input_ids`` the shifted
ids before the gather); ``draft_1`` runs replicated on the global batch (view ``replicated``,
``slot_mapping_draft`` of length R = 2, unexpanded); ``finish`` adds ``draft_tokens`` ``int64[R]``
to each phase from the ``int64[R, K]`` that ``propose`` returns.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from vllm.forward_context import get_forward_context, is_forward_context_available

from pcpviz.trace.packed import host_entry, int64_entry
from pcpviz.vllm.fake_group import current_fake_group
from pcpviz.vllm.recording import fingerprints
from pcpviz.vllm.recording.consumed import captured_inputs, model_call_views, model_inputs
from pcpviz.vllm.recording.host import Deferred, Fresh, block_rows, now_us


__all__ = ["DraftContext", "first_layer_slots", "fake_group_all_gathers"]

logger = logging.getLogger("vllm.pcpviz")
_warned_full = False  # the FULL-replay warning is given once per process


def fake_group_all_gathers() -> int | None:
    """all_gathers of the calling thread's rank in the replay's FakePCPGroup (None on GPUs)."""
    group = current_fake_group()
    if group is None:
        return None
    return int(group.all_gather_calls[group.rank_in_group])


def first_layer_slots(slot_mappings: Any, spec: Any, limit: int | None = None) -> Deferred | None:
    """The view [G, n] (stacked on the host) from a per-layer slot-mapping dict: one layer per
    KV-cache group (the drafter's own layer where the group has one); at most ``limit`` columns."""
    if not isinstance(slot_mappings, Mapping) or not slot_mappings:
        return None
    cfg = getattr(spec, "kv_cache_config", None)
    groups = getattr(cfg, "kv_cache_groups", None)
    draft_layers = getattr(spec, "draft_attn_layer_names", None) or set()
    rows = []
    if groups:
        for group in groups:
            names = [n for n in group.layer_names if n in slot_mappings]
            if not names:
                continue
            pick = next((n for n in names if n in draft_layers), names[0])
            rows.append(slot_mappings[pick])
    if not rows:
        rows = [next(iter(slot_mappings.values()))]
    n = min(r.shape[0] for r in rows)
    if limit is not None:
        n = min(n, limit)
    return Deferred("stack", [r[:n] for r in rows])


def _ptr(t: Any) -> int | None:
    """A tensor's address (None for anything else)."""
    return t.data_ptr() if isinstance(t, torch.Tensor) else None


class DraftContext:
    """What one ``propose`` call on one rank recorded: a phase per draft forward."""

    def __init__(self, rec: Any, spec: Any, input_batch: Any, dummy: bool) -> None:
        self.rec, self.spec, self.input_batch, self.dummy = rec, spec, input_batch, dummy
        self.num_reqs = int(input_batch.num_reqs)
        self.phases: list[str] = []
        self.block_table_gathers = 0
        self.compute_slot_calls = 0
        self.last_slots: torch.Tensor | None = None
        self.global_draft_ids: torch.Tensor | None = None
        self.dflash_inputs: dict[str, Any] | None = None
        self.t0 = now_us()
        self.all_gathers_before = fake_group_all_gathers()
        self.hidden_gathers = 0
        self.full_replays = 0  # FULL CUDA-graph replays inside this propose (graphs.py)
        self.target_rows: int | None = None  # rows of the target hidden states propose received
        self.k = int(getattr(spec, "num_speculative_steps", 1) or 1)

    def phase_name(self, k: int) -> str:
        return "dummy" if self.dummy else f"draft_{k}"

    def on_forward(self, num_tokens: int, slot_mappings: Any, graph_mode: str = "NONE") -> None:
        """Snapshot what the speculator and the PCP manager prepared for the draft forward that is
        about to run (``graph_mode``: the CUDA-graph mode it runs in, NONE, PIECEWISE or FULL)."""
        name, k, now = self._open_phase()
        if self.dummy:
            self.rec.put(name, draft_forwards=np.array(len(self.phases), dtype=np.int64))
            return
        self._prepared_views(name, k, now, num_tokens, slot_mappings, graph_mode)

    def _open_phase(self) -> tuple[str, int, int]:
        """A draft forward begins: the phase before it ends now; its name, draft step and start."""
        rec, now = self.rec, now_us()
        if self.phases and not self.dummy:
            rec.phase(self.phases[-1])["t_end_us"] = int64_entry(now)
        # propose runs one forward per draft step, in order: _prefill (step 0) then one
        # _generate_draft per decode step (counted here rather than read from the device
        # tensor current_draft_step, which would synchronize).
        k = len(self.phases)
        name = self.phase_name(k)
        rec.ledger.switch(rec, name)  # the collectives since the last forward were the phase before's
        self.phases.append(name)
        return name, k, now

    def _prepared_views(self, name: str, k: int, now: int, num_tokens: int, slot_mappings: Any, graph_mode: str, *,
                        idx: torch.Tensor | None = None) -> None:
        """The views of draft forward ``k`` as prepared (``idx``: the batch's ``idx_mapping[:R]``,
        made by the caller when it plans the phase)."""
        spec, rec = self.spec, self.rec
        views: dict[str, Any] = {"t_start_us": np.array(now, dtype=np.int64), "graph_mode": np.array(graph_mode)}
        r = self.num_reqs
        manager = spec.pcp_manager
        local = getattr(manager, "draft_prefill_batch", None)
        if idx is None and local is None:
            idx = self.input_batch.idx_mapping[:r]
        if local is not None:
            # draft_0 under PCP: the target's rank-local rows, attention metadata and gathered
            # slot mapping (pcp_manager.get_draft_input_buffers returns this batch).
            nr = local.num_reqs
            rows, stale = block_rows(spec.block_tables,
                                     [t[: local.num_reqs_after_padding] for t in manager._local_block_tables],
                                     rec.pack.head(local.idx_mapping, nr))  # the plan's dynamic tensor (on_full_replay)
            views.update(view=np.array("rank_local"), draft_input_ids=local.input_ids[:num_tokens],
                         draft_positions=local.positions[:num_tokens], draft_seq_lens=local.seq_lens[:nr],
                         block_table_draft=rows, block_table_draft_stale_tail=stale)
            if self.global_draft_ids is not None:  # the hook's own clone: copied with the phase, a dynamic tensor
                views["draft_global_input_ids"] = self.global_draft_ids
        elif k == 0 and manager is None:
            # PCP = 1: the draft prefill runs on the global batch with the target's attention
            # metadata, block tables and slot mapping (its ids are the global shifted ids).
            buf, g = spec.input_buffers, self.input_batch
            rows, stale = block_rows(spec.block_tables, [t[:r] for t in spec.block_tables.input_block_tables], idx)
            views.update(view=np.array("replicated"), draft_input_ids=buf.input_ids[:num_tokens],
                         draft_positions=buf.positions[:num_tokens], draft_seq_lens=g.seq_lens[:r],
                         draft_global_input_ids=buf.input_ids[: g.num_tokens],
                         block_table_draft=rows, block_table_draft_stale_tail=stale)
        else:
            buf = spec.input_buffers
            rows, stale = block_rows(spec.block_tables, [t[:r] for t in spec.block_tables.input_block_tables], idx)
            views.update(view=np.array("replicated"), draft_input_ids=buf.input_ids[:num_tokens][:r],
                         draft_positions=buf.positions[:num_tokens][:r], draft_seq_lens=buf.seq_lens[:r],
                         block_table_draft=rows, block_table_draft_stale_tail=stale)
        if k == 0:
            views["draft_last_token_indices"] = spec.last_token_indices[:r]
        slots = None
        if local is None and k > 0 and self.last_slots is not None:
            slots = self.last_slots[:, :r]  # compute_slot_mappings of this decode step: unexpanded
        if slots is None:
            slots = first_layer_slots(slot_mappings, spec, r if local is None and k > 0 else None)
        if slots is not None:
            views["slot_mapping_draft"] = slots
        rec.put(name, **views)

    def on_run_model(self, num_tokens: int, slot_mappings: Any, graph_mode: str = "NONE") -> None:
        """``_run_model``'s entry: ``on_forward`` and the phase's ``hidden_in_fp``, in one copy."""
        with self.rec.pack.hold():
            self.on_forward(num_tokens, slot_mappings, graph_mode)
            fingerprints.before_forward(self, num_tokens)

    def on_model_call(self, args: tuple, kwargs: dict) -> None:
        """The draft model was called (eager or PIECEWISE): the ``fwd_*`` views of the phase
        (``recording.consumed``), its arguments as the model got them."""
        if self.dummy or not self.phases:
            return
        ids, pos, hidden = model_inputs(args, kwargs)
        k = len(self.phases) - 1
        rows = self.num_reqs if k > 0 else None  # draft decodes: the padded batch's first R rows
        slots = None
        if is_forward_context_available():
            slots = first_layer_slots(get_forward_context().slot_mapping, self.spec, rows)
        self.rec.put(self.phases[-1], **model_call_views(ids, pos, hidden, slots=slots, source="model_call", rows=rows))

    def on_full_replay(self, manager: Any, desc: Any) -> None:
        """A draft forward replayed as a FULL CUDA graph (no Python runs inside it): its phase
        from the buffers the graph reads, right before the replay; ``fwd_source`` says whether
        they are the tensors noted at capture (``graph_capture``) or the speculator's buffers
        (``graph_buffers``). A shape replayed before is one copy (``recording.replayplan``)."""
        n = int(desc.num_tokens)
        key = self._plan_key(manager, n)
        pack = self.rec.pack
        if key is None:
            with pack.hold():  # the phase's views in one copy
                self._full_replay_views(manager, n, self._open_phase())
            return
        opened = self._open_phase()
        phase = self.rec.phase(opened[0])
        local = getattr(self.spec.pcp_manager, "draft_prefill_batch", None)
        if local is not None:  # PCP's draft_0: the rank-local batch's idx_mapping and the global ids' clone
            dynamic = [pack.head(local.idx_mapping, local.num_reqs)]
            if self.global_draft_ids is not None:
                dynamic.append(self.global_draft_ids)
        else:
            dynamic = [pack.head(self.input_batch.idx_mapping, self.num_reqs)]
        plan = pack.book.get(key)
        if plan is not None and pack.replay(plan, phase, dynamic):
            phase["t_start_us"] = int64_entry(opened[2])
            return
        with pack.planning(phase, dynamic) as made:
            self._full_replay_views(manager, n, opened, idx=dynamic[0])
        if made[0] is not None:
            pack.book.add(key, made[0])

    def _plan_key(self, manager: Any, n: int) -> tuple | None:
        """What a FULL-replayed phase's views depend on besides the bytes of vLLM's buffers: the
        graph's manager and size, the draft step, the request count and the address of every
        buffer the views read (a buffer vLLM rotates, e.g. ``num_blocks``' UVA pool of
        ``buffer_utils.py:64-110``, gets a plan per address). PCP's rank-local draft_0 reads the
        local batch, a new object every step over the manager's persistent buffers: keyed by those
        (``_local_plan_key``). None: not planned (a dummy run)."""
        spec = self.spec
        if self.dummy:
            return None
        if getattr(spec.pcp_manager, "draft_prefill_batch", None) is not None:
            return self._local_plan_key(manager, n)
        k, g, buf, bt = len(self.phases), self.input_batch, spec.input_buffers, spec.block_tables
        slots = self.last_slots if k > 0 and self.last_slots is not None else None
        ptrs = [_ptr(buf.input_ids), _ptr(buf.positions), _ptr(buf.seq_lens), _ptr(bt.num_blocks.gpu),
                _ptr(spec.hidden_states), *(_ptr(t) for t in bt.input_block_tables)]
        if k == 0:
            ptrs += [_ptr(spec.last_token_indices), _ptr(g.seq_lens), g.num_tokens, self.target_rows]
        if slots is not None:
            ptrs += [_ptr(slots), slots.shape, slots.stride()]
        return (id(manager), n, k, self.num_reqs, id(captured_inputs(manager, n)), id(spec), spec.pcp_manager is None,
                *ptrs)

    def _local_plan_key(self, manager: Any, n: int) -> tuple | None:
        """``_plan_key`` of PCP's draft_0: the local batch's sizes and buffers, the manager's local block
        tables, and the global ids' clone's shape (its bytes are a dynamic tensor)."""
        spec, k = self.spec, len(self.phases)
        m = spec.pcp_manager
        local, bt, ids = m.draft_prefill_batch, spec.block_tables, self.global_draft_ids
        if k != 0:
            return None
        ptrs = [_ptr(local.input_ids), _ptr(local.positions), _ptr(local.seq_lens), _ptr(bt.num_blocks.gpu),
                _ptr(spec.hidden_states), _ptr(spec.last_token_indices), *(_ptr(t) for t in m._local_block_tables)]
        return ("rank_local", id(manager), n, self.num_reqs, local.num_reqs, local.num_reqs_after_padding,
                self.target_rows, None if ids is None else (ids.dtype, tuple(ids.shape)),
                id(captured_inputs(manager, n)), id(spec), *ptrs)

    def _full_replay_views(self, manager: Any, n: int, opened: tuple[str, int, int], *,
                           idx: torch.Tensor | None = None) -> None:
        name, k, now = opened
        if self.dummy:
            self.rec.put(name, draft_forwards=np.array(len(self.phases), dtype=np.int64))
        else:
            self._prepared_views(name, k, now, n, None, "FULL", idx=idx)
        fingerprints.before_forward(self, n)
        rows = self.num_reqs if k > 0 else n
        cap = captured_inputs(manager, n)
        if cap is not None:
            ids, pos, hidden = cap["input_ids"], cap["positions"], cap["hidden_states"]
            slots, source = first_layer_slots(cap["slot_mapping"], self.spec, rows), "graph_capture"
        else:
            buf = self.spec.input_buffers
            ids, pos, hidden = buf.input_ids, buf.positions, self.spec.hidden_states
            slots, source = None, "graph_buffers"
        self.rec.put(name, **model_call_views(ids, pos, hidden, slots=slots, source=source, rows=rows))

    def _replayed_phases(self, k: int) -> None:
        """Draft forwards that ran inside another FULL replay (a fused multi-step decode graph)
        or whose replay was not seen: their phases get the draft tokens only, and the process
        warns once."""
        missing = [f"draft_{i}" for i in range(k) if f"draft_{i}" not in self.phases]
        if not missing:
            return
        global _warned_full
        if not _warned_full:
            _warned_full = True
            logger.warning("pcpviz: %s ran inside another draft step's FULL CUDA-graph replay (a fused multi-step "
                           "decode graph runs no Python between its steps): their inputs are not recorded, only their "
                           "draft tokens", ", ".join(missing))
        for name in missing:
            self.rec.put(name, view=np.array("rank_local" if name == "draft_0" and self.spec.pcp_manager is not None
                                             else "replicated"), graph_mode=np.array("FULL"))
        self.phases = sorted(set(self.phases) | set(missing), key=lambda n: int(n.split("_")[1]))

    def on_compute_slot_mappings(self, out: torch.Tensor) -> None:
        """A draft decode step's slot mapping (``[G, n]``): the next draft forward reads it, and
        its views copy it before anything writes it again. vLLM returns a view of its persistent
        ``slot_mappings`` (or of ``out``; ``block_table.py:229-262``), the same memory every step."""
        self.compute_slot_calls += 1
        self.last_slots = out.detach()

    def on_gather_block_tables(self) -> None:
        self.block_table_gathers += 1

    def on_dflash_inputs(self, input_buffers: Any, query_slots: torch.Tensor, *, context_positions: torch.Tensor,
                         context_slots: torch.Tensor) -> None:
        """DSpark/DFlash's replicated drafter inputs on the global batch (one draft forward),
        what ``prepare_dflash_inputs`` just wrote."""
        spec, batch = self.spec, self.input_batch
        r, t = int(batch.num_reqs), int(batch.num_tokens)
        nq = r * int(spec.num_query_per_req)
        self.dflash_inputs = dict(
            view=np.array("replicated"),
            draft_input_ids=input_buffers.input_ids[:nq],
            draft_positions=input_buffers.positions[:nq],
            draft_seq_lens=input_buffers.seq_lens[:r],
            draft_query_start_loc=input_buffers.query_start_loc[: r + 1],
            slot_mapping_draft=query_slots[:nq].unsqueeze(0),
            draft_context_positions=context_positions[:t],
            draft_context_slot_mapping=context_slots[:t].unsqueeze(0),
            block_table_draft=block_rows(spec.block_tables, [b[:r] for b in spec.block_tables.input_block_tables],
                                         batch.idx_mapping[:r])[0],
            t_start_us=np.array(self.t0, dtype=np.int64),
        )
        self.phases = ["draft_0"]

    def finish(self, draft_tokens: torch.Tensor | None) -> None:
        """Close the last phase and add the proposed tokens (``int64[R, K]``), one column per phase."""
        rec = self.rec
        now = np.array(now_us(), dtype=np.int64)
        if self.dummy:
            rec.put("dummy", num_reqs=np.array(self.num_reqs, dtype=np.int64),
                    block_table_gathers=np.array(self.block_table_gathers, dtype=np.int64),
                    compute_slot_mapping_calls=np.array(self.compute_slot_calls, dtype=np.int64),
                    pcp_hidden_all_gathers=np.array(self.hidden_gathers, dtype=np.int64),
                    t_start_us=np.array(self.t0, dtype=np.int64), t_end_us=now)
            group_gathers = fake_group_all_gathers()
            if group_gathers is not None and self.all_gathers_before is not None:
                rec.put("dummy", all_gathers=np.array(group_gathers - self.all_gathers_before, dtype=np.int64))
            if draft_tokens is not None:
                rec.put("dummy", draft_tokens=draft_tokens)
            return
        if self.phases:
            rec.phase(self.phases[-1])["t_end_us"] = host_entry(now)
        if self.dflash_inputs is not None:
            rec.put("draft_0", **self.dflash_inputs)
            rec.put("draft_0", block_table_gathers=np.array(self.block_table_gathers, dtype=np.int64))
        if draft_tokens is None:
            return
        dt = draft_tokens.detach() if draft_tokens.requires_grad else draft_tokens
        # propose's return value, copied at the end of the step (now) with the other fresh
        # tensors; each phase's column is cut on the host.
        columns = Deferred("columns", [Fresh(dt)])
        if self.dflash_inputs is None:
            self._replayed_phases(dt.shape[1])
        if self.dflash_inputs is not None:
            # DSpark/DFlash: one replicated forward proposes all K tokens of a request. The
            # view contract is one token per request per draft phase: draft_tokens is the first
            # of them, draft_block_tokens all K.
            rec.put("draft_0", draft_tokens=columns, draft_block_tokens=Fresh(dt))
            return
        for name in self.phases:
            k = int(name.split("_")[1])
            if k < dt.shape[1]:
                rec.put(name, draft_tokens=columns.output(k))
