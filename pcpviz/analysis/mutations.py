"""Realistic PCP + MTP bugs that are in no catalogue, as source patches of the engine, for the
diagnosis benchmark (``benchmarks/bench_diagnosis.py``) and its CI subset.

A ``Mutation`` names the file (relative to the ``pcpviz`` package), the exact text it replaces
(which must occur once) and the replacement, where the bug lives (``phase``, ``view``: the first
wrong value a correct diagnosis points at), and whether it is a ``harmless`` refactor (its runs
must equal the clean ones). ``apply(root)`` patches a copy of the package under ``root``;
``plant(name, root)`` makes that copy, ready to run (``python -m pcpviz.analysis.mutations NAME
DIR`` from a shell; then run with ``PYTHONPATH=DIR``: the README's tour and notebook 04 do this to
show a bug in no catalogue).

PCP=2 example: ``draft_wrong_request_slot`` rolls the batch's ``idx_mapping`` by one row in the
draft decodes' slot computation, so request 1 writes its draft KV into request 0's block; the
first wrong value is draft_1's ``slot_mapping_draft``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Mutation", "MUTATIONS", "DCP_MUTATIONS", "PLANTED_MARK", "copy_package", "plant", "run_planted", "main"]


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    phase: str | None  # where the first wrong value is ("draft_k": any draft step k >= 1)
    view: str | None
    what: str
    harmless: bool = False

    def at_own_place(self, phase: str | None, view: str | None) -> bool:
        """A first violation at ``phase``/``view`` points at this bug (``draft_k``: any k >= 1;
        ``view`` may list alternatives, ``a|b``)."""
        if phase is None or self.phase is None:
            return False
        same = phase == self.phase or (self.phase == "draft_k" and phase.startswith("draft_") and phase != "draft_0")
        return same and view in self.view.split("|")

    def apply(self, root: Path) -> None:
        """Patch the package copy under ``root`` (``root/pcpviz/...``)."""
        p = Path(root) / "pcpviz" / self.file
        src = p.read_text()
        if src.count(self.old) != 1:
            raise ValueError(f"mutation {self.name}: the text to replace occurs {src.count(self.old)} times "
                             f"in {self.file}")
        p.write_text(src.replace(self.old, self.new))


def copy_package(src: Path, root: Path) -> Path:
    """A copy of the ``pcpviz`` package ``src`` under ``root`` (caches left out)."""
    dst = Path(root) / "pcpviz"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


_M = Mutation
# the views a layout bug shows up in first (any of them)
_LAYOUT_VIEWS = ("segments|per_rank_num_tokens|padded_gather_idx|hidden_restore_idx|kv_write_mask|local_input_ids"
                 "|local_positions")
MUTATIONS: tuple[Mutation, ...] = (
    _M("next_prompt_token_off_by_one", "engine/speculator.py",
       "end = row.prompt_start + row.num_tokens\n", "end = row.prompt_start + row.num_tokens + 1\n",
       "draft_0", "draft_global_input_ids", "chunk boundary: a partial chunk's last draft id is the prompt token "
       "after the next"),
    _M("partial_chunk_last_row_stale", "reference/drafts.py",
       "    ok = valid > 0\n", "    ok = (valid > 0) & (np.asarray(num_sampled) > 0)\n",
       "draft_0", "draft_global_input_ids", "chunk boundary: a partial chunk's last row keeps its stale shifted id"),
    _M("last_token_index_off_by_one", "reference/drafts.py",
       "last = (qsl[:-1] + valid - 1).astype(np.int64)",
       "last = (qsl[:-1] + np.maximum(valid - 2, 0)).astype(np.int64)",
       "draft_0", "draft_last_token_indices", "off-by-one: the draft reads the row before the last accepted one"),
    _M("draft_ids_wrong_rank_slice", "engine/speculator.py",
       "local_ids = draft_ids[local.gather_idx] if draft_ids.size",
       "local_ids = draft_ids[h.layout.local_gather_idx((worker.rank + 1) % n)] if draft_ids.size",
       "draft_0", "draft_input_ids", "gather: draft_0 takes the next rank's slice of the shifted ids"),
    _M("draft_block_table_wrong_request", "engine/worker.py",
       "rows = gather_block_table_rows(table, idx_mapping, max(r, self._dirty_rows))",
       "rows = gather_block_table_rows(table, np.roll(idx_mapping, 1) if self.group.world_size > 1 else idx_mapping, "
       "max(r, self._dirty_rows))",
       "draft_k", "block_table_draft", "block tables: the draft decodes read the previous request's row"),
    _M("draft_slot_wrong_request", "engine/speculator.py",
       "slots = compute_slot_mappings(table, cfg.block_size, batch.idx_mapping, query_start_loc=qsl,",
       "slots = compute_slot_mappings(table, cfg.block_size, np.roll(batch.idx_mapping, 1), query_start_loc=qsl,",
       "draft_k", "slot_mapping_draft", "slots: draft KV written into another request's blocks"),
    _M("draft_hidden_not_restored", "engine/speculator.py",
       'h_last = worker.group.all_gather(mtp_local)[d["restore"]][dt["read_idx"]]',
       'h_last = worker.group.all_gather(mtp_local)[dt["read_idx"]]',
       "draft_0", "hidden_last_fp", "hidden states: draft_0's output read in gathered (rank-major) order"),
    _M("draft_hidden_not_chained", "engine/speculator.py",
       "            hidden = model.mtp_recycle_hidden(mtp_h)\n",
       "            hidden = model.mtp_recycle_hidden(h_last)\n",
       "draft_k", "hidden_in_fp", "hidden states: every draft step reads draft_0's hidden state"),
    _M("draft_prefill_hidden_shifted", "engine/speculator.py",
       "hidden_in = hidden_local  #", "hidden_in = torch.roll(hidden_local, 1, 0)  #",
       "draft_0", "hidden_in_fp", "hidden states: the MTP layer reads the target hidden of the row before"),
    _M("draft_positions_ignore_rejections", "engine/speculator.py",
       "steps = draft_decode_positions(batch.positions, last_idx, k)",
       "steps = draft_decode_positions(batch.positions, batch.query_start_loc[1:] - 1, k)",
       "draft_k", "draft_positions", "positions: draft decodes start after the last scheduled row, not the last "
       "accepted one"),
    _M("draft_seq_len_off_by_one", "engine/speculator.py",
       'out["seq_lens"].append(positions + 1)', 'out["seq_lens"].append(positions)',
       "draft_k", "draft_seq_lens", "off-by-one: draft decodes attend one token short"),
    _M("extra_accepted_draft", "engine/verify.py",
       "        out = rows[: a + 1]\n",
       "        if 0 < a < d:\n            a += 1  # bug: one draft past the first mismatch accepted\n"
       "        out = rows[: a + 1]\n",
       "verify", "num_accepted|sampled_token_ids",
       "verification: one draft past the first mismatch accepted (tokens change)"),
    _M("gathered_slots_unmasked", "reference/blocks.py",
       "return np.where(layout.kv_write_mask[None, :], picked, PAD_SLOT_ID)", "return picked",
       "target", "slot_mapping_gathered", "slots: padding rows (and every copy) written to the KV cache"),
    _M("target_slot_block_boundary", "reference/blocks.py",
       "blk_idx = local_p // bs if enabled[gi] else np.zeros_like(local_p)",
       "blk_idx = np.minimum((local_p + 1) // bs, table.shape[1] - 1) if enabled[gi] else np.zeros_like(local_p)",
       "target", "slot_mapping_global|slot_mapping_gathered",
       "slots: the target's last slot of each block lands in the next block"),
    _M("logits_row_off_by_one", "engine/worker.py",
       "logits_indices = np.repeat(qsl[1:] - n, n)", "logits_indices = np.repeat(np.maximum(qsl[1:] - n - 1, 0), n)",
       "target", "logits_indices", "sampling: every request samples from the row before its own"),
    _M("rank1_hidden_not_restored", "engine/worker.py",
       'hidden_global = self.group.all_gather(hidden_local)[d["restore"]]  # [T, H]',
       'hidden_global = self.group.all_gather(hidden_local)[d["restore"] if self.rank == 0 else '
       'd["restore"].clamp(max=hidden_local.shape[0] - 1)]  # [T, H]',
       "target", "hidden_fp", "rank-specific: rank > 0 restores from the wrong gathered rows (tokens fork)"),
    _M("rank1_seq_lens_short", "engine/worker.py",
       "            local_seq_lens = local.seq_lens\n",
       "            local_seq_lens = local.seq_lens - (self.rank == 1) * (local.seq_lens > 1)\n",
       "target", "local_seq_lens", "rank-specific: rank 1's target attends one token short"),
    _M("drafts_fed_to_wrong_request", "engine/worker.py",
       "st.drafts = a[i].copy() if keep[i] else empty",
       "st.drafts = a[(i + 1) % len(req_ids)].copy() if keep[i] else empty",
       "target", "scheduled_draft_ids", "drafts of the next request kept and scheduled (only acceptance "
       "changes; first wrong: the drafts the request state keeps, then the input ids)"),
    _M("cursor_not_rolled_back", "engine/worker.py",
       "st.num_computed += int(batch.num_scheduled_tokens[i]) - rejected\n",
       "st.num_computed += int(batch.num_scheduled_tokens[i]) - max(rejected - 1, 0)\n",
       "verify", "num_computed_after", "positions after a rejection: the GPU cursor keeps one rejected token "
       "(first wrong: the cursor the verify leaves, then the next step's positions)"),
    _M("decode_owner_shifted", "reference/chunks.py",
       "ids = (0,) if decode_ordinal % pcp_world_size == rank else ()",
       "ids = (0,) if (decode_ordinal + 1) % pcp_world_size == rank else ()",
       "target", _LAYOUT_VIEWS, "layout: sharded decodes owned by the next rank (not vLLM's plan)"),
    _M("prefill_chunk_size_off_by_one", "reference/chunks.py",
       "            size = chunk_size(query_len, pcp_world_size)\n",
       "            size = chunk_size(query_len, pcp_world_size) + (query_len > 8 * pcp_world_size)\n",
       "target", _LAYOUT_VIEWS, "chunk boundary: long prefill rows cut into chunks one token too long"),
    _M("draft_decode_block_rows_stale_by_one", "engine/speculator.py",
       "block_rows = worker.input_block_tables[:r].copy()",
       "block_rows = np.concatenate([worker.input_block_tables[:max(r - 1, 0)], worker.input_block_tables[r:r + 1]])"
       " if r > 1 else worker.input_block_tables[:r].copy()",
       "draft_k", "block_table_draft", "block tables: the last request's row read one past the batch"),
    _M("must_sample_a_chunk_early", "engine/verify.py",
       "if prefilling[i] and st.num_computed + q[i] < st.prompt_len:",
       "if prefilling[i] and st.num_computed + 2 * q[i] < st.prompt_len:",
       "verify", "num_sampled", "chunked prefill: the must-sample rule looks one chunk ahead, so the chunk "
       "before a prompt's last samples (seq_len < prefill_len)"),
    # -- harmless refactors: the runs must equal the clean ones, and no tool may raise an alarm
    _M("refactor_sampled_last_numpy", "engine/speculator.py",
       "sampled_last = np.array([s[-1] if len(s) else -1 for s in verify.sampled], dtype=np.int64)",
       "sampled_last = np.fromiter((s[-1] if s else -1 for s in verify.sampled), np.int64, len(verify.sampled))",
       None, None, "refactor: the last sampled tokens built with fromiter", harmless=True),
    _M("refactor_shift_with_roll", "reference/drafts.py",
       "    out = np.empty_like(ids)\n    if ids.size:\n        out[:-1] = ids[1:]\n        out[-1] = ids[-1]\n",
       "    out = np.roll(ids, -1)\n    if ids.size:\n        out[-1] = ids[-1]\n",
       None, None, "refactor: the shifted ids with np.roll", harmless=True),
    _M("refactor_decode_positions_loop", "reference/drafts.py",
       "    out = first[None, :] + np.arange(1, max(int(k), 1), dtype=np.int64)[:, None]\n",
       "    out = np.stack([first + s for s in range(1, max(int(k), 1))]) if int(k) > 1 else "
       "np.zeros((0, first.shape[0]), np.int64)\n",
       None, None, "refactor: the draft positions step by step", harmless=True),
)

DCP_MUTATIONS: tuple[Mutation, ...] = (
    _M("dcp_kernel_block_size_ignored", "engine/worker.py",
       "        return compute_slot_mappings(table, self.cfg.block_size, idx_mapping, "
       "query_start_loc=query_start_loc,\n                                     positions=positions, **self.dcp_kw())\n",
       "        from pcpviz.reference.dcp import kernel_block_table\n"
       "        k = self.cfg.block_size // 2  # the attention kernel's block size, in place of the manager's\n"
       "        kt = kernel_block_table(table, block_size=self.cfg.block_size, kernel_block_size=k)\n"
       "        return compute_slot_mappings(kt, k, idx_mapping, query_start_loc=query_start_loc,\n"
       "                                     positions=positions, **self.dcp_kw())\n",
       "target", "slot_mapping_global", "vllm#51031 class: the DCP slot mapping computes ownership and local "
       "offsets with the kernel block size (half the manager's); wrong once the interleave exceeds it"),
    _M("dcp_draft_local_len_off_by_one", "engine/speculator.py",
       "            lens = draft_local_lens(positions, dcp_size=cfg.dcp, "
       "interleave=cfg.dcp_interleave)[worker.rank]\n",
       "            lens = draft_local_lens(positions - 1, dcp_size=cfg.dcp, "
       "interleave=cfg.dcp_interleave)[worker.rank]\n",
       "draft_k", "dcp_local_seq_lens", "the draft decodes' per-rank local_len from seq_len - 1: the rank that "
       "owns the draft token leaves it out of its attention"),
)
"""Planted DCP bugs: they need a run with ``dcp`` > 1 (the first also ``dcp_interleave`` > block_size / 2),
so they are not in ``MUTATIONS`` (the diagnosis benchmark runs at DCP = 1); ``plant`` takes them by name."""


PLANTED_MARK = ".pcpviz-planted"
"""The file ``plant`` leaves in its directory (holding the mutation's name): what ``overwrite`` may replace."""


def plant(name: str, root: Path | str, *, overwrite: bool = False) -> Path:
    """Copy this ``pcpviz`` package to ``root/pcpviz``, apply mutation ``name`` to the copy and
    link ``root/data`` to this checkout's ``data/`` (the model the engine loads); returns
    ``root``. Run the planted engine with ``PYTHONPATH=root`` ahead of this one.

    Raises ValueError for an unknown name or a ``root`` that exists and is not empty, unless
    ``overwrite`` and ``root`` is an earlier planted copy (it holds ``PLANTED_MARK`` and nothing
    but what ``plant`` writes): then that copy is replaced."""
    by_name = {m.name: m for m in MUTATIONS + DCP_MUTATIONS}
    if name not in by_name:
        raise ValueError(f"unknown mutation {name!r} (python -m pcpviz.analysis.mutations --list)")
    root = Path(root)
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        raise ValueError(f"{root}: not a directory")
    if root.exists() and any(root.iterdir()):
        own = {"pcpviz", "data", PLANTED_MARK}
        if not (overwrite and (root / PLANTED_MARK).is_file() and {p.name for p in root.iterdir()} <= own):
            raise ValueError(f"{root}: exists and is not empty"
                             + ("" if overwrite else " (--overwrite replaces an earlier planted copy)"))
        shutil.rmtree(root / "pcpviz", ignore_errors=True)
        if (root / "data").is_symlink():
            (root / "data").unlink()
    src = Path(__file__).resolve().parents[1]
    copy_package(src, root)
    data = src.parent / "data"
    if data.is_dir():
        (root / "data").symlink_to(data)
    by_name[name].apply(root)
    (root / PLANTED_MARK).write_text(name + "\n")
    return root


_RUN = ("import json, sys, pcpviz; o = json.loads(sys.argv[1]); p = o.pop('prompts'); "
        "o.setdefault('progress', False); pcpviz.run(p, trace_dir=sys.argv[2], **o)")


def run_planted(root: Path | str | None, prompts: list[str], trace_dir: Path | str, *,
                timeout: float = 900, **options) -> Path:
    """``pcpviz.run(prompts, trace_dir=trace_dir, **options)`` in a child process importing the
    package under ``root`` (a ``plant`` copy; None: this package), so a planted bug runs beside
    the clean code of the calling process. Returns the trace directory; raises RuntimeError with
    the child's last error line when the run fails."""
    here = Path(__file__).resolve().parents[2]
    path = ([str(Path(root).resolve())] if root is not None else []) + [str(here), str(here / "kernels")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    r = subprocess.run([sys.executable, "-P", "-c", _RUN, json.dumps(dict(options, prompts=list(prompts))),
                        str(trace_dir)], env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = [x for x in (r.stderr or r.stdout).strip().splitlines() if x.strip()]
        raise RuntimeError(f"the run in {trace_dir} failed: {tail[-1][:200] if tail else f'exit {r.returncode}'}")
    return Path(trace_dir)


def main(argv: list[str] | None = None) -> int:
    """``python -m pcpviz.analysis.mutations NAME DIR`` plants a bug; ``--list`` lists them."""
    ap = argparse.ArgumentParser(prog="python -m pcpviz.analysis.mutations",
                                 description="Plant a realistic bug that is in no catalogue into a copy of pcpviz.")
    ap.add_argument("name", nargs="?", help="the mutation (--list shows them)")
    ap.add_argument("dir", nargs="?", help="an empty or new directory for the planted copy")
    ap.add_argument("--list", action="store_true", help="list the mutations and what each breaks")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier planted copy in DIR")
    a = ap.parse_args(argv)
    if a.list or a.name is None:
        for m in MUTATIONS:
            print(f"{m.name:38s} {'(harmless refactor) ' if m.harmless else ''}{m.what}")
        return 0
    if a.dir is None:
        print("mutations: give the directory for the planted copy (NAME DIR)", file=sys.stderr)
        return 2
    try:
        root = plant(a.name, a.dir, overwrite=a.overwrite)
    except (ValueError, OSError) as exc:
        print(f"mutations: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"planted {a.name} in {root}/pcpviz; run it with PYTHONPATH={root} (e.g. PYTHONPATH={root} pcpviz run ...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
